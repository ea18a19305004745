"""Reading DeepSpeed's pickled checkpoint files without DeepSpeed and without running their code.

Owns the restricted load of one DeepSpeed file: torch's weights-only unpickler, with every global under
the ``deepspeed.`` namespace that the file names (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``,
...) bound to an inert stand-in class of ours, and the translation of those stand-ins to plain data
afterwards. Must not: know the checkpoint layout (deepspeed_format.py does), import deepspeed, or let any
other global through (those are refused by the weights-only unpickler, and the refusal is a one-line
``CheckpointError`` naming the file).

Note: [why stand-ins are safe]
    The weights-only unpickler calls only what it is allowed to: its own allowlist (tensors, containers,
    dtypes) and the user's safe globals. Our stand-ins are the only additions; building or "calling" one
    stores the arguments and state it is given and does nothing else, whatever name the file gives it. A
    file that names ``os.system`` or ``builtins.eval`` is still refused. DeepSpeed's objects become plain
    data: an enum member its value, a dataclass or an object the dict of its fields (with the key
    ``"__class__"`` holding DeepSpeed's class path).
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections import OrderedDict
from typing import Any

import torch

from lightspeed.checkpoint.atomic import safe_torch_load
from lightspeed.checkpoint.errors import CheckpointError

__all__ = ["load_deepspeed_file", "CLASS_KEY"]

CLASS_KEY = "__class__"
_NAMESPACE = "deepspeed."


class _StandIn:
    """Stands in for one pickled DeepSpeed class; records what the pickle hands it, runs nothing."""

    ds_class = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_StandIn":
        obj = object.__new__(cls)
        obj.__dict__["_ls_args"] = args
        obj.__dict__["_ls_state"] = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_ls_state"] = state


def _stand_in_for(path: str) -> type:
    return type(path.rsplit(".", 1)[-1], (_StandIn,), {"ds_class": path, "__module__": __name__})


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, _StandIn):
        args, state = obj._ls_args, obj._ls_state
        if state is None and len(args) == 1 and not isinstance(args[0], (dict, list, tuple)):
            return _to_plain(args[0])  # an enum member (reduced as Class(value)): its value
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) state
        plain: dict[str, Any] = {CLASS_KEY: obj.ds_class}
        if isinstance(state, dict):
            plain.update({k: _to_plain(v) for k, v in state.items()})
        elif state is not None:
            plain["state"] = _to_plain(state)
        if args:
            plain["args"] = [_to_plain(a) for a in args]
        return plain
    if isinstance(obj, torch.nn.Parameter):
        return obj.detach()
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, _to_plain(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_plain(v) for v in obj)
    return obj


def _globals_named(path: str) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint file not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    except (RuntimeError, ValueError, EOFError, KeyError, IndexError, zipfile.BadZipFile,
            pickle.UnpicklingError) as err:
        text = str(err).strip().splitlines()
        raise CheckpointError(f"{path}: is truncated or corrupt ({type(err).__name__}: "
                              f"{text[0][:160] if text else ''})") from None


def load_deepspeed_file(path: str | os.PathLike, mmap: bool = True) -> Any:
    """The object in one of DeepSpeed's ``.pt`` files, as plain data: dicts, lists, numbers, strings and
    CPU tensors (memory-mapped when `mmap`, so only what is read is paged in). Raises ``CheckpointError``
    (one line, naming the file) for a missing, truncated or corrupt file, or one whose pickle needs a
    global outside DeepSpeed's namespace and torch's weights-only allowlist."""
    shown = os.fspath(path)
    names = _globals_named(shown)
    foreign = [name for name in names if not name.startswith(_NAMESPACE)]
    if foreign:
        raise CheckpointError(f"{shown}: refused to load: its pickle needs {', '.join(foreign[:3])}, which is "
                              "neither a tensor, plain data nor a DeepSpeed class")
    stand_ins = [(_stand_in_for(name), name) for name in names if name.startswith(_NAMESPACE)]
    with torch.serialization.safe_globals(stand_ins):
        obj = safe_torch_load(shown, map_location="cpu", mmap=mmap)
    return _to_plain(obj)
