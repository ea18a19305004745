"""`hybrid_engine.enable_cuda_graph`: `HybridEngine.generate`'s decode steps replayed from CUDA graphs.

Owns `DecodeGraphs`: one GraphedForward (lightspeed/inference/cuda_graph.py, the runner `init_inference`'s
enable_cuda_graph uses) kept by the engine, put in place of the model's forward for the length of each
generate call and taken off after (also when the call raises), the static KV cache kept between calls,
the decision whether graphs captured in an earlier call may replay in this one (`module_state`, `stale`),
and what `release_inference_cache` frees (`release`).
The runner goes on the module whose forward `generate` calls (a PEFT model's base model:
`generating_model`).
Must not: gather, fuse, split or shard anything (engine.py has the weights whole, LoRA fused and the
layers split before it calls in), or touch the model outside a generate call: training runs the model's
own forward.

Note: [static decode] The runner captures one graph per call signature, so the decode step's shapes must
not grow: the model's generation config is set to transformers' static KV cache for the call
(`cache_implementation="static"`, a StaticCache of `max_length` tokens) where it names no cache of its
own, and to no auto-compile; a caller's own cache, `cache_implementation` or `generation_config` wins
(a dynamic cache then runs eagerly: the runner finds its Python state changing and says so once). The
StaticCache is kept from one call to the next and handed back reset when the next call fits in it
(same batch, no longer), so the decode steps of later calls replay the graphs of the first: one
capture per (batch, length), not per call. A call that passes its own cache, or returns its cache
(`return_dict_in_generate`), gets a new cache and captures its decode step anew; its graphs are dropped
at the end of the call, when only the kept cache's are retained (`GraphedForward.retain`). The prefill
runs eagerly, always (transformers' `_prefill` pauses the runner): it is one forward per call, its graph
would hold a whole prompt's activations, and models that derive positions from the cache's length on the
device (OPT: `cache.get_seq_length()`, a tensor once the kept cache is initialized) read it back to the
host there, which a capture cannot do.

Note: [stale weights] A CUDA graph records device addresses, not tensors: a replay reads whatever lies at
the addresses the capture read. Values changed in place are therefore always current (the optimizer's
step between generate calls; LoRA fused into the base weight in place for the call and taken out after:
a graph captured with fused weights replays over the weights fused again in the next call, whatever their
values). What a graph cannot survive is a tensor that moved (another storage), a module replaced, or a
module's Python state changed (which branch its forward takes: DeepSpeed-Chat's `fuse_lora` flag, PEFT's
`merged`, `training`, a hook added). So at the end of each call `module_state` records, for every
module, its identity and mode, each parameter's, buffer's and tensor attribute's address, shape, strides
and dtype, its plain attributes and its forward hooks (but those of Note: [gradient-checkpointing hooks]);
at the start of the next call (weights gathered, LoRA fused, layers split: as the forward will read them)
the state is taken again and `stale` compares: any difference drops every graph (`GraphedForward.clear`),
and the call captures afresh. Addresses equal means each tensor the graph reads holds the current weights,
so equal state is sufficient, not a guess.

Note: [gradient-checkpointing hooks] transformers' `gradient_checkpointing_enable` (TRL turns checkpointing off
around generation and on again after, twice a GRPO step) registers a forward hook on the input embeddings,
`make_inputs_require_grads`, and without PEFT its `gradient_checkpointing_disable` leaves it there: each
step adds two more (PEFT's `make_inputs_require_grad` is the same function). Such a hook only sets its
output's requires_grad flag: no device work, so the captured kernels are the same with any number of
them, and a replay (autograd not recording: the runner runs recording calls eagerly) reads no flag.
`module_state` leaves exactly these hooks out (`_FLAG_HOOKS`, by defining module and name); any other
hook added or removed still drops the graphs.

Note: [stage 3] With `pin_parameters` (its default) the stage-3 seam gathers every group once for the
whole call, so every decode step reads the same gathered storage: capturable. Between calls the groups
are released (`ParamGroup.release` frees the storage, `resize_(0)`) and the next gather allocates it
again (`resize_`), at an address the allocator chooses (on the CPU, at a world of 2, another one every
call; CUDA's caching allocator may hand the same block back, nothing promises it), and a
`GatheredParameters` in between hands the old storage over and gathers into a new one. So at stage 3
over several ranks a call may capture its decode step again (once: the call's other steps replay); hence
the check of Note: [stale weights] before every call rather than a rule per stage; at a
world of one the parameters view their shards (never gathered: stage 3's one-rank views) and keep their
addresses. Unpinned stage 3 gathers and releases each layer inside every forward (collectives and
allocations a graph cannot hold), so `enable_cuda_graph` with `pin_parameters` false at stage 3 is a
ConfigError (config/features.py). With `inference_tp_size` > 1 the split layers are new modules with new
slices every call, so each call captures again (its all-reduces are captured as `init_inference`'s are).

Note: [memory] Graphs use the runner's memory pool (one per device, shared with every runner, reused by
later captures); the kept StaticCache and the graphs stay allocated between generate calls, through
training, unless `release_inference_cache` is set: then after every call the graphs are dropped (their
blocks go back to the graph pool for the next capture) and the kept cache let go (freed to the device by
the engine's `empty_cache`), and each call captures its decode step again.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.inference import cuda_graph

logger = get_logger(__name__)

_PLAIN = (bool, int, float, str, type(None))
_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
_SKIP = frozenset({"_parameters", "_buffers", "_modules", "training", "_previous_max_cache_length"})
_ABSENT = object()
# forward hooks that only set their output's requires_grad flag (Note: [gradient-checkpointing hooks]):
# (module, function name), the function defined inside the method that registers it
_FLAG_HOOKS = frozenset({("transformers.modeling_utils", "make_inputs_require_grads"),
                         ("peft.peft_model", "make_inputs_require_grad"),
                         ("peft.utils.other", "make_inputs_require_grad"),
                         ("peft.mixed_model", "make_inputs_require_grad")})


def _tensor(t: torch.Tensor) -> tuple:
    return ("tensor", t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def module_state(model: torch.nn.Module) -> dict:
    """{(module name, what): value}: what a captured forward reads of the model besides its arguments
    (Note: [stale weights]). `_previous_max_cache_length` (transformers' record of the longest static
    cache made, set by `generate` itself) is left out: it does not change what the forward runs."""
    state: dict = {}
    for name, module in model.named_modules():
        state[(name, "")] = (id(module), type(module), module.training)
        for key, t in itertools.chain(module._parameters.items(), module._buffers.items()):
            state[(name, key)] = None if t is None else _tensor(t)
        for key, value in vars(module).items():
            if key in _SKIP:
                continue
            if isinstance(value, torch.Tensor):
                state[(name, key)] = _tensor(value)
            elif isinstance(value, _PLAIN):
                state[(name, key)] = value
            elif isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
                state[(name, key)] = tuple(value)
            elif key in _HOOKS:  # the hooks' handle ids
                state[(name, key)] = tuple(i for i, hook in value.items() if not _flag_hook(hook))
    return state


def _flag_hook(hook) -> bool:
    """Whether `hook` is one of `_FLAG_HOOKS`: transformers' or PEFT's `make_inputs_require_grad(s)`, defined
    inside the method that registers it (Note: [gradient-checkpointing hooks])."""
    qualname = getattr(hook, "__qualname__", "")
    outer, _, own = qualname.rpartition(".<locals>.")
    return bool(outer) and (getattr(hook, "__module__", None), own) in _FLAG_HOOKS


def stale(captured: dict | None, now: dict) -> str | None:
    """Why graphs captured when the model's state was `captured` may not replay `now` (the first difference,
    as `module.attribute`), or None when they may (nothing captured yet, or nothing changed)."""
    if captured is None or captured == now:
        return None
    for key in itertools.chain(captured, (k for k in now if k not in captured)):
        before, after = captured.get(key, _ABSENT), now.get(key, _ABSENT)
        if before != after:
            name, what = key
            where = ".".join(part for part in (name or "model", what) if part)
            if what == "":
                return f"{where} (replaced or switched between train and eval)"
            if after is _ABSENT or before is _ABSENT:
                return f"{where} (added or removed)"
            if isinstance(before, tuple) and before[:1] == ("tensor",):
                return f"{where} (moved to other storage)" if before[1] != after[1] else f"{where} (reshaped)"
            return f"{where} (changed)"
    return None


def generating_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward `model.generate` calls: a PEFT model's base model (its `generate` hands the
    call to the transformers model inside), else `model` itself."""
    base = getattr(model, "get_base_model", None)
    inner = base() if callable(base) else model
    return inner if isinstance(inner, torch.nn.Module) else model


def _paused(runner: cuda_graph.GraphedForward, method):
    """`method` with the runner's calls run eagerly for its length."""
    def call(*args, **kwargs):
        runner.paused = True
        try:
            return method(*args, **kwargs)
        finally:
            runner.paused = False
    return call


class DecodeGraphs:
    """The engine's decode graphs (module docstring). `generating(model, generate)` is the context of one
    generate call; `release()` frees the graphs and the kept cache; `runner` counts captures and replays."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        model = generating_model(model)
        self.runner = cuda_graph.runner_for(model, device)
        self.caches = cuda_graph.kept_static_caches(model)  # Note: [static decode]
        self.captured_state: dict | None = None
        self.drops = 0  # calls whose earlier graphs were dropped (Note: [stale weights])

    @contextlib.contextmanager
    def generating(self, model: torch.nn.Module, generate):
        """Inside: `model.forward` is the runner (its graphs checked against the model's state first), the
        generation config asks for a static cache; yields `generate` wrapped to keep that cache. On exit the
        model's own forward, cache preparation and generation config are back, also after an exception."""
        why = stale(self.captured_state, module_state(model))
        root, model = model, generating_model(model)
        runner = self.runner
        if why is not None and (runner.graphs or runner.seen or runner.eager):
            logger.info("hybrid_engine.enable_cuda_graph: %s since the last generate call; its graphs are dropped "
                        "and captured again", why)
            runner.clear()
            self.drops += 1
        cuda_graph.attach(model, runner)
        try:
            prefill = getattr(model, "_prefill", None)
            if callable(prefill):
                model._prefill = _paused(runner, prefill)  # Note: [static decode]
            if self.caches is not None:
                model._prepare_static_cache = self.caches.prepare_static_cache
                yield self.caches.generate(generate)
            else:
                yield generate
        except cuda_graph.CaptureError as err:
            raise cuda_graph.CaptureError(f"hybrid_engine.enable_cuda_graph: {type(model).__name__}'s decode step "
                                          f"could not be captured in a CUDA graph ({err.__cause__}); set "
                                          f"hybrid_engine.enable_cuda_graph false") from err
        finally:
            model.__dict__.pop("_prepare_static_cache", None)
            model.__dict__.pop("_prefill", None)
            cuda_graph.detach(model)
            # graphs over any other cache (a caller's own, one returned with the output) serve no later call
            runner.retain([cache for _length, cache in self.caches.kept.values()] if self.caches is not None else [])
            self.captured_state = module_state(root)  # what this call's graphs read

    def release(self) -> None:
        """Drop every graph and the kept static cache (Note: [memory])."""
        self.runner.clear()
        if self.caches is not None:
            self.caches.kept = {}


__all__ = ["DecodeGraphs", "generating_model", "module_state", "stale"]
