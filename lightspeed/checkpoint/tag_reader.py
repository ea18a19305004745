"""Reading the files of one saved tag, each verified against the checksum manifest of the rank that
wrote it; and verifying every file of a tag (the file half of `lightspeed checkpoint verify`; the
checks of the tag's contents that a load applies are universal.check_tag's).

Owns which manifest vouches for a file and what a missing or inconsistent manifest or file means. It
must not know which files a particular checkpoint layout has (engine_checkpoint does) nor change
anything on disk.

Rules: a tag has `checksums_rank<R>.json` for every writer rank R < `num_ranks` (rank 0's manifest says
`num_ranks`) and no other; every manifest names the tag and agrees with rank 0's on `num_ranks` and on
the id of the save that wrote it. A file a manifest
lists must exist and match it. Every tag this reader opens is lightspeed's (DeepSpeed's are read by
deepspeed_format.py), and lightspeed has written manifests since it wrote checkpoints, so a tag
without one is refused naming the missing manifest; inside `integrity.verification(False)` (a caller's
`verify=False`, the command line's `--no-verify`) nothing is checked, manifests are not even read, and a
warning says what is read is unverified.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.checkpoint.atomic import safe_torch_load
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import (
    UNVERIFIED_HINT, Manifest, manifest_name, manifest_rank, read_manifest, verification, verification_enabled,
    verify_file,
)  # fmt: skip

__all__ = ["TagReader", "verify_tag", "warn_unverified"]

logger = get_logger(__name__)


def warn_unverified(path: str | os.PathLike) -> None:
    warn_once(f"{path}: checkpoint verification is disabled (verify=False / --no-verify): its files are read "
              "without checking them, and whatever is loaded or written from them is unverified", logger)


class TagReader:
    """The files of the tag directory `path` (whose tag is `tag`), read through their manifests (unless
    verification was disabled when the reader was made)."""

    def __init__(self, path: str | os.PathLike, tag: str):
        self.path = Path(path)
        self.tag = tag
        self._manifests: dict[int, Manifest | None] = {}
        self._verified: set[tuple[str, int]] = set()
        self.has_checksums = verification_enabled()
        self.num_ranks: int | None = None
        names = os.listdir(self.path)
        if not self.has_checksums:
            warn_unverified(self.path)
            return
        ranks = sorted(r for r in map(manifest_rank, names) if r is not None)
        if 0 not in ranks:
            raise CheckpointError(f"{self.path / manifest_name(0)}: checksum manifest missing, so the tag's files "
                                  f"cannot be verified; {UNVERIFIED_HINT}")
        self.num_ranks = self.manifest(0).num_ranks
        beyond = [r for r in ranks if r >= self.num_ranks]
        if beyond:
            raise CheckpointError(f"{self.path / manifest_name(beyond[0])}: a manifest of rank {beyond[0]}, but rank "
                                  f"0's says {self.num_ranks} rank(s) wrote the tag (a forged rank count, or a file "
                                  "from another checkpoint)")

    def manifest(self, rank: int) -> Manifest | None:
        """Rank `rank`'s manifest; None when verification is off or the tag had fewer writer ranks."""
        if not self.has_checksums:
            return None
        if rank not in self._manifests:
            if self.num_ranks is not None and rank >= self.num_ranks:
                self._manifests[rank] = None
            else:
                path = self.path / manifest_name(rank)
                if not path.exists():
                    raise CheckpointError(f"{path}: checksum manifest missing (the tag was written by "
                                          f"{self.num_ranks if self.num_ranks is not None else 'several'} ranks)")
                manifest = read_manifest(path, tag=self.tag, rank=rank)
                if self.num_ranks is not None and manifest.num_ranks != self.num_ranks:
                    raise CheckpointError(f"{path}: says {manifest.num_ranks} ranks wrote the tag, rank 0's manifest "
                                          f"says {self.num_ranks} (a forged rank count, or a file from another "
                                          "checkpoint)")
                first = self._manifests.get(0)
                if first is not None and manifest.save_id != first.save_id:
                    raise CheckpointError(f"{path}: written by another save than rank 0's manifest (their save ids "
                                          "differ: a rank's files copied from another checkpoint of this tag?)")
                self._manifests[rank] = manifest
        return self._manifests[rank]

    def lists(self, name: str, writer_rank: int) -> bool:
        """Whether the tag has file `name` from `writer_rank` (by its manifest; unverified, by whether
        the file exists)."""
        if not self.has_checksums:
            return (self.path / name).is_file()
        manifest = self.manifest(writer_rank)
        return manifest is not None and name in manifest.files

    def verify(self, name: str, writer_rank: int) -> None:
        """Check file `name` that `writer_rank` wrote against that rank's manifest (once per reader)."""
        if not self.has_checksums or (name, writer_rank) in self._verified:
            return
        path = self.path / name
        manifest = self.manifest(writer_rank)
        if manifest is None or name not in manifest.files:
            raise CheckpointError(f"{path}: not listed in the checksum manifest of rank {writer_rank}")
        try:
            verify_file(path, manifest.files[name])
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"{path}: its checksum manifest entry is malformed ({err})") from None
        self._verified.add((name, writer_rank))

    def load(self, name: str, writer_rank: int, **torch_load_kwargs: Any) -> Any:
        """Verify, then load (weights_only) the file `name` that `writer_rank` wrote."""
        self.verify(name, writer_rank)
        return safe_torch_load(self.path / name, **torch_load_kwargs)

    def verify_all(self) -> tuple[list[str], list[str]]:
        """Check every manifest and every file they list. Returns `(problems, notes)`: one line per problem
        (none: every file is intact) and lines worth knowing that are not errors."""
        problems: list[str] = []
        listed: set[str] = set()
        for rank in range(self.num_ranks or 0):
            try:
                manifest = self.manifest(rank)
            except CheckpointError as err:
                problems.append(str(err))
                continue
            for name in sorted(manifest.files):
                listed.add(name)
                try:
                    self.verify(name, rank)
                except CheckpointError as err:
                    problems.append(str(err))
        extra = [n for n in sorted(os.listdir(self.path)) if n not in listed and manifest_rank(n) is None]
        return problems, [f"{self.path / n}: not covered by any checksum manifest" for n in extra]


def verify_tag(path: str | os.PathLike, tag: str) -> tuple[list[str], list[str]]:
    """Check every file of a tag directory against the manifests (always: the caller asked to verify).
    Returns `(problems, notes)` as `TagReader.verify_all`."""
    try:
        with verification(True):
            reader = TagReader(path, tag)
    except CheckpointError as err:
        return [str(err)], []
    except OSError as err:
        return [f"{path}: cannot be listed ({err.strerror or err})"], []
    return reader.verify_all()
