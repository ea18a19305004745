"""Helpers for the launcher tests: run the `lightspeed` command in a clean environment, in process or
as a subprocess of this checkout (not whatever `lightspeed` an editable install points at)."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES", "ELASTIC_RUN_ID", "DS_ENV_FILE", "LIGHTSPEED_ENV_FILE")
_LAUNCH_PREFIXES = ("OMPI_", "SLURM_", "PMI_", "TORCHELASTIC_", "PDSH_")


def clean_env(home: Path, **extra: str) -> dict:
    """This environment without launcher variables, importing this checkout, HOME at `home`."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env.update(PYTHONPATH=str(REPO), HOME=str(home), **extra)
    return env


def run_cli(args, cwd: Path, home: Path, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightspeed.launcher.cli", *map(str, args)], cwd=cwd,
                          env=clean_env(home, **extra), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def cli(tmp_path, home, monkeypatch):
    """Run `lightspeed ...` in this process, in `tmp_path` with a clean environment; returns
    (exit status, stdout, stderr). For commands that start no process (dry runs, errors, config)."""
    for key in list(os.environ):
        if key in _LAUNCH_VARS or key.startswith(_LAUNCH_PREFIXES) or key.startswith(("NCCL", "PYTHON", "MLFLOW",
                                                                                       "MV2", "UCX", "LIGHTSPEED")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)

    def run(*args):
        from lightspeed.launcher.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:
                code = e.code
        return code, out.getvalue(), err.getvalue()

    return run
