"""`lightspeed checkpoint verify DIR [--tag T | --all]`: check a saved engine checkpoint against its
checksum manifests without loading it into a model.

DIR is a save directory (holding `latest` and tag directories) or a tag directory itself. Without
`--tag` the tag `latest` names is checked; `--all` checks every tag directory in DIR. Prints one line
per problem (the file, and the tensor where the damage is in tensor data) and a summary per tag;
exit status 0 when everything verified, 1 when anything did not, 2 for bad arguments.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _error(msg: str) -> int:
    print(f"lightspeed: error: {msg}", file=sys.stderr)
    return 2


def _is_tag_dir(path: Path) -> bool:
    from lightspeed.checkpoint.integrity import manifest_rank

    return path.is_dir() and any(manifest_rank(n) is not None for n in os.listdir(path))


def _tags(root: Path, tag: str | None, every: bool) -> list[tuple[Path, str]]:
    """(directory, tag) pairs to verify; raises CheckpointError for a tag that cannot be found."""
    from lightspeed.checkpoint.atomic import read_latest
    from lightspeed.checkpoint.errors import CheckpointError
    from lightspeed.checkpoint.tag_dir import resolve

    if every:
        found = sorted((p, p.name) for p in root.iterdir() if not p.name.startswith(".") and _is_tag_dir(p))
        # a tag whose overwrite was killed between its renames lives on as `.<tag>.old` (tag_dir's Note)
        found += sorted((p, p.name[1:-4]) for p in root.iterdir() if p.name.startswith(".") and p.name.endswith(".old")
                        and not (root / p.name[1:-4]).exists() and _is_tag_dir(p))
        if not found:
            raise CheckpointError(f"{root}: no tag directories with checksum manifests")
        return found
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            if _is_tag_dir(root):  # DIR is a tag directory itself
                return [(root, root.name)]
            raise CheckpointError(f"{root}: no 'latest' file; pass --tag or --all")
    return [(resolve(root, tag), tag)]


def checkpoint_verify(directory: str, tag: str | None = None, every: bool = False) -> int:
    from lightspeed.checkpoint.errors import CheckpointError
    from lightspeed.checkpoint.tag_reader import verify_tag

    root = Path(directory)
    if not root.is_dir():
        return _error(f"{directory}: not a directory")
    if tag is not None and every:
        return _error("--tag and --all exclude each other")
    try:
        targets = _tags(root, tag, every)
    except CheckpointError as err:
        print(f"FAILED {err}")
        return 1
    status = 0
    for path, name in targets:
        problems, notes = verify_tag(path, name)
        for line in problems:
            print(f"  problem: {line}")
        for line in notes:
            print(f"  note: {line}")
        if problems:
            status = 1
            print(f"FAILED {path}: {len(problems)} problem(s)")
        else:
            print(f"OK {path}: every file matches its checksums")
    return status
