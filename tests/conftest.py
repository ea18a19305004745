"""Test-session settings. Without a GPU, Triton kernels run under the interpreter: triton reads
TRITON_INTERPRET when it is imported, so it is set here, before any test module imports it."""
import importlib.metadata
import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `no_real_deepspeed` register lightspeed as `deepspeed` without override, which an
    installed DeepSpeed (e.g. one installed for the benchmarks' comparisons) rightly refuses."""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return
    skip = pytest.mark.skip(reason=f"DeepSpeed {version} is installed; this test registers lightspeed in its place")
    for item in items:
        if "no_real_deepspeed" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ls_caplog(caplog):
    """caplog that sees lightspeed's warnings (its logger does not propagate to the root logger)."""
    logger = logging.getLogger("lightspeed")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="lightspeed")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


class FakeCompiled:
    """Stands in for triton's CompiledKernel in launch-plan tests: records launches instead of running them."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        self.launches.append(((g0, g1, g2), stream, args))


@pytest.fixture
def fake_compiled():
    return FakeCompiled()
