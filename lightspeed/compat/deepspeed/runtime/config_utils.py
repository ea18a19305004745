"""`deepspeed.runtime.config_utils`: DeepSpeed's base for config models (`DeepSpeedConfigModel`) and the
small helpers beside it, for code that defines its own config sections the way DeepSpeed's are defined.

lightspeed's own sections derive from `lightspeed.config.base.Section`; this module is for user code
written against DeepSpeed's base and must not be used by lightspeed's config package.

Note: [deprecated fields] A field declared `Field(..., json_schema_extra={"deprecated": True, "new_param":
"name", "new_param_fn": fn, "set_new_param": True, "deprecated_msg": "..."})`, when given, logs a
warning and (with `new_param` and `set_new_param`, the default) moves `fn(value)` into the field
`new_param` names (a dotted path reaches into a nested model), deleting the old one. Giving both the
deprecated field and its replacement is an AssertionError, as in DeepSpeed.

Note: ["auto"] As DeepSpeed's, the base drops every "auto" value before validation (the field keeps its
default) unless `strict=True`: Hugging Face fills "auto" in later, and a section built before that
must still validate.
"""

from __future__ import annotations

import collections.abc
import json
from functools import reduce

import torch
from pydantic import BaseModel, ConfigDict, field_serializer

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)


class DeepSpeedConfigModel(BaseModel):
    """DeepSpeed's config-model base: unknown keys forbidden, assignments validated, enum values stored,
    fields settable by name or alias, deprecated fields moved to their replacement (Note: [deprecated
    fields]), "auto" values dropped unless `strict` (Note: ["auto"])."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data):
        if not strict:
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto") or k == "replace_method"}
        super().__init__(**data)
        self._deprecated_fields_check()

    def _deprecated_fields_check(self) -> None:
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False) and name in self.model_fields_set:
                self._move_deprecated(name, extra)

    def _move_deprecated(self, name: str, extra: dict) -> None:
        new_field = extra.get("new_param", "")
        message = extra.get("deprecated_msg", "")
        logger.warning(f"Config parameter {name} is deprecated" + (f" use {new_field} instead" if new_field else "")
                       + (f". {message}" if message else ""))
        if not new_field or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, name))
        delattr(self, name)
        *path, leaf = new_field.split(".")
        owner = reduce(getattr, path, self)
        assert leaf not in owner.model_fields_set, \
            f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new_field}' together"
        setattr(owner, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def serialize_torch_dtype(dtype: torch.dtype) -> str:  # noqa: N805 (DeepSpeed's signature)
        return str(dtype)


def get_config_default(config, field_name: str):
    """The default of `field_name` in the model (class or instance) `config`; AssertionError when it has
    no such field or the field is required."""
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    assert field_name in fields, f"'{field_name}' is not a field in {config}"
    assert not fields[field_name].is_required(), f"'{field_name}' is a required field and does not have a default value"
    return fields[field_name].get_default()


class pp_int(int):  # noqa: N801 (DeepSpeed's name)
    """An int printed with thousands separators (or a custom string), for generated documentation."""

    def __new__(cls, val, custom_print_str=None):
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{self.real:,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """`json.dumps(..., cls=ScientificNotationEncoder)`: numbers above 1e3 in scientific notation, the
    rest as the standard encoder writes them (booleans lowercase)."""

    def iterencode(self, o, _one_shot=False, level=0):
        indent = self.indent if self.indent is not None else 4
        inner, outer = " " * (level + 1) * indent, " " * level * indent
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, collections.abc.Mapping):
            items = [f'\n{inner}"{k}": {self.iterencode(v, level=level + 1)}' for k, v in o.items()]
            return "{" + ", ".join(items) + f"\n{outer}" + "}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            return f"[{', '.join(self.iterencode(v, level=level + 1) for v in o)}]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """An object whose repr is its attributes as indented JSON."""

    def repr(self) -> dict:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(param_dict: dict, param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs):
    """`json.load(..., object_pairs_hook=...)`: a dict, ValueError naming the keys given twice."""
    d = dict(ordered_pairs)
    if len(d) != len(ordered_pairs):
        counter = collections.Counter(k for k, _ in ordered_pairs)
        raise ValueError(f"Duplicate keys in DeepSpeed config: {[k for k, n in counter.items() if n > 1]}")
    return d


__all__ = ["DeepSpeedConfigModel", "DeepSpeedConfigObject", "ScientificNotationEncoder", "dict_raise_error_on_duplicate_keys",
           "get_config_default", "get_dict_param", "get_list_param", "get_scalar_param", "pp_int"]
