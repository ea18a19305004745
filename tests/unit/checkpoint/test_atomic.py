"""Atomic checkpoint writes survive crashes; loads are weights-only and fail with one clear line; the
`latest` tag file; RNG state round trip."""

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import pytest
import torch

from lightspeed.checkpoint import atomic
from lightspeed.checkpoint.atomic import (
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_via,
    read_latest,
    remove_stale_temps,
    safe_torch_load,
    validate_tag,
    write_latest,
)
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.rng import get_rng_state, set_rng_state

REPO_ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 60


def temps(directory):
    return [p for p in Path(directory).rglob("*") if p.is_file() and ".tmp." in p.name]


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


# ---------------------------------------------------------------------------------------------- writes


def test_atomic_write_bytes_and_overwrite(tmp_path):
    target = tmp_path / "blob.bin"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(str(target), b"two, longer")
    assert target.read_bytes() == b"two, longer"
    assert temps(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_torch_save_round_trip(tmp_path):
    obj = {"w": torch.randn(7, 3, dtype=torch.bfloat16), "step": 3, "names": ["a", "b"], "nested": {"x": 1.5}}
    atomic_torch_save(obj, tmp_path / "m.pt")
    back = safe_torch_load(tmp_path / "m.pt")
    assert torch.equal(back["w"], obj["w"]) and back["step"] == 3 and back["nested"] == {"x": 1.5}
    assert temps(tmp_path) == []


def test_failed_serialization_keeps_old_file(tmp_path):
    target = tmp_path / "m.pt"
    atomic_torch_save({"v": 1}, target)
    with pytest.raises(Exception):
        atomic_torch_save({"v": 2, "bad": lambda: None}, target)  # lambdas cannot be pickled
    assert safe_torch_load(target) == {"v": 1}
    assert temps(tmp_path) == []


def test_atomic_write_via_a_path_writer(tmp_path, monkeypatch):
    """A writer that needs a file name (safetensors' save_file) writes the temp file; a failing one
    leaves the old file and no temp; the fault points come in order."""
    target = tmp_path / "t.bin"
    seen = []
    monkeypatch.setattr(atomic, "_fault_hook", lambda point, path: seen.append(point))
    atomic_write_via(target, lambda tmp: Path(tmp).write_bytes(b"first"))
    assert target.read_bytes() == b"first" and seen == ["begin", "temp_written", "replaced"]

    def fails(tmp):
        Path(tmp).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_via(target, fails)
    assert target.read_bytes() == b"first" and temps(tmp_path) == []


# ------------------------------------------------------------------------------------- crash tests
# Each crash runs in a forked child (torch already imported, so it costs milliseconds) that really
# dies: os._exit at an injected fault point, or SIGKILL from the parent at a random moment.

needs_fork = pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGKILL"), reason="needs fork+SIGKILL")


def fork_child(body):
    """Run ``body()`` in a forked child; returns its pid. The child never returns into pytest."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            body()
        except BaseException:
            traceback.print_exc()
            code = 99
        finally:
            os._exit(code)
    return pid


def wait_child(pid, timeout=TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} did not finish in {timeout}s")


def save_new_checkpoint(save_dir, mode, point, target_name):
    def hook(where, path):
        if where == point and os.path.basename(path) == target_name:
            os._exit(17)  # die on the spot: no cleanup, no finally blocks

    atomic._fault_hook = hook  # only in the child: fork gave it its own copy of the module
    new = {"step": 2, "w": torch.full((4096,), 2.0)}
    if mode == "new_tag":
        (save_dir / "tag2").mkdir()
        atomic_torch_save(new, save_dir / "tag2" / "model.pt")
        write_latest(save_dir, "tag2")
    else:
        atomic_torch_save(new, save_dir / "tag1" / "model.pt")


# (mode, crash point, file it crashes on, tag `latest` must name afterwards, step found through `latest`)
CRASHES = [
    ("new_tag", "temp_written", "model.pt", "tag1", 1),  # after temp write, before replace
    ("new_tag", "replaced", "model.pt", "tag1", 1),  # model file in place, `latest` not yet touched
    ("new_tag", "begin", "latest", "tag1", 1),  # before `latest`
    ("new_tag", "temp_written", "latest", "tag1", 1),  # `latest` temp written, not yet renamed
    ("new_tag", "replaced", "latest", "tag2", 2),  # renamed: the new checkpoint is complete
    ("overwrite", "temp_written", "model.pt", "tag1", 1),  # overwrite in place, before replace
    ("overwrite", "replaced", "model.pt", "tag1", 2),  # overwrite in place, after replace
    ("new_tag", "never", "-", "tag2", 2),  # control: no crash
]


def write_old_checkpoint(save_dir):
    (save_dir / "tag1").mkdir(parents=True)
    atomic_torch_save({"step": 1, "w": torch.full((4096,), 1.0)}, save_dir / "tag1" / "model.pt")
    write_latest(save_dir, "tag1")


def every_final_file_loads(save_dir):
    for path in Path(save_dir).rglob("*"):
        if path.is_file() and ".tmp." not in path.name:
            if path.name == "latest":
                assert read_latest(save_dir) in ("tag1", "tag2")
            else:
                sd = safe_torch_load(path)
                assert torch.equal(sd["w"], torch.full((4096,), float(sd["step"])))


@needs_fork
@pytest.mark.parametrize("mode,point,target,latest,step", CRASHES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CRASHES])
def test_crash_mid_save_leaves_a_loadable_checkpoint(tmp_path, mode, point, target, latest, step):
    save_dir = tmp_path / "ckpt"
    write_old_checkpoint(save_dir)
    pid = fork_child(lambda: save_new_checkpoint(save_dir, mode, point, target))
    assert wait_child(pid) == (0 if point == "never" else 17)
    assert atomic._fault_hook is None
    assert read_latest(save_dir) == latest
    assert safe_torch_load(save_dir / latest / "model.pt")["step"] == step
    if (mode, point, target) == ("new_tag", "temp_written", "model.pt"):
        assert not (save_dir / "tag2" / "model.pt").exists()  # no partial target, only a stray temp
        assert len(temps(save_dir)) == 1
    every_final_file_loads(save_dir)
    for directory in [save_dir, *(d for d in save_dir.iterdir() if d.is_dir())]:
        remove_stale_temps(directory)
    assert temps(save_dir) == []


def save_forever(target, ready_fd):
    version = 0
    while True:
        version += 1
        atomic_torch_save({"v": version, "w": torch.full((1 << 20,), float(version))}, target)
        if version == 1:
            os.write(ready_fd, b"r")


@needs_fork
def test_sigkill_during_repeated_saves(tmp_path):
    rng = random.Random(1234)
    target = tmp_path / "model.pt"
    mid_write_kills = 0  # kills that left a temp file behind, i.e. landed inside a write
    for _ in range(30):
        if mid_write_kills >= 2:
            break
        read_fd, write_fd = os.pipe()
        pid = fork_child(lambda: save_forever(target, write_fd))
        os.close(write_fd)
        try:
            ready, _, _ = select.select([read_fd], [], [], TIMEOUT_S)
            assert ready and os.read(read_fd, 1) == b"r"
            time.sleep(rng.uniform(0.0, 0.1))  # a random moment inside the write loop
        finally:
            os.kill(pid, signal.SIGKILL)
            code = wait_child(pid)
            os.close(read_fd)
        assert code == -signal.SIGKILL
        sd = safe_torch_load(target)
        assert sd["v"] >= 1 and torch.equal(sd["w"], torch.full((1 << 20,), float(sd["v"])))
        mid_write_kills += len(remove_stale_temps(tmp_path))
        assert temps(tmp_path) == []
    assert mid_write_kills >= 1, "no kill landed inside a write; the test proved nothing"


@pytest.mark.slow
def test_fresh_interpreter_crash(tmp_path):
    """One crash in a brand-new interpreter too, so nothing inherited from the parent can help."""
    save_dir = tmp_path / "ckpt"
    write_old_checkpoint(save_dir)
    child = textwrap.dedent(
        """
        import os, sys, torch
        from lightspeed.checkpoint import atomic
        atomic._fault_hook = lambda where, path: os._exit(17) if where == "temp_written" else None
        atomic.atomic_torch_save({"step": 2, "w": torch.full((4096,), 2.0)}, sys.argv[1])
        """
    )
    target = save_dir / "tag1" / "model.pt"
    proc = subprocess.run([sys.executable, "-c", child, str(target)], env=child_env(), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 17, proc.stderr
    assert safe_torch_load(target)["step"] == 1
    assert len(temps(save_dir)) == 1


# --------------------------------------------------------------------------------------- safe loads


class Payload:
    def __init__(self):
        self.x = 1


def one_line_naming(err, path):
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


def test_corrupt_files_raise_checkpoint_error(tmp_path):
    good = tmp_path / "good.pt"
    atomic_torch_save({"w": torch.randn(10_000)}, good)
    data = good.read_bytes()
    cases = {
        "truncated.pt": data[: len(data) // 2],
        "tail_cut.pt": data[:-10],
        "garbage.pt": b"not a checkpoint at all" * 5,
        "empty.pt": b"",
    }
    for name, blob in cases.items():
        path = tmp_path / name
        path.write_bytes(blob)
        with pytest.raises(CheckpointError) as err:
            safe_torch_load(path)
        one_line_naming(err, path)
    with pytest.raises(CheckpointError, match="not found") as err:
        safe_torch_load(tmp_path / "missing.pt")
    one_line_naming(err, tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="directory"):
        safe_torch_load(tmp_path)
    assert isinstance(CheckpointError("x"), ValueError)


def test_pickle_needing_custom_class_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"payload": Payload()}, path)
    with pytest.raises(CheckpointError) as err:
        safe_torch_load(path)
    message = one_line_naming(err, path)
    assert "Payload" in message and "refused" in message


# ------------------------------------------------------------------------------------ tags, `latest`


def test_validate_tag():
    assert validate_tag("global_step10") == "global_step10"
    assert validate_tag(7) == "7"
    for bad in ["", ".", "..", "a/b", "a\\b", "x\n", " pad", "pad ", "nul\x00", None, 1.5, True]:
        with pytest.raises(CheckpointError):
            validate_tag(bad)


def test_latest_round_trip(tmp_path):
    assert read_latest(tmp_path) is None
    write_latest(tmp_path, "global_step5")
    assert (tmp_path / "latest").read_bytes() == b"global_step5"  # DeepSpeed writes the bare tag
    assert read_latest(tmp_path) == "global_step5"
    (tmp_path / "latest").write_text("global_step6\n")  # written by other tools, with a newline
    assert read_latest(tmp_path) == "global_step6"
    with pytest.raises(CheckpointError):
        write_latest(tmp_path, "../escape")
    for content in [b"", b"  \n", b"../x", b"\xff\xfe"]:
        (tmp_path / "latest").write_bytes(content)
        with pytest.raises(CheckpointError) as err:
            read_latest(tmp_path)
        one_line_naming(err, tmp_path / "latest")


def test_fault_hook_sees_every_point(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(atomic, "_fault_hook", lambda point, path: seen.append((point, os.path.basename(path))))
    write_latest(tmp_path, "t")
    assert seen == [("begin", "latest"), ("temp_written", "latest"), ("replaced", "latest")]


# ------------------------------------------------------------------------------------------------ rng


def draws():
    out = {"python": [random.random() for _ in range(3)] + [random.gauss(0, 1)], "torch": torch.rand(5)}
    try:
        import numpy as np
    except ImportError:
        return out
    out["numpy"] = np.random.rand(4).tolist() + [float(np.random.standard_normal())]
    return out


def test_rng_round_trip_reproduces_draws(tmp_path):
    random.seed(3)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leave a cached gauss value in the state
    state = get_rng_state()
    atomic_torch_save({"rng": state}, tmp_path / "rng.pt")
    first = draws()

    random.seed(99)
    torch.manual_seed(99)
    try:
        import numpy as np

        np.random.seed(99)
        assert "numpy" in state
    except ImportError:
        assert "numpy" not in state
    set_rng_state(safe_torch_load(tmp_path / "rng.pt")["rng"])  # weights_only=True load
    second = draws()
    assert first["python"] == second["python"]
    assert torch.equal(first["torch"], second["torch"])
    assert first.get("numpy") == second.get("numpy")


def test_rng_missing_parts_are_skipped():
    state = get_rng_state()
    set_rng_state({"torch": state["torch"]})
    set_rng_state({})
    if not torch.cuda.is_available():
        set_rng_state({"cuda": [torch.zeros(16, dtype=torch.uint8)]})  # warns, restores nothing
