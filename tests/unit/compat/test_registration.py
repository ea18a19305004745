"""register_as_deepspeed(): `import deepspeed` and the `deepspeed` distribution's metadata resolve to
lightspeed, as transformers and accelerate detect them. Tests that register run in a subprocess (or
undo the registration), so nothing leaks into other tests."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _run(code: str, extra_path: str | None = None, args=(), check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), extra_path, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.no_real_deepspeed
def test_registration_is_seen_by_importlib_transformers_and_accelerate():
    proc = _run("""
        import importlib.metadata, importlib.util, sys
        import lightspeed
        assert importlib.util.find_spec("deepspeed") is None
        before = len(sys.meta_path)
        lightspeed.register_as_deepspeed()
        lightspeed.register_as_deepspeed()  # idempotent
        assert len(sys.meta_path) == before + 2, sys.meta_path
        assert importlib.util.find_spec("deepspeed") is not None
        assert importlib.metadata.version("deepspeed") == "0.19.8"
        assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
        assert "deepspeed" in {d.metadata["Name"] for d in importlib.metadata.distributions()}

        import deepspeed, deepspeed.comm, deepspeed.zero
        import lightspeed.compat.deepspeed as compat
        assert deepspeed is compat and deepspeed.__version__ == "0.19.8"
        assert deepspeed.comm is sys.modules["lightspeed.compat.deepspeed.comm"]
        assert deepspeed.__spec__.name == "lightspeed.compat.deepspeed"  # the module keeps its own spec

        from transformers.integrations.deepspeed import is_deepspeed_available as hf_available
        from accelerate.utils import is_deepspeed_available as acc_available
        from accelerate.utils import compare_versions
        from transformers.utils.versions import require_version
        assert hf_available() and acc_available()
        require_version("deepspeed>=0.9.3")  # transformers' HfDeepSpeedConfig gate
        assert compare_versions("deepspeed", ">=", "0.18.2")  # accelerate's strictest gate
        print("OK")
    """)
    assert proc.stdout.strip().endswith("OK")
    assert proc.stderr.count("registered lightspeed as deepspeed 0.19.8") == 1  # logged once


def _fake_deepspeed(tmp_path: Path, version: str = "0.14.0") -> str:
    info = tmp_path / f"deepspeed-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    return str(tmp_path)


@pytest.mark.no_real_deepspeed
def test_refuses_when_a_deepspeed_distribution_is_installed(tmp_path):
    proc = _run("""
        import lightspeed
        from lightspeed.compat import RegistrationError
        try:
            lightspeed.register_as_deepspeed()
        except RegistrationError as e:
            print("REFUSED:", e)
        else:
            raise SystemExit("registered over an installed DeepSpeed")
        import importlib.util
        assert importlib.util.find_spec("deepspeed") is None
    """, extra_path=_fake_deepspeed(tmp_path))
    line = proc.stdout.strip()
    assert line.startswith("REFUSED:") and "\n" not in line
    assert "DeepSpeed 0.14.0 is installed" in line and "override=True" in line


def test_override_shadows_an_installed_deepspeed(tmp_path):
    fake = tmp_path / "pkgs"
    fake.mkdir()
    (fake / "deepspeed").mkdir()
    (fake / "deepspeed" / "__init__.py").write_text("REAL = True\n__version__ = '0.14.0'\n")
    _fake_deepspeed(fake)
    proc = _run("""
        import importlib.metadata, sys
        import deepspeed
        assert deepspeed.REAL  # the installed one, imported before registering
        import lightspeed
        lightspeed.register_as_deepspeed(override=True)
        import deepspeed
        assert not hasattr(deepspeed, "REAL") and deepspeed.__version__ == "0.19.8"
        assert importlib.metadata.version("deepspeed") == "0.19.8"
        print("OK")
    """, extra_path=str(fake))
    assert proc.stdout.strip() == "OK"
    assert "shadows it" in proc.stderr


@pytest.mark.no_real_deepspeed
def test_unregister_restores_the_import_system():
    from lightspeed.compat import is_registered, register_as_deepspeed, unregister_as_deepspeed

    before = list(sys.meta_path)
    register_as_deepspeed()
    try:
        assert is_registered()
        import deepspeed  # noqa: F401

        assert "deepspeed" in sys.modules
    finally:
        unregister_as_deepspeed()
    assert sys.meta_path == before
    assert "deepspeed" not in sys.modules
    assert importlib.util.find_spec("deepspeed") is None
    assert not is_registered()


def test_subpackages_are_attributes_of_a_plain_import():
    proc = _run("""
        import lightspeed
        assert callable(lightspeed.zero.Init) and callable(lightspeed.zero.GatheredParameters)
        assert callable(lightspeed.comm.get_rank)
        print("OK")
    """)
    assert proc.stdout.strip() == "OK"


@pytest.mark.no_real_deepspeed
@pytest.mark.parametrize("as_module", [False, True])
def test_as_deepspeed_entry_point_runs_the_script_registered(tmp_path, as_module):
    (tmp_path / "train_ds.py").write_text(textwrap.dedent("""
        import sys
        import deepspeed
        print("ARGS", sys.argv[1:], __name__, deepspeed.__version__, sys.path[0] == %r)
    """ % str(tmp_path)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    target = ["-m", "train_ds"] if as_module else [str(tmp_path / "train_ds.py")]
    proc = subprocess.run([sys.executable, "-m", "lightspeed.as_deepspeed", *target, "--x", "1"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ARGS ['--x', '1'] __main__ 0.19.8 True" in proc.stdout


def test_as_deepspeed_entry_point_errors_are_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "lightspeed.as_deepspeed", str(tmp_path / "missing.py")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"lightspeed.as_deepspeed: error: script not found: {tmp_path / 'missing.py'}"


@pytest.mark.no_real_deepspeed
def test_top_level_imports_of_deepspeed_examples_resolve():
    """The imports DeepSpeed-Chat and DeepSpeedExamples make at top level, by DeepSpeed's names."""
    proc = _run("""
        import lightspeed
        lightspeed.register_as_deepspeed()
        import deepspeed
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
        from deepspeed.compression.helper import recursive_getattr, recursive_setattr
        from deepspeed.compression.compress import init_compression, redundancy_clean
        from deepspeed.runtime.utils import set_random_seed
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
        from deepspeed.accelerator import get_accelerator
        assert deepspeed.moe.layer.MoE is MoE and deepspeed.compression.init_compression is init_compression
        import torch
        layer = MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2)
        out, l_aux, counts = layer(torch.randn(8, 4))
        print("MoE:", tuple(out.shape), int(counts.sum()))
        print("OK")
    """)
    out = proc.stdout.strip().splitlines()
    assert out[-1] == "OK" and "MoE: (8, 4) 8" in out
