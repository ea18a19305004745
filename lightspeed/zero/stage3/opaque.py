"""Opaque unit calls: a compiled root forward that calls its units as single ops of its graph.

Owns: the custom ops `lightspeed_z3::unit_forward` / `unit_backward`, the autograd function joining
them, and the wrapper installed as a compiled unit's call. Must not: gather, release or schedule
anything (the unit's own hooks, run by its eager call inside the op, do).

Note (why opaque): `engine.compile()` at stage 3 compiles each innermost unit (a transformer block) as
a region of its own (units.py's Note: compiled regions). The root's forward calls those units in a
loop (`for block in self.blocks: x = block(x)`), and a unit's hooks (gathers, collectives, the
coordinator's Python state) cannot be traced: dynamo breaks the graph at the call, and a graph break
inside a loop cannot be resumed, so dynamo skips the root's whole frame and the code around the loop
(embeddings, final norm, head, loss) runs eagerly. Here a unit called from a traced frame is one
opaque op instead: its forward runs the unit eagerly at run time (hooks, then the unit's own compiled
graph) with autograd recording a local graph, which the op's backward runs with
`torch.autograd.backward` (so the parameters' gradients accumulate and their hooks reduce-scatter as
in any backward), returning the gradients of the unit's inputs to the root's graph. The root's graph
never reads a unit's parameters (released when the root's graph starts): the op's shape function runs
the unit's `forward` on fake tensors with fake whole-shape parameters.

Note (what is opaque): a unit called with tensors only (no keyword arguments) whose output is a tensor
or a tuple/list of tensors. The root's first forward runs eagerly and each unit records how it was
called; the root runs compiled from then on only if every call was of that kind, and eagerly for good
(its units still compiled, as before) once one is not (Hugging Face blocks take keyword arguments and
cache objects). A unit first called later from a traced root keeps dynamo's graph break there.

Note (limits): a call saves its local graph under a ticket until its backward runs: a forward with grad
enabled whose backward never runs keeps it (as eager autograd would while its output lived). The op
returns copies of the unit's outputs (one activation copy per unit call): the compiler may reuse the
memory of an op's output once its graph is done with it, and the local graph may have saved it. The ops
are pure to the compiler: two calls of one unit on the same input tensor in one graph could be merged.
The shape function sees the unit's own parameters and buffers only: a unit whose forward reads a tensor
held elsewhere (another module's parameter, a tensor attribute outside its subtree) fails to trace.
The unit's call slot `_compiled_call_impl` (set by `nn.Module.compile`) is where the wrapper sits; the
module's class, hooks and parameters are untouched.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn.utils.stateless import _reparametrize_module

from lightspeed._utils.logging import get_logger
from lightspeed.zero.stage3.param_group import param_state

logger = get_logger(__name__)


@dataclass
class _Entry:
    module: "weakref.ref[torch.nn.Module]"
    call: Callable[..., Any]  # the unit's compiled `_call_impl` (its hooks around its graph)
    single: bool | None = None  # output: one tensor (True), a tuple of tensors (False), unknown/other (None)
    as_list: bool = False


_ENTRIES: dict[int, _Entry] = {}
_SAVED: dict[int, tuple[list[torch.Tensor], list]] = {}  # ticket -> (input leaves, outputs' gradient edges)
_uids = itertools.count(1)
_tickets = itertools.count(1)


def _record_output(entry: _Entry, out: Any) -> None:
    if isinstance(out, torch.Tensor):
        entry.single, entry.as_list = True, False
    elif isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        entry.single, entry.as_list = False, isinstance(out, list)
    else:
        entry.single = None


@torch._dynamo.disable
def _run_forward(uid: int, grad: bool, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _ENTRIES[uid]
    leaves = [t.detach().requires_grad_(grad and (t.is_floating_point() or t.is_complex())) for t in inputs]
    with torch.set_grad_enabled(grad):
        out = entry.call(*leaves)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    ticket = -1
    if grad:
        # the outputs' gradient edges, not the outputs: the graph holds only the copies returned
        ticket = next(_tickets)
        _SAVED[ticket] = (leaves, [get_gradient_edge(o) if o.requires_grad else None for o in outs])
    # copies: the compiler owns an op's outputs (it may reuse their memory once they are dead in its
    # graph), while the unit's local graph may have saved an output itself for its backward
    return [o.detach().clone() for o in outs] + [torch.tensor(ticket, dtype=torch.int64)]


@torch._dynamo.disable
def _run_backward(ticket: torch.Tensor, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves, outs = _SAVED.pop(int(ticket))
    pairs = [(edge, g) for edge, g in zip(outs, grads) if edge is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]


@torch.library.custom_op("lightspeed_z3::unit_forward", mutates_args=())
def unit_forward(uid: int, grad: bool, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run unit `uid` on `inputs` (with autograd recording when `grad`): its outputs and a ticket."""
    with torch._C._ForceDispatchKeyGuard(_include_keys(), _exclude_keys()):
        return _run_forward(uid, grad, inputs)


@torch.library.custom_op("lightspeed_z3::unit_backward", mutates_args=())
def unit_backward(ticket: torch.Tensor, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Backward of the unit call saved under `ticket`: the gradients of its inputs."""
    with torch._C._ForceDispatchKeyGuard(_include_keys(), _exclude_keys()):
        return _run_backward(ticket, inputs, grads)


def _include_keys():
    keys = torch._C._dispatch_tls_local_include_set()
    for k in (torch._C.DispatchKey.PythonDispatcher, torch._C.DispatchKey.Python):
        if keys.has(k):
            keys = keys.remove(k)
    return keys


def _exclude_keys():
    # the op's autograd kernel runs it below autograd: the unit's local graph needs autograd back
    keys = torch._C._dispatch_tls_local_exclude_set()
    for k in (torch._C.DispatchKey.AutogradOther, torch._C.DispatchKey.AutogradNestedTensor,
              torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        keys = keys.remove(k)
    return keys


@unit_forward.register_fake
def _unit_forward_fake(uid: int, grad: bool, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    module = _ENTRIES[uid].module()
    fake_mode = torch._guards.detect_fake_mode(inputs)
    state = {}
    for name, p in itertools.chain(module.named_parameters(remove_duplicate=False),
                                   module.named_buffers(remove_duplicate=False)):
        st = param_state(p)
        shape = tuple(st.shape) if st is not None else tuple(p.shape)
        state[name] = torch.empty(shape, dtype=p.dtype, device=p.device) if fake_mode is None or st is not None \
            else fake_mode.from_tensor(p)
    with torch.no_grad(), _reparametrize_module(module, state):
        out = module.forward(*inputs)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return [torch.empty_like(o) for o in outs] + [torch.empty((), dtype=torch.int64)]


@unit_backward.register_fake
def _unit_backward_fake(ticket, inputs, grads):
    return [torch.empty_like(t) for t in inputs]


class _UnitCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, uid: int, grad: bool, *inputs: torch.Tensor):
        *outs, ticket = torch.ops.lightspeed_z3.unit_forward(uid, grad, list(inputs))
        ctx.save_for_backward(ticket, *inputs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ticket, *inputs = ctx.saved_tensors
        gin = torch.ops.lightspeed_z3.unit_backward(ticket, inputs, list(grads))
        return (None, None, *(g if ctx.needs_input_grad[2 + i] else None for i, g in enumerate(gin)))


@dataclass
class _Join:
    """A compiled root and its opaque units: the root runs compiled once an eager forward has shown
    every unit call to be opaque, and eagerly for good once one is not (Note: what is opaque)."""

    ready: bool = False
    eager: bool = False


def join(root: torch.nn.Module, units: list[torch.nn.Module]) -> None:
    """After `root.compile()` and `unit.compile()` for each unit: make each unit opaque to the root's
    traced forward, and run the root's compiled call only while that holds (Note: what is opaque)."""
    compiled_root = root._compiled_call_impl
    if compiled_root is None or any(m._compiled_call_impl is None for m in units):
        raise RuntimeError("opaque.join: compile the root and its units (module.compile()) first")
    state = _Join()
    for m in units:
        _make_opaque(m, state)

    def root_call(*args, **kwargs):
        if state.ready:
            return compiled_root(*args, **kwargs)
        out = root._call_impl(*args, **kwargs)  # eager: each unit records how it is called
        if not state.eager:
            state.ready = True
        return out

    root._compiled_call_impl = root_call


def _make_opaque(module: torch.nn.Module, state: _Join) -> None:
    compiled = module._compiled_call_impl
    uid = next(_uids)
    entry = _Entry(weakref.ref(module), compiled)
    _ENTRIES[uid] = entry
    weakref.finalize(module, _ENTRIES.pop, uid, None)

    def call(*args, **kwargs):
        if torch.compiler.is_compiling() and entry.single is not None and not kwargs and args \
                and all(isinstance(a, torch.Tensor) for a in args):
            outs = _UnitCall.apply(uid, torch.is_grad_enabled(), *args)
            if entry.single:
                return outs[0]
            return list(outs) if entry.as_list else tuple(outs)
        out = compiled(*args, **kwargs)
        _record_output(entry, out)
        if not state.eager and (kwargs or not args or entry.single is None
                                or not all(isinstance(a, torch.Tensor) for a in args)):
            state.eager = True
            state.ready = False
            logger.info("engine.compile: unit %s is called with arguments other than tensors or returns other "
                        "than tensors: the root's forward stays eager around its compiled units",
                        type(module).__name__)
        return out

    module._compiled_call_impl = call
