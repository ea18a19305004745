"""Turns a config source (dict, path, or JSON text) into a plain dict, as DeepSpeed does: hjson, so
comments and trailing commas are accepted, and duplicate keys are an error. Parse errors name
``file:line:column``. Must not interpret any key.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from pathlib import Path
from typing import Any

import hjson

from lightspeed.config.errors import ConfigError

STRING_SOURCE = "<string>"
BASE64_SOURCE = "<base64>"
DICT_SOURCE = "<dict>"


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _duplicate_line(text: str, key: str) -> str:
    """':line' of the second occurrence of `key` when the key occurs exactly twice in the text (the
    parser does not report positions for this error, so anything else would be a guess)."""
    pattern = re.compile(r'(?:"' + re.escape(key) + r'"|(?<![\w"])' + re.escape(key) + r")\s*:")
    hits = [m.start() for m in pattern.finditer(text)]
    if len(hits) != 2:
        return ""
    return f":{text.count(chr(10), 0, hits[1]) + 1}"


def parse_text(text: str, name: str) -> dict:
    """Parse JSON/HJSON `text`; `name` (a file path or ``<string>``) prefixes error locations."""
    try:
        data = hjson.loads(text, object_pairs_hook=_object_without_duplicates)
    except _DuplicateKey as dup:
        raise ConfigError(
            f"{name}{_duplicate_line(text, dup.key)}: duplicate key {json.dumps(dup.key)} "
            f"(a key may appear once per object)"
        ) from None
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"{name}:{err.lineno}:{err.colno}: not valid JSON/HJSON: {err.msg}") from None
    except (ValueError, RecursionError) as err:  # pragma: no cover - hjson reports most as HjsonDecodeError
        raise ConfigError(f"{name}: not valid JSON/HJSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: the config must be a JSON object (got {type(data).__name__})")
    return data


def _base64_text(source: str) -> str | None:
    """The JSON object text `source` encodes in URL-safe base64, else None."""
    try:
        text = base64.urlsafe_b64decode(source.strip()).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    return text if text.lstrip().startswith("{") else None


def read_source(source: Any) -> tuple[dict, str]:
    """The parsed config and a name for where it came from (a path, ``<string>``, ``<base64>`` (a
    string that is no file but URL-safe base64 of the JSON, as DeepSpeed accepts) or ``<dict>``)."""
    if isinstance(source, dict):
        return source, DICT_SOURCE
    if isinstance(source, str) and source.lstrip().startswith("{"):
        return parse_text(source, STRING_SOURCE), STRING_SOURCE
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            decoded = _base64_text(source) if isinstance(source, str) else None
            if decoded is not None:  # DeepSpeed's third form: the JSON text, URL-safe base64 encoded
                return parse_text(decoded, BASE64_SOURCE), BASE64_SOURCE
            raise ConfigError(f"{path}: config file not found")
        try:
            text = path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the config file ({err})") from None
        return parse_text(text, str(path)), str(path)
    raise ConfigError(
        f"config: must be a dict, a path to a JSON/HJSON file or a JSON string (got {type(source).__name__})"
    )
