"""integrity.py on its own: entries from torch's own CRCs (or ours when torch computes none), naming
the tensors of a record without unpickling anything, and the manifest's own checks."""

import os
import pickle
import zipfile
from collections import OrderedDict

import pytest
import torch

from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import (
    file_entry, manifest_name, read_manifest, tensors_in_record, verify_file, write_manifest,
)  # fmt: skip


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this runs a shell command
        return (os.system, (f"touch {self.marker}",))


def sample():
    flat = torch.arange(12.0)
    return {"module": OrderedDict(w=flat[:6].view(2, 3), b=flat[6:]),
            "param": torch.nn.Parameter(torch.ones(4)),
            "state": {0: {"exp_avg": torch.zeros(5), "step": 3}}, "names": ["a", ("b", torch.ones(1))]}


def test_names_of_every_record(tmp_path):
    path = tmp_path / "s.pt"
    torch.save(sample(), path)
    entry = file_entry(path)
    verify_file(path, entry)
    names = {r: tensors_in_record(path, r) for r in entry["records"] if "/data/" in r}
    found = sorted(n for ns in names.values() for n in ns)
    assert found == ["module.b", "module.w", "names.1.1", "param", "state.0.exp_avg"]
    assert any(sorted(ns) == ["module.b", "module.w"] for ns in names.values())  # one storage, two views


def test_entry_without_torch_crcs(tmp_path):
    getter = getattr(torch.serialization, "get_crc32_options", None)
    if getter is None:
        pytest.skip("this torch always computes CRCs")
    path = tmp_path / "s.pt"
    torch.save(sample(), path)
    with_torch = file_entry(path)
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(sample(), tmp_path / "n.pt")
        ours = file_entry(tmp_path / "n.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    strip = lambda e: {k.split("/", 1)[1]: v for k, v in e["records"].items() if "serialization_id" not in k}
    assert strip(ours) == strip(with_torch)  # same bytes, same CRC-32s, whoever computed them
    verify_file(tmp_path / "n.pt", ours)


def test_a_malicious_pickle_is_never_run_while_naming(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": Evil(marker)}, protocol=2))
        z.writestr("archive/data/0", b"\0" * 16)
    assert tensors_in_record(path, "archive/data/0") == []
    assert not marker.exists()


def test_non_zip_entry_and_manifest_checks(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"x" * 100)
    entry = file_entry(blob)
    assert set(entry) == {"bytes", "crc32"}
    verify_file(blob, entry)
    blob.write_bytes(b"y" * 100)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        verify_file(blob, entry)
    path = write_manifest(tmp_path, tag="t", rank=3, num_ranks=4, files={"blob.bin": entry})
    assert path.endswith(manifest_name(3))
    manifest = read_manifest(path, tag="t", rank=3)
    assert manifest.num_ranks == 4 and manifest.files == {"blob.bin": entry}
    with pytest.raises(CheckpointError, match="for tag 't', not 'u'"):
        read_manifest(path, tag="u")
    with pytest.raises(CheckpointError, match="not found"):
        read_manifest(tmp_path / manifest_name(0))
