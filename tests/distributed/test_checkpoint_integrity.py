"""Checkpoint checksums: every kind of damage to every kind of file of a 2-rank checkpoint (ZeRO 0 and
2) is refused with one line naming the file (and the tensor); nothing damaged ever loads silently;
a tag that is not complete and consistent (manifests gone, a rank count forged, an optimizer-state
entry dropped, a rank's files from another save) is refused, and `lightspeed checkpoint verify` says
FAILED exactly where a load refuses."""

from __future__ import annotations

import json
import random
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import lightspeed
from lightspeed.checkpoint import engine_checkpoint
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import read_manifest, tensors_in_record, verification, write_manifest
from lightspeed.checkpoint.universal import open_source
from lightspeed.launcher.cli import main as cli_main
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

WORLD = 2
CONFIG = {"train_batch_size": 4, "steps_per_print": 1000,
          "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
# (tag, file, rank whose load reads it)
FILES = [("z0", "model_states.pt", 0), ("z0", "optim_states.pt", 1), ("z0", "rng_rank0.pt", 0),
         ("z0", "rng_rank1.pt", 1), ("z2", "model_states.pt", 1), ("z2", "optim_states_rank0.pt", 0),
         ("z2", "optim_states_rank1.pt", 1), ("z2", "rng_rank1.pt", 1)]
IDS = [f"{t}-{f}" for t, f, _ in FILES]


def _save_worker(save_dir: str):
    import numpy as np
    import torch.distributed as dist

    # the rng files hold Python's and numpy's states: seeded, so the files (and where the seeded flips
    # below land in them) are the same bytes in every run
    random.seed(20 + dist.get_rank())
    np.random.seed(20 + dist.get_rank())
    for stage in (0, 2):
        torch.manual_seed(10 + dist.get_rank())
        engine, *_ = lightspeed.initialize(model=TinyMLP(), config=dict(CONFIG, zero_optimization={"stage": stage}))
        x, y = regression_data(8)
        for s in range(2):
            xb, yb = x[s * 4 + dist.get_rank() * 2:][:2], y[s * 4 + dist.get_rank() * 2:][:2]
            engine.backward(engine(xb, yb))
            engine.step()
        engine.save_checkpoint(save_dir, tag=f"z{stage}", client_state={"note": "hi"})
    # another save of tag z2, one step on: its rank files are what a mix-up would copy in
    engine.backward(engine(xb, yb))
    engine.step()
    engine.save_checkpoint(f"{save_dir}/other", tag="z2")
    # load_checkpoint of a tag whose manifests are gone: refused naming one, loaded with verify=False
    bare = f"{save_dir}/bare"
    engine.save_checkpoint(bare, tag="b")
    dist.barrier()
    if dist.get_rank() == 0:
        for manifest in Path(bare, "b").glob("checksums_rank*.json"):
            manifest.unlink()
    dist.barrier()
    try:
        engine.load_checkpoint(bare, "b")
        refused = None
    except CheckpointError as err:
        refused = str(err)
    path, _ = engine.load_checkpoint(bare, "b", verify=False)
    return {"refused": refused, "unverified_load": str(path)}


@pytest.fixture(scope="module")
def saved_world(tmp_path_factory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("saved")
    results = run_world(_save_worker, WORLD, str(root))
    return root, results


@pytest.fixture(scope="module")
def saved(saved_world) -> Path:
    return saved_world[0]


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the saved checkpoints, free to damage."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    return copy


def load(root: Path, tag: str, rank: int):
    return engine_checkpoint.load(root, tag, dp_rank=rank)


def record_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """{record name: (start, end)} of each zip record's data bytes."""
    raw = path.read_bytes()
    out = {}
    for info in zipfile.ZipFile(path).infolist():
        name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
        out[info.filename] = (start, start + info.file_size)
    return out


def flip(path: Path, at: int, nbytes: int, rng: random.Random) -> None:
    raw = bytearray(path.read_bytes())
    if nbytes == 1:
        raw[at] ^= 1 << rng.randrange(8)
    else:
        for i in range(at, min(at + nbytes, len(raw))):
            raw[i] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(raw))


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def one_line(err, *parts):
    message = str(err.value)
    assert "\n" not in message, message
    for part in parts:
        assert str(part) in message, message
    return message


def test_intact_checkpoint_loads_and_verifies(saved, capsys):
    for tag in ("z0", "z2"):
        for rank in range(WORLD):
            loaded = load(saved, tag, rank)
            assert loaded.shared["client_state"] == {"note": "hi"} and loaded.rng_state is not None
    assert cli_main(["checkpoint", "verify", str(saved), "--all"]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 2 and "problem" not in out


@pytest.mark.parametrize("tag,name,rank", FILES, ids=IDS)
@pytest.mark.parametrize("nbytes", [1, 16])
def test_damage_inside_every_tensor_is_named(ckpt, tag, name, rank, nbytes):
    path = ckpt / tag / name
    original = path.read_bytes()
    rng = random.Random(f"{tag}{name}{nbytes}")
    named = set()
    for record, (start, end) in record_ranges(path).items():
        if "/data/" not in record or end - start == 0:
            continue
        expected = tensors_in_record(path, record)
        assert expected, record
        flip(path, rng.randrange(start, end), nbytes, rng)
        with pytest.raises(CheckpointError) as err:
            load(ckpt, tag, rank)
        message = one_line(err, path, f"tensor {expected[0]!r}", "fails its checksum")
        named.update(expected)
        assert "record data/" in message
        path.write_bytes(original)
    load(ckpt, tag, rank)  # restored: loads again
    if name == "model_states.pt":
        module = load(ckpt, tag, rank).shared["module"]
        assert {f"module.{k}" for k in module} <= named  # every parameter can be named


@pytest.mark.parametrize("tag,name,rank", FILES, ids=IDS)
def test_random_damage_never_loads_silently(ckpt, tag, name, rank):
    """Flips anywhere in the file (data, pickle, zip headers, index): either a CheckpointError, or
    (damage in bytes no reader uses, such as alignment padding) exactly the original content."""
    path = ckpt / tag / name
    original_bytes = path.read_bytes()
    original = load(ckpt, tag, rank)
    rng = random.Random(f"random-{tag}{name}")
    refused = 0
    for trial in range(24):
        flip(path, rng.randrange(len(original_bytes)), 1 if trial % 2 else 16, rng)
        try:
            loaded = load(ckpt, tag, rank)
        except CheckpointError as err:
            assert "\n" not in str(err) and str(path) in str(err) or "checksums" in str(err)
            refused += 1
        else:
            assert same(loaded.shared, original.shared) and same(loaded.strategy_state, original.strategy_state)
            assert same(loaded.rng_state, original.rng_state)
        path.write_bytes(original_bytes)
    assert refused >= 12


@pytest.mark.parametrize("tag,name,rank", FILES, ids=IDS)
def test_truncated_file(ckpt, tag, name, rank):
    path = ckpt / tag / name
    raw = path.read_bytes()
    for keep in (len(raw) - 1, len(raw) // 2, 0):
        path.write_bytes(raw[:keep])
        with pytest.raises(CheckpointError) as err:
            load(ckpt, tag, rank)
        one_line(err, path, "truncated")


@pytest.mark.parametrize("tag,name,rank", FILES + [("z2", "checksums_rank1.json", 1), ("z2", "checksums_rank0.json", 0)],
                         ids=IDS + ["z2-manifest1", "z2-manifest0"])
def test_missing_file(ckpt, tag, name, rank):
    (ckpt / tag / name).unlink()
    with pytest.raises(CheckpointError) as err:
        load(ckpt, tag, rank)
    one_line(err, ckpt / tag / name, "missing")


def test_missing_rng_file_is_an_error_even_when_only_the_rng_would_be_read(ckpt):
    (ckpt / "z2" / "rng_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match="rng_rank0.pt: missing"):
        engine_checkpoint.load(ckpt, "z2", dp_rank=0, load_strategy=False)


def test_wrong_manifest(ckpt, capsys):
    manifest = ckpt / "z2" / "checksums_rank1.json"
    body = json.loads(manifest.read_text())
    # 1. edited by hand (a CRC changed): the manifest's own checksum no longer matches
    entry = body["files"]["rng_rank1.pt"]["records"]
    record = next(iter(entry))
    entry[record] = "00000000" if entry[record] != "00000000" else "00000001"
    manifest.write_text(json.dumps(body))
    with pytest.raises(CheckpointError) as err:
        load(ckpt, "z2", 1)
    one_line(err, manifest, "its own checksum")
    # 2. the manifest of another tag copied in
    shutil.copy(ckpt / "z0" / "checksums_rank1.json", manifest)
    with pytest.raises(CheckpointError) as err:
        load(ckpt, "z2", 1)
    one_line(err, manifest, "is for tag 'z0', not 'z2'")
    # 3. a manifest for the wrong rank
    shutil.copy(ckpt / "z2" / "checksums_rank0.json", manifest)
    with pytest.raises(CheckpointError) as err:
        load(ckpt, "z2", 1)
    one_line(err, manifest, "for rank 0, not 1")
    # 4. not JSON at all
    manifest.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError) as err:
        load(ckpt, "z2", 1)
    one_line(err, manifest, "corrupt")
    assert cli_main(["checkpoint", "verify", str(ckpt), "--tag", "z2"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and str(manifest) in out


def test_a_file_from_another_checkpoint_is_refused(ckpt):
    shutil.copy(ckpt / "z0" / "model_states.pt", ckpt / "z2" / "model_states.pt")
    with pytest.raises(CheckpointError) as err:
        load(ckpt, "z2", 1)
    one_line(err, ckpt / "z2" / "model_states.pt")


def test_verify_command_names_file_and_tensor(ckpt, capsys):
    path = ckpt / "z2" / "optim_states_rank1.pt"
    record, (start, end) = next((r, se) for r, se in record_ranges(path).items() if "/data/" in r)
    flip(path, start, 1, random.Random(0))
    (ckpt / "z2" / "rng_rank0.pt").unlink()
    assert cli_main(["checkpoint", "verify", str(ckpt), "--tag", "z2"]) == 1
    out = capsys.readouterr().out
    assert f"{path}: tensor {tensors_in_record(path, record)[0]!r}" in out
    assert "rng_rank0.pt: missing" in out and "FAILED" in out
    assert cli_main(["checkpoint", "verify", str(ckpt / "z0")]) == 0  # a tag directory directly
    assert cli_main(["checkpoint", "verify", str(ckpt), "--tag", "nope"]) == 1
    assert "checkpoint directory not found" in capsys.readouterr().out
    assert cli_main(["checkpoint", "verify", str(ckpt), "--tag", "z2", "--all"]) == 2
    assert cli_main(["checkpoint", "verify", str(ckpt / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_load_checkpoint_refuses_a_tag_without_manifests_unless_told_not_to_verify(saved_world):
    root, results = saved_world
    for result in results:  # every rank: the engine's load agrees the refusal
        assert result["refused"] is not None and "\n" not in result["refused"]
        assert f"{root / 'bare' / 'b' / 'checksums_rank0.json'}: checksum manifest missing" in result["refused"]
        assert "verify=False" in result["refused"]
        assert result["unverified_load"] == str(root / "bare" / "b")


def test_checkpoint_without_manifests_is_refused_unless_unverified(ckpt, ls_caplog):
    path = ckpt / "z2" / "optim_states_rank1.pt"
    record, (start, _) = next((r, se) for r, se in record_ranges(path).items() if "/data/" in r)
    flip(path, start, 1, random.Random(1))  # the damage a manifest would catch
    for manifest in (ckpt / "z2").glob("checksums_rank*.json"):
        manifest.unlink()
    for rank in range(WORLD):
        with pytest.raises(CheckpointError) as err:
            load(ckpt, "z2", rank)
        one_line(err, ckpt / "z2" / "checksums_rank0.json", "checksum manifest missing", "verify=False")
    with verification(False):
        loaded = load(ckpt, "z2", 1)
    assert loaded.rng_state is not None and "unverified" in ls_caplog.text


# -------------------------------------------------------------------- a tag complete and consistent


def rewrite_manifest(path: Path, **changes) -> None:
    """Rewrite a manifest with `changes` (its own checksum made to match: a forgery, not damage)."""
    m = read_manifest(path)
    fields = {"tag": m.tag, "rank": m.rank, "num_ranks": m.num_ranks, "files": m.files, "save_id": m.save_id}
    fields.update(changes)
    path.unlink()
    write_manifest(path.parent, **fields)


def _copied_from_another_save(tag_dir: Path) -> None:
    for name in ("optim_states_rank1.pt", "rng_rank1.pt", "checksums_rank1.json"):
        shutil.copy(tag_dir.parent / "other" / "z2" / name, tag_dir / name)


def _num_ranks_forged(tag_dir: Path) -> None:
    rewrite_manifest(tag_dir / "checksums_rank0.json", num_ranks=1)


def _one_rank_tag_forged(tag_dir: Path) -> None:  # consistent manifests, but rank 1's part is gone
    rewrite_manifest(tag_dir / "checksums_rank0.json", num_ranks=1)
    (tag_dir / "checksums_rank1.json").unlink()
    (tag_dir / "optim_states_rank1.pt").unlink()
    (tag_dir / "rng_rank1.pt").unlink()


def _optimizer_entry_dropped(tag_dir: Path) -> None:
    files = dict(read_manifest(tag_dir / "checksums_rank1.json").files)
    del files["optim_states_rank1.pt"]
    rewrite_manifest(tag_dir / "checksums_rank1.json", files=files)


def _optimizer_file_and_entry_dropped(tag_dir: Path) -> None:
    _optimizer_entry_dropped(tag_dir)
    (tag_dir / "optim_states_rank1.pt").unlink()


FAULTS = {"copied_from_another_save": (_copied_from_another_save, "another save"),
          "num_ranks_forged": (_num_ranks_forged, "checksums_rank1.json: a manifest of rank 1"),
          "one_rank_tag_forged": (_one_rank_tag_forged, "optim_states_rank0.pt: holds the part of rank 0 of 2"),
          "optimizer_entry_dropped": (_optimizer_entry_dropped, "optim_states_rank1.pt: optimizer-state file"),
          "optimizer_file_and_entry_dropped": (_optimizer_file_and_entry_dropped, "optim_states_rank1.pt: optimizer-state file")}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_verify_fails_exactly_where_load_refuses(ckpt, fault, capsys):
    inject, expected = FAULTS[fault]
    inject(ckpt / "z2")
    messages = set()
    for rank in range(WORLD):  # what each rank's load_checkpoint reads (universal.open_source)
        with pytest.raises(CheckpointError) as err:
            open_source(ckpt, "z2", dp_rank=rank)
        messages.add(one_line(err, expected))
    assert cli_main(["checkpoint", "verify", str(ckpt), "--tag", "z2"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and any(m in out for m in messages), out
    # the intact tag and the other save verify
    assert cli_main(["checkpoint", "verify", str(ckpt), "--tag", "z0"]) == 0
    assert cli_main(["checkpoint", "verify", str(ckpt / "other")]) == 0
