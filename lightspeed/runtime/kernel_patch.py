"""The ``kernels`` section's model transform: swaps lightspeed.ops.fused's kernels into a model in place, at
`initialize()`, before the module is placed, cast or sharded.

Owns: which modules of which models are replaced, and how (`apply_kernels`). Must not: change any
parameter, buffer, module name or the module tree (state dicts, tied weights, the optimizer's parameter
list and ZeRO's units see the model unchanged), or touch the strategy.

What is replaced (a class of the list, found anywhere in the model; each switch of the section on its
own):
- ``rms_norm``: LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm, MixtralRMSNorm (and their MoE
  siblings): forward -> `rms_norm(x, weight, variance_epsilon)`.
- ``swiglu``: LlamaMLP, Qwen2MLP, Qwen3MLP, MistralMLP whose `config.hidden_act` is silu / swish:
  forward -> down_proj(swiglu(gate_proj(x), up_proj(x))).
- ``rope``: LlamaAttention, Qwen2Attention, Qwen3Attention, MistralAttention, MixtralAttention: the
  `apply_rotary_pos_emb` their forward calls -> `apply_rope`.
- ``fused_linear_cross_entropy``: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
  MistralForCausalLM, GPT2LMHeadModel (the loss from the hidden states, HF's ForCausalLMLoss
  semantics); and any module with a `lightspeed_fused_lm_loss` attribute (the examples' GPT), which is
  set to the fused function `(hidden, weight, targets) -> loss`.
`kernels.enabled` with nothing to replace in the model is a ConfigError naming the section, and so is a
causal LM whose lm_head is not a plain nn.Linear (split by tensor parallelism, converted by float8:
its own forward would be bypassed). The transform runs after the model transforms and float8, so the
MLP and attention of a tensor-parallel model keep their split projections (the kernels are
elementwise / per head and run on the local shards).

Note: [how a class is replaced] A module's class becomes a subclass of its own class made once per
(class, backend) ("Fused" + name) that overrides `forward` only: isinstance checks, parameter names and
hooks are unchanged. For RoPE the subclass's forward is the attention's own forward (each decorator
level rebuilt around it) with `apply_rotary_pos_emb` resolved in a shadow copy of its module,
registered in sys.modules as lightspeed.runtime.kernel_patch.shadow.<module>.<class>_<backend> (torch.compile
wants a function's globals to be a module's): no global of transformers is modified, so unpatched
models in the same process keep HF's function. The subclasses are made at run time, so pickling the
whole module (torch.save(model)) is not supported; state dicts are unchanged.

Note: [the causal-LM loss] HF's `*ForCausalLM.forward` computes `logits = lm_head(hidden)` and then
`self.loss_function(logits, labels, ...)`. Re-implementing those forwards (Liger-Kernel's way) ties the
patch to one transformers version's signature and output handling. Instead, when the model is training
and `labels` is passed by keyword, a forward pre-hook takes the labels out (the model's forward runs
with labels=None, everything else as the caller gave it), the lm_head's forward computes the fused
loss from the hidden states it receives (labels shifted as ForCausalLMLoss does, or `shift_labels`;
`num_items_in_batch` gives sum / num_items, else the mean over non-ignored tokens) and returns a
zero-stride stand-in for the logits (no memory), and the forward hook puts the loss into the output
with `logits=None` (as Liger-Kernel returns in training). In eval mode, or with labels passed
positionally, nothing changes: real logits, HF's loss. Models whose forward does more after the lm_head
(Gemma's logit soft-capping, Mixtral's router loss) are not in the list for that reason.

Note: [ZeRO-3] The lm_head (and the examples' GPT's `lm_head.weight`, read in its root forward) belongs
to the root unit, which is gathered for the whole root forward (zero/stage3/units.py), so the fused
function receives the full weight and returns the full weight's gradient, which the strategy
reduce-scatters like any other; the lm_head forward also checks that its weight is whole.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.nn.functional as F

from lightspeed._utils.logging import get_logger
from lightspeed.config.errors import ConfigError
from lightspeed.ops import fused

logger = get_logger(__name__)

_FAMILIES = ("Llama", "Qwen2", "Qwen3", "Mistral", "Mixtral", "Qwen2Moe", "Qwen3Moe")
RMSNORM_CLASSES = frozenset(f"{f}RMSNorm" for f in _FAMILIES)
MLP_CLASSES = frozenset(f"{f}MLP" for f in ("Llama", "Qwen2", "Qwen3", "Mistral"))
ATTENTION_CLASSES = frozenset(f"{f}Attention" for f in _FAMILIES)
CAUSAL_LM_CLASSES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                               "GPT2LMHeadModel"})
OWN_MODEL_ATTRIBUTE = "lightspeed_fused_lm_loss"
SILU_NAMES = ("silu", "swish")

_subclasses: dict[tuple, type] = {}


def _from_transformers(cls: type) -> bool:
    return cls.__module__.startswith("transformers.")


def _subclass(cls: type, key: str, namespace: dict) -> type:
    k = (cls, key)
    if k not in _subclasses:
        _subclasses[k] = type(f"Fused{cls.__name__}", (cls,), {"__module__": __name__, **namespace})
    return _subclasses[k]


# ------------------------------------------------------------------------------------------------ RMSNorm
def _rms_class(cls: type, backend: str) -> type:
    def forward(self, hidden_states):
        return fused.rms_norm(hidden_states, self.weight, self.variance_epsilon, backend=backend)

    return _subclass(cls, f"rms/{backend}", {"forward": forward})


# ------------------------------------------------------------------------------------------------ SwiGLU
def _mlp_class(cls: type, backend: str) -> type:
    def forward(self, x):
        return self.down_proj(fused.swiglu(self.gate_proj(x), self.up_proj(x), backend=backend))

    return _subclass(cls, f"swiglu/{backend}", {"forward": forward})


# ------------------------------------------------------------------------------------------------ RoPE
def _shadow_module(namespace: dict, replace: dict, tag: str) -> types.ModuleType:
    """A module registered in sys.modules holding a copy of `namespace` overlaid by `replace`: the
    rebuilt function's globals. torch.compile resolves a function's globals through
    sys.modules[globals["__name__"]], so they must be a real module's namespace, not a loose dict."""
    name = f"{__name__}.shadow.{namespace['__name__']}.{tag}"
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in namespace.items() if k not in ("__name__", "__spec__", "__loader__")})
        module.__dict__.update(replace)
        sys.modules[name] = module
    return sys.modules[name]


def _rebuilt(fn, replace: dict, tag: str):
    """`fn` with its innermost function's globals overlaid by `replace`; each decorator level (a
    functools.wraps wrapper holding the inner function in a closure cell) rebuilt around the new one."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, _shadow_module(fn.__globals__, replace, tag).__dict__, fn.__name__,
                                 fn.__defaults__, fn.__closure__)
    else:
        new_inner = _rebuilt(inner, replace, tag)
        cells, swapped = [], False
        for cell in fn.__closure__ or ():
            try:
                held = cell.cell_contents
            except ValueError:
                held = None
            if held is inner:
                cells.append(types.CellType(new_inner))
                swapped = True
            else:
                cells.append(cell)
        if not swapped:
            raise TypeError(f"kernels.rope: cannot rebuild the decorator around {fn.__qualname__} (the wrapped "
                            f"function is not in its closure)")
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
        new.__dict__.update(fn.__dict__)
        new.__wrapped__ = new_inner
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
    return new


def _innermost(fn):
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def _attention_class(cls: type, backend: str) -> type | None:
    forward = cls.forward
    if "apply_rotary_pos_emb" not in _innermost(forward).__code__.co_names:
        return None

    def rope(q, k, cos, sin, unsqueeze_dim=1):
        return fused.apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, backend=backend)

    replaced = _rebuilt(forward, {"apply_rotary_pos_emb": rope}, f"{cls.__name__}_{backend}")
    return _subclass(cls, f"rope/{backend}", {"forward": replaced})


# ------------------------------------------------------------------------------------------------ the loss
class _LossState:
    """What the pre-hook hands to the lm_head and the lm_head to the forward hook (one forward at a time)."""

    def __init__(self):
        self.labels = self.shift_labels = self.num_items = self.loss = None
        self.armed = False


def _lm_head_class(cls: type, state: _LossState, loss_fn) -> type:
    def forward(self, hidden):
        if not state.armed:
            return F.linear(hidden, self.weight, self.bias)
        state.armed = False
        if self.weight.dim() != 2 or self.weight.shape[1] != hidden.shape[-1] or self.weight.numel() == 0:
            raise RuntimeError(f"kernels.fused_linear_cross_entropy: lm_head weight {list(self.weight.shape)} is "
                               f"not whole (a ZeRO-3 partition?) for hidden size {hidden.shape[-1]}")
        labels = state.shift_labels
        if labels is None:
            labels = F.pad(state.labels, (0, 1), value=-100)[..., 1:]
        labels = labels.to(hidden.device)
        if state.num_items is None:
            state.loss = loss_fn(hidden, self.weight, labels, bias=self.bias, reduction="mean")
        else:
            total = loss_fn(hidden, self.weight, labels, bias=self.bias, reduction="sum")
            num = state.num_items.to(total.device) if torch.is_tensor(state.num_items) else state.num_items
            state.loss = total / num
        return hidden.new_empty(()).expand(*hidden.shape[:-1], self.weight.shape[0])

    return _subclass(cls, f"lm_head/{id(state)}", {"forward": forward})


def _patch_causal_lm(model: torch.nn.Module, loss_fn) -> None:
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(lm_head) is not torch.nn.Linear:  # a subclass (tensor parallel, float8) has a forward of its own
        raise ConfigError(f"kernels.fused_linear_cross_entropy: {type(model).__name__}'s output embeddings are a "
                          f"{type(lm_head).__name__}, not a plain nn.Linear (split by tensor parallelism, or converted "
                          f"by float8: keep it out with float8.filter_fqns); set the key to false")
    state = _LossState()
    lm_head.__class__ = _lm_head_class(type(lm_head), state, loss_fn)

    def pre_hook(module, args, kwargs):
        state.armed, state.loss = False, None
        if not module.training or kwargs.get("labels") is None:
            return None
        state.labels, state.shift_labels = kwargs["labels"], kwargs.get("shift_labels")
        state.num_items = kwargs.get("num_items_in_batch")
        state.armed = True
        return args, {**kwargs, "labels": None}

    def post_hook(module, args, kwargs, output):
        loss, state.loss, state.armed = state.loss, None, False
        state.labels = state.shift_labels = state.num_items = None
        if loss is None or output is None:  # not armed, or the forward raised
            return None
        if isinstance(output, tuple):
            return (loss, None) + tuple(output[1:])  # HF's tuple leaves the None loss out: output[0] is the logits
        fields = {k: getattr(output, k) for k in output.__dataclass_fields__}
        fields.update(loss=loss, logits=None)
        return type(output)(**fields)

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True, always_call=True)


# ------------------------------------------------------------------------------------------------ entry
def apply_kernels(model: torch.nn.Module, cfg) -> list[str]:
    """Swap the fused kernels into `model` in place as `cfg` (the ``kernels`` section) says; returns
    "name: what" for each replaced module (none when `cfg.enabled` is false)."""
    if not cfg.enabled:
        return []
    backend = cfg.backend
    loss_fn = functools.partial(fused.fused_linear_cross_entropy, chunk_size=cfg.chunk_size, backend=backend)
    done: list[str] = []
    for name, module in model.named_modules():
        cls = type(module)
        if not _from_transformers(cls):
            if cfg.fused_linear_cross_entropy and hasattr(module, OWN_MODEL_ATTRIBUTE):
                setattr(module, OWN_MODEL_ATTRIBUTE, loss_fn)
                done.append(f"{name or '<root>'}: fused linear cross-entropy ({OWN_MODEL_ATTRIBUTE})")
            continue
        label = name or "<root>"
        if cfg.rms_norm and cls.__name__ in RMSNORM_CLASSES:
            module.__class__ = _rms_class(cls, backend)
            done.append(f"{label}: rms_norm")
        elif cfg.swiglu and cls.__name__ in MLP_CLASSES:
            act = getattr(getattr(module, "config", None), "hidden_act", None)
            if act in SILU_NAMES:
                module.__class__ = _mlp_class(cls, backend)
                done.append(f"{label}: swiglu")
            else:
                logger.info("kernels.swiglu: %s (%s) keeps its MLP: hidden_act %r is not silu", label, cls.__name__,
                            act)
        elif cfg.rope and cls.__name__ in ATTENTION_CLASSES:
            patched = _attention_class(cls, backend)
            if patched is None:
                raise ConfigError(f"kernels.rope: {cls.__name__}.forward does not call apply_rotary_pos_emb in this "
                                  f"transformers version; set kernels.rope to false")
            module.__class__ = patched
            done.append(f"{label}: rope")
        elif cfg.fused_linear_cross_entropy and cls.__name__ in CAUSAL_LM_CLASSES:
            _patch_causal_lm(module, loss_fn)
            done.append(f"{label}: fused linear cross-entropy (lm_head)")
    if not done:
        raise ConfigError(f"kernels.enabled: nothing in {type(model).__name__} has a fused kernel here (HF Llama, "
                          f"Qwen2/3, Mistral, GPT-2 causal LMs, or a module with `{OWN_MODEL_ATTRIBUTE}`)")
    kinds = sorted({d.rsplit(": ", 1)[1] for d in done})
    logger.info("kernels: replaced %d module(s) (%s)", len(done), ", ".join(kinds))
    return done
