"""Every checkpoint read is verified: DeepSpeed's files (no manifest by design) against the CRC-32s torch
stored in them, a lightspeed tag against its manifests, which must be there; `verify=False` /
`--no-verify` reads unchecked, with a warning; `convert to-fp32` takes a tag directory."""

from __future__ import annotations

import os
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from lightspeed.checkpoint.convert import open_checkpoint
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.from_weights import write_checkpoint_from_weights
from lightspeed.checkpoint.integrity import tensors_in_record, verify_zip
from lightspeed.checkpoint.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main as zero_to_fp32_main,
)
from lightspeed.launcher.cli import main as cli_main
from lightspeed.testing.deepspeed_layout import write_zero_checkpoint

SHAPES = OrderedDict(w=torch.Size([6, 4]), b=torch.Size([6]))


def _record_range(path: Path, tensor: str) -> tuple[str, int, int]:
    """The record holding the tensor whose name contains `tensor`, and where its data lies."""
    raw = path.read_bytes()
    for info in zipfile.ZipFile(path).infolist():
        if "/data/" in info.filename and info.file_size and any(
                tensor in n for n in tensors_in_record(path, info.filename)):
            name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            return info.filename, start, start + info.file_size
    raise AssertionError(f"{path} has no tensor named like {tensor}")


def _flip_in_tensor(path: Path, tensor: str) -> tuple[str, list[str]]:
    """Flip one bit inside the record of a tensor named like `tensor`; returns the record and the tensors
    stored in it."""
    record, start, end = _record_range(path, tensor)
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return record, tensors_in_record(path, record)


def _one_line(err, *parts) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    for part in parts:
        assert str(part) in text, text
    return text


# ----------------------------------------------------------------------- DeepSpeed's files: zip CRCs


@pytest.mark.parametrize("name,tensor", [("zero_pp_rank_1_mp_rank_00_optim_states.pt", "fp32_flat_groups"),
                                         ("zero_pp_rank_0_mp_rank_00_model_states.pt", "frozen_param_fragments")])
def test_a_flipped_byte_in_a_deepspeed_file_is_refused(tmp_path, name, tensor, ls_caplog):
    masters = {n: torch.randn(s) for n, s in SHAPES.items()}
    tag_dir = Path(write_zero_checkpoint(str(tmp_path / "ds"), stage=3, world_size=2, shapes=SHAPES, masters=masters,
                                         frozen={"f": torch.randn(5)}))
    want = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
    path = tag_dir / name
    record, tensors = _flip_in_tensor(path, tensor)
    with pytest.raises(CheckpointError) as err:  # before: the flipped value was loaded, and written out
        convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ds"), tmp_path / "out")
    _one_line(err, path, f"record {record.split('/', 1)[1]}", "fails the CRC-32 stored in the file")
    assert tensors and repr(tensors[0]) in str(err.value)
    assert not (tmp_path / "out" / "pytorch_model.bin").exists()
    assert cli_main(["convert", "to-fp32", str(tmp_path / "ds"), str(tmp_path / "out")]) == 2
    # told not to verify: it converts, says so, and the damage is in the output
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"), verify=False)
    assert "unverified" in ls_caplog.text
    assert any(not torch.equal(got[k], want[k]) for k in want)
    assert cli_main(["convert", "to-fp32", str(tmp_path / "ds"), str(tmp_path / "out"), "--no-verify"]) == 0


def test_intact_deepspeed_files_verify_and_files_without_crcs_are_read_with_a_warning(tmp_path, ls_caplog):
    write_zero_checkpoint(str(tmp_path / "ds"), stage=2, world_size=2, shapes=SHAPES)
    for path in (tmp_path / "ds" / "global_step1").iterdir():
        assert verify_zip(path) is True
    legacy = tmp_path / "legacy.pt"
    torch.save({"x": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    assert verify_zip(legacy) is False  # no CRCs to check: the caller warns
    set_crc = getattr(torch.serialization, "set_crc32_options", None)
    if set_crc is not None:
        set_crc(False)
        try:
            torch.save({"x": torch.ones(3)}, tmp_path / "nocrc.pt")
        finally:
            set_crc(True)
        assert verify_zip(tmp_path / "nocrc.pt") is False
    truncated = tmp_path / "cut.pt"
    torch.save({"x": torch.ones(3)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:-30])
    with pytest.raises(CheckpointError, match="cut.pt: is truncated or corrupt"):
        verify_zip(truncated)


def test_a_stage3_checkpoint_missing_a_rank_model_file_is_refused(tmp_path):
    """The last rank's model file gone leaves no gap in the numbering; its frozen parameter's parts would
    be stitched from torch.empty memory."""
    write_zero_checkpoint(str(tmp_path / "ds"), stage=3, world_size=2, shapes=SHAPES, frozen={"f": torch.randn(5)})
    gone = tmp_path / "ds" / "global_step1" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    gone.unlink()
    with pytest.raises(CheckpointError) as err:
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
    _one_line(err, gone, "missing")


# ------------------------------------------------------------------- lightspeed tags: manifests


def _lightspeed_tag(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    weights = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    write_checkpoint_from_weights(weights, tmp_path / "ls", tag="t")
    return tmp_path / "ls", weights


def test_a_lightspeed_tag_without_its_manifest_is_refused_unless_unverified(tmp_path, ls_caplog):
    save_dir, weights = _lightspeed_tag(tmp_path)
    manifest = save_dir / "t" / "checksums_rank0.json"
    manifest.unlink()
    _flip_in_tensor(save_dir / "t" / "model_states.pt", "module.w")  # what nothing would catch once the manifest is gone
    for call in (lambda: open_checkpoint(save_dir),
                 lambda: convert_zero_checkpoint_to_fp32_state_dict(save_dir, tmp_path / "o"),
                 lambda: get_fp32_state_dict_from_zero_checkpoint(save_dir / "t"),
                 lambda: load_state_dict_from_zero_checkpoint(torch.nn.Linear(3, 4), save_dir)):
        with pytest.raises(CheckpointError) as err:
            call()
        _one_line(err, manifest, "checksum manifest missing", "verify=False")
    assert cli_main(["convert", "to-fp32", str(save_dir), str(tmp_path / "o")]) == 2
    assert cli_main(["checkpoint", "verify", str(save_dir)]) == 1
    with pytest.raises(SystemExit):
        zero_to_fp32_main([str(save_dir), str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
    # explicitly unverified: read, with a warning that says so
    got = get_fp32_state_dict_from_zero_checkpoint(save_dir, verify=False)
    assert set(got) == set(weights) and "unverified" in ls_caplog.text
    assert cli_main(["convert", "to-fp32", str(save_dir / "t"), str(tmp_path / "o"), "--no-verify"]) == 0
    assert zero_to_fp32_main([str(save_dir), str(tmp_path / "o2"), "--no_verify"]) == 0


def test_convert_to_fp32_takes_a_tag_directory_or_its_save_directory(tmp_path, capsys):
    save_dir, weights = _lightspeed_tag(tmp_path)
    for i, where in enumerate((save_dir / "t", save_dir)):
        out = tmp_path / f"out{i}"
        assert cli_main(["convert", "to-fp32", str(where), str(out)]) == 0, capsys.readouterr().err
        got = torch.load(out / "pytorch_model.bin", weights_only=True)
        assert set(got) == set(weights) and all(torch.equal(got[k], v) for k, v in weights.items())
    os.rename(save_dir / "latest", save_dir / "latest.off")  # a save dir without latest names no tag
    assert cli_main(["convert", "to-fp32", str(save_dir), str(tmp_path / "out2")]) == 2
    assert "no checkpoint to read" in capsys.readouterr().err
    assert cli_main(["convert", "to-fp32", str(save_dir), str(tmp_path / "out2"), "--tag", "t"]) == 0


def test_checkpoint_verify_checks_a_deepspeed_tag(tmp_path, capsys):
    write_zero_checkpoint(str(tmp_path / "ds"), stage=3, world_size=2, shapes=SHAPES, frozen={"f": torch.randn(5)})
    tag_dir = tmp_path / "ds" / "global_step1"
    assert cli_main(["checkpoint", "verify", str(tmp_path / "ds")]) == 0
    assert cli_main(["checkpoint", "verify", str(tag_dir)]) == 0
    assert "OK" in capsys.readouterr().out
    record, _ = _flip_in_tensor(tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt", "fp32_flat_groups")
    assert cli_main(["checkpoint", "verify", str(tmp_path / "ds")]) == 1
    out = capsys.readouterr().out
    assert f"record {record.split('/', 1)[1]}" in out and "FAILED" in out
    (tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (tag_dir / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    assert cli_main(["checkpoint", "verify", str(tag_dir)]) == 1
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing" in capsys.readouterr().out
