"""Units: the modules whose subtrees are ZeRO-3's units of communication (FSDP2-style).

Owns: the rule that picks the unit modules and the assignment of every module (and so every
parameter) to one unit. Must not: shard, gather or hook anything (the strategy and the coordinator do).

Note (the unit rule): the unit modules are
    1. the root;
    2. every child of an `nn.ModuleList`, `nn.Sequential` or `nn.ModuleDict` whose subtree holds
       parameters, at any depth (a model's transformer blocks; nested lists give nested units),
       except inside a leaf module (3); likewise every child of a module whose class sets
       `holds_layers = True` (its children are its layers, called one after another: a
       `PipelineModule`, whose layers are registered under their indices directly on it);
    3. leaf modules (DeepSpeed's "z3 leaf modules", gathered whole) that contain a unit of rule 2 or
       are one: the leaf is a unit in their place and nothing inside it is a unit. Leaves are
       - the modules named by `zero_optimization.leaf_module` (`classes`: class name, simple or
         `module.Qualified`; `names`: name in `named_modules()`; `name_suffixes`), except a ModuleList
         or ModuleDict (never called, so hooks on it would never run), and
       - with `stage3_module_granularity_threshold` > 0, DeepSpeed's rule: a module's granularity is
         the parameter count of its subtree over (1 + the torch leaf modules with parameters in it);
         searched from the root down, a module (not a container, not a torch leaf, at most 1e9
         parameters) with granularity <= the threshold is a leaf and is not searched further, so a
         parent that qualifies absorbs its children.
    A leaf inside a unit's region that contains no unit changes nothing (the unit already gathers it
    whole): leaves only ever coarsen, as the threshold does in DeepSpeed, where the default unit is
    every parameter-owning module.
    - modules marked from code with `set_z3_leaf_modules(model, classes)` (DeepSpeed's function,
         which accelerate calls for MoE blocks), `set_z3_leaf_modules_by_name` or
         `set_z3_leaf_modules_by_suffix`; the marks are kept in a weak set here, not on the modules.
Every module belongs to its nearest unit ancestor (itself, if a unit), and a unit's *region* is the
modules that belong to it. A unit's parameter groups are the parameters first registered in its
region (one group per `requires_grad` value); a parameter registered in several places (tied)
belongs to the unit of its first registration in `named_modules()` order, and every other unit
registering it gathers that group too. Hooks run on unit modules only: a module inside a unit runs
with the unit's parameters already gathered, so calling such a module directly (outside its unit's
forward) needs `GatheredParameters`, as with FSDP2. The rule uses no model-specific class names.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch

from lightspeed.zero.stage3.init import owned_params

CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
MAX_LEAF_NUMEL = 1_000_000_000  # DeepSpeed's Z3_MAX_LEAF_SIZE: larger modules never become leaves by threshold


def is_container(m: torch.nn.Module) -> bool:
    """True for a module whose children are units by rule 2 of the Note."""
    return isinstance(m, CONTAINERS) or getattr(type(m), "holds_layers", False) is True


@dataclass(frozen=True)
class LeafRule:
    """Which modules are units with no unit inside (DeepSpeed's leaf modules)."""

    granularity_threshold: int = 0
    classes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()

    def named(self, module: torch.nn.Module, name: str) -> bool:
        cls = type(module)
        return ((cls.__name__ in self.classes or f"{cls.__module__}.{cls.__qualname__}" in self.classes)
                or (bool(name) and (name in self.names or any(name.endswith(s) for s in self.name_suffixes))))


@dataclass
class Unit:
    """One unit: its module, its name, and the `owned_params` entries of its region (in
    `named_modules()` order): `(index, module name, module, [(full name, param)])`."""

    name: str
    module: torch.nn.Module
    members: list = field(default_factory=list)
    region: list[torch.nn.Module] = field(default_factory=list)  # every module that belongs to it

    def owned(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [item for _, _, _, own in self.members for item in own]


_MARKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # leaves set from code


def _matching(model: torch.nn.Module, leaf_module_classes) -> list[torch.nn.Module]:
    wanted = list(leaf_module_classes)
    if not wanted or not all(isinstance(c, (type, str)) for c in wanted):
        raise ValueError("set_z3_leaf_modules: leaf_module_classes must be a non-empty list of module classes "
                         f"or class names (got {leaf_module_classes!r})")

    def match(m: torch.nn.Module) -> bool:
        cls = type(m)
        return any(isinstance(m, c) if isinstance(c, type) else c in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
                   for c in wanted)

    found: list[torch.nn.Module] = []
    model.apply(lambda m: found.append(m) if match(m) else None)  # DeepSpeed's order: children first
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    """DeepSpeed's `deepspeed.utils.set_z3_leaf_modules`: the modules of `model` that are instances of
    (or whose class is named by) `leaf_module_classes` become ZeRO-3 leaf modules (gathered whole, see
    this module's Note); call it before `initialize()`. Returns the modules marked."""
    found = _matching(model, leaf_module_classes)
    if not found and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules: no module of {leaf_module_classes!r} in the model")
    for m in found:
        _MARKED.add(m)
    return found


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    """Undo `set_z3_leaf_modules` for those classes; returns the modules unmarked."""
    found = _matching(model, leaf_module_classes)
    if not found and raise_if_not_found:
        raise ValueError(f"unset_z3_leaf_modules: no module of {leaf_module_classes!r} in the model")
    for m in found:
        _MARKED.discard(m)
    return found


def _mark(modules: list[torch.nn.Module], flag: bool) -> None:
    for m in modules:
        if flag:
            _MARKED.add(m)
        else:
            _MARKED.discard(m)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names, flag: bool = True,
                                raise_if_not_found: bool = True):
    """DeepSpeed's `deepspeed.utils.set_z3_leaf_modules_by_name`: mark (`flag` True) or unmark the modules
    named in `model.named_modules()`. Returns (the modules found, the names that matched none); with
    `raise_if_not_found`, a name that matches no module raises ValueError."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {missing} in the model")
    _mark(found, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True):
    """DeepSpeed's `deepspeed.utils.set_z3_leaf_modules_by_suffix`: mark (`flag` True) or unmark every
    module whose name in `model.named_modules()` ends with one of the suffixes. Returns (the modules
    found, each once, the suffixes that matched none); with `raise_if_not_found`, such a suffix raises
    ValueError."""
    named = list(model.named_modules())
    found: list[torch.nn.Module] = []
    missing = []
    for suffix in module_name_suffixes:
        matches = [m for name, m in named if name.endswith(suffix)]
        if not matches:
            missing.append(suffix)
        found.extend(m for m in matches if not any(m is f for f in found))
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_suffix: no module name ends with {missing} in the model")
    _mark(found, flag)
    return found, missing


def mark_named_leaves(root: torch.nn.Module, rule: LeafRule) -> None:
    """Mark the modules `zero_optimization.leaf_module` names as `set_z3_leaf_modules` marks them: DeepSpeed
    flags them when its engine is built, so `z3_leaf_module` then reports them."""
    _mark([m for name, m in root.named_modules() if rule.named(m, name)], True)


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when the module `model` (DeepSpeed's parameter name) was marked a leaf by `set_z3_leaf_modules`."""
    return model in _MARKED


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` marked by `set_z3_leaf_modules`."""
    return [m for m in model.modules() if m in _MARKED]


def _has_params(m: torch.nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _granularities(root: torch.nn.Module) -> dict[int, int]:
    """DeepSpeed's `_get_granularity_recursively`: id(module) -> granularity (sys.maxsize: never a leaf)."""
    out: dict[int, int] = {}

    def visit(m: torch.nn.Module) -> tuple[int, int]:
        if next(m.parameters(), None) is None:
            out[id(m)] = sys.maxsize
            return 0, 0
        numel = sum(p.numel() for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            out[id(m)] = sys.maxsize
            return 1, numel
        layers = 0
        for c in children:
            cl, cn = visit(c)
            layers, numel = layers + cl, numel + cn
        if is_container(m):
            out[id(m)] = sys.maxsize
            return layers, numel
        layers += 1
        out[id(m)] = numel // layers if numel <= MAX_LEAF_NUMEL else sys.maxsize
        return layers, numel

    visit(root)
    return out


def choose_units(root: torch.nn.Module, rule: LeafRule = LeafRule()) -> list[Unit]:
    """The units of `root` by the rule of this module's Note, root first, then in `named_modules()`
    order; units whose region owns no parameter are kept (their modules may use tied ones)."""
    gran = _granularities(root) if rule.granularity_threshold > 0 else {}

    def is_leaf(m: torch.nn.Module, name: str) -> bool:
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            return False  # no forward of their own: their hooks would never run
        return (rule.named(m, name) or m in _MARKED
                or gran.get(id(m), sys.maxsize) <= rule.granularity_threshold)

    unit_ids: set[int] = {id(root)}
    seen: set[int] = {id(root)}

    def visit(m: torch.nn.Module, prefix: str) -> None:
        for cname, child in m.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            name = prefix + cname
            if not _has_params(child):
                continue
            if is_leaf(child, name):
                if is_container(m) or any(is_container(d) and any(map(_has_params, d.children()))
                                          for d in child.modules()):
                    unit_ids.add(id(child))  # itself a unit by rule 2, or in place of those inside it
                continue
            if is_container(m):
                unit_ids.add(id(child))
            visit(child, name + ".")

    if not is_leaf(root, ""):
        visit(root, "")

    # every module -> its nearest unit ancestor (named_modules order is a pre-order walk)
    units: dict[int, Unit] = {}
    unit_of: dict[int, Unit] = {}

    def assign(m: torch.nn.Module, name: str, current: Unit | None) -> None:
        if id(m) in unit_of:
            return
        if id(m) in unit_ids:
            current = units.setdefault(id(m), Unit(name or "<root>", m))
        unit_of[id(m)] = current
        current.region.append(m)
        for cname, child in m.named_children():
            assign(child, f"{name}.{cname}" if name else cname, current)

    assign(root, "", None)
    for entry in owned_params(root):
        unit_of[id(entry[2])].members.append(entry)
    return list(units.values())


def compile_regions(root: torch.nn.Module, unit_modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules to torch.compile in place at stage 3 (Note: compiled regions): the largest subtrees
    with no unit module below their top and with parameters, in `named_modules()` order.

    Note (compiled regions): a compiled module's own hooks run outside its graph (torch.compile skips
    `nn.Module._call_impl` and starts tracing at `forward`), but the hooks of modules called inside
    that forward are traced into it, and the coordinator's (gathers, collectives, Python state) would
    break the graph; a break inside the root's loop over its blocks cannot be resumed, so dynamo
    would skip the root's whole frame. So each innermost unit (a transformer block) is one region,
    and when the root is the only unit that holds units, the root is a region too, listed first:
    `Stage3Strategy.after_compile` makes each unit a single opaque op of the root's graph (opaque.py),
    so embeddings, final norm, head and loss compile with the root. Otherwise (units nested below the
    root) a unit that holds units keeps its own forward eager while each of its parameter-holding
    children without units inside is a region of its own. FSDP2 users compile per block for the same
    reason."""
    unit_ids = {id(m) for m in unit_modules}
    below: dict[int, bool] = {}

    def holds_unit_below(m: torch.nn.Module) -> bool:
        if id(m) not in below:
            below[id(m)] = any(id(c) in unit_ids or holds_unit_below(c) for c in m.children())
        return below[id(m)]

    others = [m for m in unit_modules if m is not root]
    if id(root) in unit_ids and others and not any(holds_unit_below(m) for m in others):
        return [root, *others]  # the root compiled around its units, each an opaque op of its graph

    out: list[torch.nn.Module] = []
    seen: set[int] = set()

    def visit(m: torch.nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        callable_module = not isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
        if callable_module and not holds_unit_below(m):
            if _has_params(m):
                out.append(m)
            return
        for child in m.children():
            visit(child)

    visit(root)
    return out
