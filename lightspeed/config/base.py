"""The strict base model every ds_config section derives from, the value types sections use, and
the translation of pydantic's errors into `ConfigError` lines.

Owns: what a well-typed value is (JSON booleans only, integers that may be written `2e8` but not
`2.5`, numbers that are not booleans), how a problem is worded (``path: expected (got value)``), and
the did-you-mean for unknown keys. Must not know any particular section.

Note: value types
    Each type is `Annotated[<python type>, BeforeValidator(check)]`, where `check` raises a
    `PydanticCustomError` of type ``ls_value`` whose message is the whole "what was expected" part
    (e.g. ``must be an integer >= 0``). Range limits live inside the check rather than in
    `Field(ge=...)` so a wrong type and a wrong range read the same way. Pydantic's lax coercions
    (``"5"`` -> 5, ``1`` -> True) never run: the check hands pydantic a value of the exact type.
"""

from __future__ import annotations

import difflib
import json
import math
from typing import Annotated, Any, Callable, Iterable, Optional, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

_ERROR_TYPE = "ls_value"


class Section(BaseModel):
    """A ds_config section: unknown keys are errors, defaults are DeepSpeed's, attributes are named
    exactly as the JSON keys."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), arbitrary_types_allowed=False)

    def non_default(self) -> dict[str, Any]:
        """The keys of this section whose value differs from the default, with their values."""
        out = {}
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            default = field.get_default(call_default_factory=True)
            if isinstance(value, BaseModel):
                value = value.model_dump()
            if isinstance(default, BaseModel):
                default = default.model_dump()
            if value != default:
                out[name] = value
        return out


def expectation(expected: str) -> PydanticCustomError:
    """The error a value check raises; `expected` reads like `must be an integer >= 0`."""
    return PydanticCustomError(_ERROR_TYPE, expected)


def _range_text(ge=None, gt=None, le=None) -> str:
    parts = []
    if gt is not None:
        parts.append(f"> {gt}")
    if ge is not None:
        parts.append(f">= {ge}")
    if le is not None:
        parts.append(f"<= {le}")
    return " and ".join(parts)


def _in_range(value, ge=None, gt=None, le=None) -> bool:
    return not ((ge is not None and value < ge) or (gt is not None and value <= gt) or (le is not None and value > le))


def as_int(value: Any) -> Optional[int]:
    """`value` as an int if it is one (an integral finite float such as 2e8 counts), else None.
    Booleans are not integers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def Int(ge: Optional[int] = None, gt: Optional[int] = None, le: Optional[int] = None, what: str = ""):
    """An integer field type; `what` overrides the expectation text."""
    rng = _range_text(ge, gt, le)
    expected = what or ("must be an integer" + (f" {rng}" if rng else ""))

    def check(value):
        as_integer = as_int(value)
        if as_integer is None or not _in_range(as_integer, ge, gt, le):
            raise expectation(expected)
        return as_integer

    return Annotated[int, BeforeValidator(check)]


def Float(ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
          numeric_strings: bool = False):
    """A finite number field type (ints accepted, booleans not; strings only with `numeric_strings`, for
    the keys DeepSpeed reads through `float(...)`, where "3" is 3.0)."""
    rng = _range_text(ge, gt, le)
    expected = "must be a number" + (f" {rng}" if rng else "")

    def check(value):
        if numeric_strings and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise expectation(expected) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise expectation(expected)
        if not _in_range(value, ge, gt, le):
            raise expectation(expected)
        return float(value)

    return Annotated[float, BeforeValidator(check)]


def _check_bool(value):
    if not isinstance(value, bool):
        raise expectation("must be true or false")
    return value


def _check_str(value):
    if not isinstance(value, str):
        raise expectation("must be a string")
    return value


def _check_str_list(value):
    if isinstance(value, str):  # DeepSpeed accepts one name for a list of names
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise expectation("must be a list of strings")
    return list(value)


def _check_dict(value):
    if not isinstance(value, dict):
        raise expectation("must be an object")
    return dict(value)


def _check_flag(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise expectation("must be true or false (or 1 or 0)")


Bool = Annotated[bool, BeforeValidator(_check_bool)]
# a switch DeepSpeed reads by truthiness, which configs write as 1 / 0 too
Flag = Annotated[bool, BeforeValidator(_check_flag)]
Str = Annotated[str, BeforeValidator(_check_str)]
StrList = Annotated[list, BeforeValidator(_check_str_list)]
FreeDict = Annotated[dict, BeforeValidator(_check_dict)]
PosInt = Int(ge=1, what="must be a positive integer")
NonNegInt = Int(ge=0)


def IntList(ge: Optional[int] = None):
    expected = "must be a list of integers" + (f" >= {ge}" if ge is not None else "")

    def check(value):
        if not isinstance(value, list):
            raise expectation(expected)
        out = [as_int(v) for v in value]
        if any(v is None or (ge is not None and v < ge) for v in out):
            raise expectation(expected)
        return out

    return Annotated[list, BeforeValidator(check)]


def _quote_all(values: Iterable[Any]) -> list[str]:
    return [json.dumps(v) for v in values]


def one_of_text(values: Iterable[Any]) -> str:
    quoted = _quote_all(values)
    if len(quoted) == 1:
        return quoted[0]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def Choice(*values: Any, normalize: Optional[Callable[[str], str]] = None, what: str = ""):
    """A field whose value must be one of `values`; strings are passed through `normalize` (e.g.
    `str.lower` for DeepSpeed's case-insensitive names) before the comparison."""
    allowed = list(values)
    expected = what or f"must be {one_of_text(allowed)}"

    def check(value):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise expectation(expected)
        if isinstance(value, str) and normalize is not None:
            value = normalize(value)
        if value not in allowed:
            raise expectation(expected)
        return value

    return Annotated[Any, BeforeValidator(check)]


# ----------------------------------------------------------------------------------------------
# Error wording


def show(value: Any) -> str:
    """A value as the user wrote it in JSON, shortened."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):  # pragma: no cover - only for values that never come from JSON
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def suggest(key: str, known: Iterable[str], cutoff: float = 0.6) -> str:
    """' (did you mean "x"?)' for the closest known key, or '' when none is close."""
    matches = difflib.get_close_matches(key, list(known), n=1, cutoff=cutoff)
    return f'; did you mean "{matches[0]}"?' if matches else ""


def _unwrap(annotation: Any) -> Any:
    """The model class inside Optional[...] / Annotated[...] / dict[str, ...] / list[...], if any."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _unwrap(get_args(annotation)[0])
    if origin is Union:
        for arg in get_args(annotation):
            found = _unwrap(arg)
            if found is not None:
                return found
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def section_at(root: type[BaseModel], loc: tuple) -> Optional[type[BaseModel]]:
    """The section class reached by following `loc` (field names) down from `root`."""
    current: Optional[type[BaseModel]] = root
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        current = _unwrap(current.model_fields[part].annotation)
    return current


def dotted(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


_PYDANTIC_WORDING = {
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "missing": "is required",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
}


def problems_from(error: ValidationError, root: type[BaseModel], prefix: tuple = ()) -> list[str]:
    """One line per pydantic error, in our wording: ``dotted.path: expected (got value)``."""
    lines = []
    for err in error.errors(include_url=False):
        loc = tuple(prefix) + tuple(err["loc"])
        path = dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent = section_at(root, tuple(err["loc"])[:-1])
            known = parent.model_fields.keys() if parent is not None else ()
            lines.append(f"{path}: unknown key{suggest(str(loc[-1]), known)}")
            continue
        if kind == _ERROR_TYPE:
            expected = err["msg"]
        elif kind in _PYDANTIC_WORDING:
            expected = _PYDANTIC_WORDING[kind]
        elif kind == "value_error":
            expected = err["msg"].removeprefix("Value error, ")
        else:
            expected = err["msg"][:1].lower() + err["msg"][1:]
        if kind == "missing":
            lines.append(f"{path}: {expected}")
        else:
            lines.append(f"{path}: {expected} (got {show(err['input'])})")
    return lines
