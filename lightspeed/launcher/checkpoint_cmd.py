"""`lightspeed checkpoint verify DIR [--tag T | --all]`: check a saved engine checkpoint against its
checksum manifests, and that it is complete and consistent as a load checks it, without loading it
into a model (universal.check_tag). A DeepSpeed tag, which has no manifests, is checked against the
CRC-32s torch stored in each of its files, and for every rank's files.

DIR is a save directory (holding `latest` and tag directories) or a tag directory itself. Without
`--tag` the tag `latest` names is checked; `--all` checks every tag directory in DIR. Prints one line
per problem (the file, and the tensor where the damage is in tensor data) and a summary per tag;
exit status 0 when everything verified, 1 when anything did not, 2 for bad arguments.
"""

from __future__ import annotations

import sys
from pathlib import Path


def _error(msg: str) -> int:
    print(f"lightspeed: error: {msg}", file=sys.stderr)
    return 2


def _is_tag_dir(path: Path) -> bool:
    from lightspeed.checkpoint.deepspeed_format import is_deepspeed_tag_dir
    from lightspeed.checkpoint.engine_checkpoint import is_tag_dir

    return is_tag_dir(path) or is_deepspeed_tag_dir(path)


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
            raise CheckpointError(f"{root}: no checkpoint tag directories")
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
    from lightspeed.checkpoint.universal import check_tag

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
        problems, notes = check_tag(path, name)
        for line in problems:
            print(f"  problem: {line}")
        for line in notes:
            print(f"  note: {line}")
        if problems:
            status = 1
            print(f"FAILED {path}: {len(problems)} problem(s)")
        else:
            print(f"OK {path}: every file matches its checksums and the tag is complete")
    return status
