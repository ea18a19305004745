"""Reading the files of one saved tag, each verified against the checksum manifest of the rank that
wrote it; and verifying a whole tag (the `lightspeed checkpoint verify` command).

Owns which manifest vouches for a file and what a missing manifest or file means. It must not know
which files a particular checkpoint layout has (engine_checkpoint does) nor change anything on disk.

Rules: a tag written with checksums has `checksums_rank<R>.json` for every writer rank R <
`num_ranks`. A file a manifest lists must exist and match it; a manifest that rank 0's says should
exist must exist. A tag with no manifest at all (written before checksums existed, or by DeepSpeed)
is read unverified, with a warning; one with some manifests but not all is an error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.checkpoint.atomic import safe_torch_load
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import Manifest, manifest_name, manifest_rank, read_manifest, verify_file

__all__ = ["TagReader", "verify_tag"]

logger = get_logger(__name__)


class TagReader:
    """The files of the tag directory `path` (whose tag is `tag`), read through their manifests."""

    def __init__(self, path: str | os.PathLike, tag: str):
        self.path = Path(path)
        self.tag = tag
        self._manifests: dict[int, Manifest | None] = {}
        names = os.listdir(self.path)
        self.has_checksums = any(manifest_rank(n) is not None for n in names)
        self.num_ranks: int | None = None
        if self.has_checksums:
            self.num_ranks = self.manifest(0).num_ranks
        else:
            warn_once(f"{self.path}: the checkpoint has no checksum manifests (written before lightspeed recorded "
                      "them, or by another program); its files are loaded without verification", logger)

    def manifest(self, rank: int) -> Manifest | None:
        """Rank `rank`'s manifest; None when the tag has no checksums or had fewer writer ranks."""
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
                self._manifests[rank] = read_manifest(path, tag=self.tag, rank=rank)
        return self._manifests[rank]

    def lists(self, name: str, writer_rank: int) -> bool:
        """Whether the tag has file `name` from `writer_rank` (by its manifest; without checksums, by
        whether the file exists)."""
        if not self.has_checksums:
            return (self.path / name).is_file()
        manifest = self.manifest(writer_rank)
        return manifest is not None and name in manifest.files

    def load(self, name: str, writer_rank: int, **torch_load_kwargs: Any) -> Any:
        """Verify, then load (weights_only) the file `name` that `writer_rank` wrote."""
        path = self.path / name
        if self.has_checksums:
            manifest = self.manifest(writer_rank)
            if manifest is None or name not in manifest.files:
                raise CheckpointError(f"{path}: not listed in the checksum manifest of rank {writer_rank}")
            verify_file(path, manifest.files[name])
        return safe_torch_load(path, **torch_load_kwargs)


def verify_tag(path: str | os.PathLike, tag: str) -> tuple[list[str], list[str]]:
    """Check every file of a tag directory against the manifests. Returns `(problems, notes)`: one
    line per problem found (empty: the tag is intact) and lines worth knowing that are not errors."""
    path = Path(path)
    problems: list[str] = []
    notes: list[str] = []
    try:
        names = sorted(os.listdir(path))
    except OSError as err:
        return [f"{path}: cannot be listed ({err.strerror or err})"], notes
    ranks = sorted(r for r in (manifest_rank(n) for n in names) if r is not None)
    if not ranks:
        return [f"{path}: no checksum manifests (checksums_rank<R>.json): nothing to verify against"], notes
    listed: set[str] = set()
    try:
        num_ranks = read_manifest(path / manifest_name(0), tag=tag, rank=0).num_ranks
    except CheckpointError as err:
        problems.append(str(err))
        num_ranks = max(ranks) + 1
    for rank in range(num_ranks):
        try:
            manifest = read_manifest(path / manifest_name(rank), tag=tag, rank=rank)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        if manifest.num_ranks != num_ranks:
            problems.append(f"{manifest.path}: says {manifest.num_ranks} ranks wrote the tag, rank 0's says {num_ranks}")
        for name, entry in sorted(manifest.files.items()):
            listed.add(name)
            try:
                verify_file(path / name, entry)
            except CheckpointError as err:
                problems.append(str(err))
            except (KeyError, TypeError) as err:
                problems.append(f"{path / name}: its checksum manifest entry is malformed ({err})")
    extra = [n for n in names if n not in listed and manifest_rank(n) is None]
    extra_manifests = [r for r in ranks if r >= num_ranks]
    notes.extend(f"{path / n}: not covered by any checksum manifest" for n in extra)
    notes.extend(f"{path / manifest_name(r)}: a manifest for rank {r}, beyond the {num_ranks} writer ranks"
                 for r in extra_manifests)
    return problems, notes
