"""`register_as_deepspeed()`: make `import deepspeed` resolve to lightspeed's compatibility package.

Owns the two import-system hooks that do it, both on `sys.meta_path`:
  - `_ModuleAlias` maps `deepspeed` and `deepspeed.X.Y` to `lightspeed.compat.deepspeed` and
    `lightspeed.compat.deepspeed.X.Y`. The alias is the same module object (the loader returns the
    already imported compat module), so `deepspeed.comm is lightspeed.compat.deepspeed.comm`: one
    copy of every module, and state set through one name is seen through the other.
  - `_DistributionAlias` answers `importlib.metadata` for the distribution `deepspeed` with
    `DeepSpeedDistribution`, whose METADATA names the DeepSpeed release lightspeed presents
    (`DEEPSPEED_VERSION`). transformers and accelerate detect DeepSpeed by `find_spec("deepspeed")`
    plus that metadata, and gate features on its version.
Must not: import torch or any other part of lightspeed at import time (the launcher's per-rank entry
point registers before the user's script starts), or hold any logic of the compat modules.

Note: why an explicit opt-in, and why the refusal
    Registration changes what `import deepspeed` means for the whole process, so it is never done
    as a side effect of `import lightspeed`. When a real DeepSpeed distribution is installed, the
    two would disagree about the version and the modules (a half-aliased process), so registration
    refuses unless `override=True`, which puts lightspeed's hooks first and drops DeepSpeed modules
    already imported, so later imports see lightspeed's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import re
import sys

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)

# The DeepSpeed release whose public API lightspeed's compatibility package follows (the surface is
# audited against 0.19.8: tests/unit/compat/deepspeed_0_19_8_surface.json) and whose gradient
# reduction it keeps (zero/reduce.py's Note on sequence parallelism). accelerate's strictest gate
# (ALST / Ulysses sequence parallelism) is deepspeed>=0.18.2; transformers' sequence-parallel loss
# multiplies each rank's share by sp under ZeRO-3 below 0.20.2, which is right for this reduction.
DEEPSPEED_VERSION = "0.19.8"
ALIAS = "deepspeed"
TARGET = "lightspeed.compat.deepspeed"


class RegistrationError(RuntimeError):
    """`register_as_deepspeed()` cannot proceed (a real DeepSpeed is installed or imported)."""


def _target_name(fullname: str) -> str | None:
    if fullname == ALIAS:
        return TARGET
    if fullname.startswith(ALIAS + "."):
        return TARGET + fullname[len(ALIAS):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads `deepspeed.X` as the already imported (or now imported) `lightspeed.compat.deepspeed.X`."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        # The import system keeps the attributes a module already has (__name__, __path__, __file__),
        # so the alias is the compat module itself, under its own name...
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # ...except __spec__, which it always overwrites with the alias's: put the module's own back,
        # so relative imports and importlib see lightspeed's name. (Executed once, under that name.)
        module.__spec__ = self._own_spec


class _ModuleAlias(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        name = _target_name(fullname)
        if name is None:
            return None
        compat_spec = importlib.util.find_spec(name)
        if compat_spec is None:
            return None  # a DeepSpeed module lightspeed does not provide: ModuleNotFoundError as usual
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(name), origin=compat_spec.origin,
                                              is_package=compat_spec.submodule_search_locations is not None)
        if compat_spec.submodule_search_locations is not None:
            spec.submodule_search_locations = list(compat_spec.submodule_search_locations)
        return spec


class DeepSpeedDistribution(importlib.metadata.Distribution):
    """The `deepspeed` distribution metadata lightspeed presents (no files on disk)."""

    def read_text(self, filename):
        if filename == "METADATA":
            from lightspeed import __version__ as lightspeed_version

            return (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {DEEPSPEED_VERSION}\n"
                    f"Summary: DeepSpeed API provided by lightspeed {lightspeed_version}\n"
                    f"Requires-Dist: lightspeed=={lightspeed_version}\n")
        if filename == "top_level.txt":
            return ALIAS + "\n"
        if filename == "INSTALLER":
            return "lightspeed\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(__file__).with_name("deepspeed") / str(path)  # the compat package's directory


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _DistributionAlias(importlib.metadata.DistributionFinder):
    def find_spec(self, fullname, path=None, target=None):
        return None  # metadata only; modules are _ModuleAlias's

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is None or _normalize(context.name) == ALIAS:
            yield DeepSpeedDistribution()


_HOOKS: tuple[_ModuleAlias, _DistributionAlias] | None = None


def is_registered() -> bool:
    return _HOOKS is not None and all(hook in sys.meta_path for hook in _HOOKS)


def _real_deepspeed() -> str | None:
    """A description of an installed or imported DeepSpeed other than lightspeed's, else None."""
    try:
        dist = importlib.metadata.distribution(ALIAS)
        return f"DeepSpeed {dist.version} is installed"
    except importlib.metadata.PackageNotFoundError:
        pass
    module = sys.modules.get(ALIAS)
    if module is not None and getattr(module, "__name__", None) != TARGET:
        return f"a module named deepspeed is already imported ({getattr(module, '__file__', module)!r})"
    return None


def register_as_deepspeed(override: bool = False) -> None:
    """From now on `import deepspeed` (and its submodules) gives lightspeed's DeepSpeed-compatible API,
    and `importlib.metadata` reports a `deepspeed` distribution of version `DEEPSPEED_VERSION`.

    Idempotent. Raises `RegistrationError` when a real DeepSpeed is installed or already imported,
    unless `override=True`, which shadows it for the rest of this process.
    """
    global _HOOKS
    if is_registered():
        return
    found = _real_deepspeed()
    if found is not None and not override:
        raise RegistrationError(f"register_as_deepspeed(): {found}; uninstall it, or pass override=True to "
                                f"shadow it with lightspeed in this process")
    if found is not None:
        for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
            del sys.modules[name]
    _HOOKS = (_ModuleAlias(), _DistributionAlias())
    for hook in reversed(_HOOKS):
        sys.meta_path.insert(0, hook)
    importlib.invalidate_caches()
    if found is not None:
        logger.warning("register_as_deepspeed(override=True): %s; lightspeed shadows it in this process", found)
    logger.info("registered lightspeed as deepspeed %s: `import deepspeed` now gives lightspeed.compat.deepspeed",
                DEEPSPEED_VERSION)


def unregister_as_deepspeed() -> None:
    """Undo `register_as_deepspeed()`: remove the hooks and forget the `deepspeed` aliases imported
    since (the compat modules stay imported under their lightspeed names)."""
    global _HOOKS
    if _HOOKS is None:
        return
    for hook in _HOOKS:
        while hook in sys.meta_path:
            sys.meta_path.remove(hook)
    _HOOKS = None
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET):
            del sys.modules[name]
    importlib.invalidate_caches()
