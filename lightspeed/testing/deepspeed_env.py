"""The separate Python environment with real DeepSpeed that the tests resume lightspeed's checkpoints in.

Owns where that environment is (`venv_dir`: ``$LIGHTSPEED_DEEPSPEED_VENV``, else
``~/.cache/lightspeed/deepspeed-<version>-venv``), creating it (`ensure`, also ``python -m
lightspeed.testing.deepspeed_env``, which CI runs before the tests) and finding its Python (`python`,
None when absent or broken, so tests skip with the reason `missing_reason`). It is a venv with
``--system-site-packages``: it reuses the installed torch and adds ``deepspeed==<version>`` (built
without its C++ ops, ``DS_BUILD_OPS=0``) and what DeepSpeed needs that is missing. Must not: be
imported by the package (DeepSpeed must never be importable in lightspeed's own environment: there
``register_as_deepspeed()`` refuses to shadow it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

DEEPSPEED_VERSION = "0.19.8"
ENV_VAR = "LIGHTSPEED_DEEPSPEED_VENV"


def venv_dir() -> Path:
    given = os.environ.get(ENV_VAR)
    if given:
        return Path(given)
    return Path.home() / ".cache" / "lightspeed" / f"deepspeed-{DEEPSPEED_VERSION}-venv"


def _python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _works(py: Path) -> bool:
    if not py.is_file():
        return False
    probe = f"import deepspeed, sys; sys.exit(deepspeed.__version__ != {DEEPSPEED_VERSION!r})"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run([str(py), "-c", probe], env=env, capture_output=True, timeout=300).returncode == 0


def python() -> Path | None:
    """The DeepSpeed environment's Python, or None when it is not there (or its deepspeed does not import)."""
    py = _python_of(venv_dir())
    return py if _works(py) else None


def missing_reason() -> str:
    return (f"no DeepSpeed {DEEPSPEED_VERSION} environment at {venv_dir()} (create it with "
            f"`python -m lightspeed.testing.deepspeed_env`, as .ci/run does; or set {ENV_VAR})")


def worker_env() -> dict[str, str]:
    """The environment a DeepSpeed process of the tests runs in: the CPU accelerator, one thread."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def ensure() -> Path:
    """Create the environment unless it works already (idempotent); returns its Python."""
    venv = venv_dir()
    py = _python_of(venv)
    if _works(py):
        return py
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv)], check=True)
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"deepspeed=={DEEPSPEED_VERSION}", "tabulate"], check=True, env=env)  # tabulate: its autotuner's extra
    if not _works(py):
        raise RuntimeError(f"{venv}: deepspeed=={DEEPSPEED_VERSION} installed but does not import")
    return py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    start = time.monotonic()
    py = ensure()
    print(f"DeepSpeed {DEEPSPEED_VERSION} environment: {py} ({time.monotonic() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
