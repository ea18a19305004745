"""`init_inference(enable_cuda_graph=True)`: the model's forward replayed from CUDA graphs.

DeepSpeed's engine captures its forward at the first call and replays that one graph for every later
call whatever the inputs, and the model's own `generate` (which calls the model, not the engine) never
uses it. Here the model's `forward` itself is replaced, so `model(...)`, `engine.module(...)` and
`model.generate(...)` all go through it, and every distinct call signature gets its own graph:

- the signature is the arguments' structure, each tensor's shape / dtype / device, plain values
  (`use_cache=True`, `logits_to_keep=1`) and the identity of any other object (a KV cache);
- a signature's first call runs eagerly: it is the warm-up (autotuning, the cache's lazy allocation), and
  a one-off prefill is never captured; the second call captures and replays; later calls replay;
- tensor arguments are copied into the graph's input buffers on every call (read, never written back);
  output tensors are copied out of the graph's buffers, so a result stays valid after the next call.

What a graph cannot replay is found and run eagerly, with a warning, never replayed wrong: the forward
may only change its argument objects' tensors in place (transformers' StaticCache). If capturing it
changed their Python state (a DynamicCache concatenates new tensors), the captured graph is replayed once
(capture ran the Python, the replay runs the GPU work: together one call) and the signature runs eagerly
from then on. If an argument object's state was changed between calls (its tensors replaced), the
signature is captured again. Calls with autograd recording, or with a tensor that is not on the model's
GPU, run eagerly (logged once).

One Python state is replayed: transformers' static sliding-window cache layers (Mistral, Gemma 2/3,
Phi-3...) count their tokens in a Python int that leaves the GPU work unchanged while the window has room
(`_is_window_layer`). The runner advances the count after each replay, as the capture did; a call whose
window is full runs eagerly, and the next generate call (the kept cache, reset) replays again. A forward
that reads the count otherwise (a prompt's attention mask made inside the forward) runs eagerly.

Only CUDA devices capture (`GRAPH_DEVICE_TYPES`): a runner made for another device runs every call eagerly
(logged once); the hybrid engine installs one on any device, and CPU tests add their stand-in's.

The runner may be put on a model and taken off again (`attach` / `detach`), keeping its graphs meanwhile:
the hybrid engine graphs only its `generate` calls (lightspeed/hybrid/graphs.py), so training runs the
model's own forward; it also pauses the runner for the prefill (`paused`: calls run eagerly, unrecorded)
and keeps only its kept cache's graphs between calls (`retain`). `captures` / `replays` count.

Graphs share one memory pool per device, with every other runner's (`_pool`): they never run at the same
time, and outputs are copied out at once.
Argument objects are held by weak reference, so a graph never keeps a dead KV cache alive.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import inspect
import types
import weakref

import torch
from torch.utils import _pytree as pytree

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)

MAX_GRAPHS = 16  # captured signatures kept (least recently used dropped)
_MAX_SEEN = 256  # signatures seen once, waiting for their second call
_DEPTH = 4  # how deep an argument object's attributes are compared
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_PLAIN_TYPES = frozenset(_PLAIN)
_TENSOR_OR_PLAIN = (torch.Tensor, *_PLAIN)
_OPAQUE = (torch.nn.Module, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           functools.partial, weakref.ref)
_WINDOW_COUNT = "cumulative_length_int"  # a sliding-window cache layer's Python token count
# its methods whose use of the count leaves a graph valid while the window has room (`_is_window_layer`)
_WINDOW_SAFE = frozenset({"update", "get_mask_sizes", "lazy_initialization", "get_max_length"})
_window_types: dict = {}
_POOLS: dict = {}  # device -> the graphs' MemPool (`_pool`)
GRAPH_DEVICE_TYPES = frozenset({"cuda"})  # where calls are captured; a runner elsewhere runs them eagerly


class _Ref:
    """An argument object in a signature: equal only to the same live object (weakly held when it can be)."""

    __slots__ = ("_ref", "_id")

    def __init__(self, obj):
        self._id = id(obj)
        try:
            self._ref = weakref.ref(obj)
        except TypeError:  # no weak references to it: hold it
            self._ref = lambda: obj

    @property
    def alive(self) -> bool:
        return self._ref() is not None

    def __eq__(self, other) -> bool:
        return isinstance(other, _Ref) and self._id == other._id and self._ref() is other._ref() is not None

    def __hash__(self) -> int:
        return self._id


def _key(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    if isinstance(leaf, _PLAIN):
        return (type(leaf), leaf)
    return _Ref(leaf)


def _state(obj, depth: int, out: list, path: tuple | None, seen: set, windows: list) -> None:
    """Append what a graph depends on in `obj`: each tensor's address and shape, and plain values, walking
    attributes, lists and dicts `depth` levels down (with `path`: (place in `obj`, item) pairs). Sliding-window
    layers' token counts are left out, their layers appended to `windows` (`_is_window_layer`)."""
    if isinstance(obj, torch.Tensor):
        item = (obj.data_ptr(), obj.shape)
    elif isinstance(obj, _PLAIN):
        item = obj
    elif depth == 0 or id(obj) in seen or isinstance(obj, _OPAQUE) or not isinstance(obj, (list, tuple, dict)) \
            and not hasattr(obj, "__dict__"):
        item = ("object", id(obj))
    else:
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            items = enumerate(obj)
        elif isinstance(obj, dict):
            items = obj.items()
        elif _is_window_layer(obj):
            windows.append(obj)
            items = [(name, child) for name, child in vars(obj).items() if name != _WINDOW_COUNT]
        else:
            items = vars(obj).items()
        depth -= 1
        if path is None:  # the check before every replay: leaves inline
            for _name, child in items:
                kind = type(child)
                if kind in _PLAIN_TYPES:
                    out.append(child)
                elif isinstance(child, torch.Tensor):
                    out.append((child.data_ptr(), child.shape))
                else:
                    _state(child, depth, out, None, seen, windows)
        else:
            dotted = not isinstance(obj, (list, tuple, dict))
            for name, child in items:
                _state(child, depth, out, path + (f".{name}" if dotted else f"[{name!r}]",), seen, windows)
        return
    out.append(item if path is None else (path, item))


def argument_state(objects: dict, paths: bool = False) -> tuple[list, list]:
    """(state, windows): the state of the argument objects ({argument name: object}) a captured graph depends
    on, and the sliding-window cache layers among them (whose token counts the state leaves out)."""
    out: list = []
    windows: list = []
    for name, obj in objects.items():
        _state(obj, _DEPTH, out, (str(name),) if paths else None, set(), windows)
    return out, windows


def _is_window_layer(obj) -> bool:
    """transformers' StaticSlidingWindowLayer (5.x) counts the tokens it holds in a Python int,
    `cumulative_length_int`, which every forward advances. While the window has room for a call's tokens
    (count + tokens <= max_cache_len) the layer's GPU work and the attention mask's sizes are the same
    whatever the count (it writes at its tensor count, masks the whole window from offset 0), so a graph
    captured there replays at any count with room, and the runner advances the int as the capture did.
    Only `update` and `get_mask_sizes` may use the count meanwhile: a forward that calls another of the
    layer's methods (`get_seq_length()`, for a mask made inside the forward or positions when none are
    passed) would bake the count into the graph, and runs eagerly (`_watch_counts`)."""
    kind = type(obj)
    known = _window_types.get(kind)
    if known is None:
        known = _window_types[kind] = any(c.__name__ == "StaticSlidingWindowLayer"
                                          and c.__module__.startswith("transformers.") for c in kind.__mro__)
    return known and isinstance(getattr(obj, _WINDOW_COUNT, None), int) \
        and isinstance(getattr(obj, "max_cache_len", None), int)


def _room(windows: list, steps: list) -> bool:
    """Whether every window layer has room for the tokens its captured call added (`_is_window_layer`)."""
    return len(windows) == len(steps) and all(
        getattr(w, _WINDOW_COUNT) + d <= w.max_cache_len for w, d in zip(windows, steps))


def _changed(before: list, after: list) -> str:
    """The first place where two `argument_state(..., paths=True)` lists differ, as text."""
    b, a = dict(before), dict(after)
    for path in [*b, *(p for p in a if p not in b)]:
        if b.get(path, "absent") != a.get(path, "absent"):
            return "".join(path)
    return "?"


def _argument_name(path) -> str:
    """`args[0]`, `cache`, `cache.layers`... for a leaf's path in the flattened ((args), {kwargs})."""
    top, first, *rest = path
    name = f"args[{first.idx}]" if top.idx == 0 else str(first.key)
    return name + pytree.keystr(tuple(rest))


class CaptureError(RuntimeError):
    """A forward that could not be captured in a CUDA graph (what failed is its cause)."""


class _Graph:
    __slots__ = ("graph", "inputs", "out_spec", "out_leaves", "state", "steps")


class GraphedForward:
    """The replacement for a model's `forward` (see the module docstring). `clear()` drops every graph."""

    def __init__(self, forward, device: torch.device, needs_grad: bool):
        self._forward = _weak(forward)  # the model holds this runner: no reference back (`_weak`)
        self.device = device
        self.needs_grad = needs_grad  # a parameter requires grad: calls with autograd on run eagerly
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.seen: collections.OrderedDict = collections.OrderedDict()
        self.eager: dict = {}  # signatures that cannot be replayed -> why
        self.full: dict = {}  # those of them captured with a full sliding window -> the tokens the call added
        self.pool = None
        self.captures = 0
        self.replays = 0
        self.paused = False  # set: calls run eagerly, unrecorded (the hybrid engine's prefill)
        self.restore: dict = {}  # generation-config values install changed
        self.own_forward = None  # (bound to the model?, function): a forward set on the instance, put back by detach
        self._warned: set = set()

    def forward(self, *args, **kwargs):
        """The model's own forward."""
        return self._forward()(*args, **kwargs)

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()
        self.eager.clear()
        self.full.clear()

    def retain(self, objects) -> None:
        """Forget every signature (its graph too) that holds an argument object other than `objects`: the
        hybrid engine keeps, from one generate call to the next, only the graphs of the cache it keeps."""
        keep = {id(obj) for obj in objects}
        for table in (self.graphs, self.seen, self.eager, self.full):
            for sig in [s for s in table if any(isinstance(k, _Ref) and k._id not in keep for k in s[1])]:
                del table[sig]

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("enable_cuda_graph: %s", reason)

    def __call__(self, *args, **kwargs):
        if self.paused:
            return self.forward(*args, **kwargs)
        if self.device.type not in GRAPH_DEVICE_TYPES:
            self._warn_once(f"{self.device} is not a CUDA device; calls run without a graph")
            return self.forward(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if any(t.device != self.device for t in tensors):
            self._warn_once(f"a tensor argument is not on {self.device}; such calls run without a graph")
            return self.forward(*args, **kwargs)
        if torch.is_grad_enabled() and (self.needs_grad or any(t.requires_grad for t in tensors)):
            self._warn_once("autograd is recording (call under torch.no_grad() or torch.inference_mode()); "
                            "such calls run without a graph")
            return self.forward(*args, **kwargs)
        sig = (spec, tuple(_key(x) for x in leaves))
        if sig in self.eager:
            steps = self.full.get(sig)
            if steps is None or not _room(argument_state(self._objects(leaves))[1], steps):
                return self.forward(*args, **kwargs)
            del self.eager[sig], self.full[sig]  # the windows have room again (a reset cache): capture again
            return self._capture(sig, spec, leaves, (args, kwargs))
        entry = self.graphs.get(sig)
        if entry is not None:
            self.graphs.move_to_end(sig)
            state, windows = argument_state(self._objects(leaves))
            if state == entry.state:
                if _room(windows, entry.steps):
                    out = self._replay(entry, leaves)
                    for window, step in zip(windows, entry.steps):  # the Python the graph does not run
                        setattr(window, _WINDOW_COUNT, getattr(window, _WINDOW_COUNT) + step)
                    return out
                self._warn_once("a sliding-window cache layer's window is full; calls run without a graph until "
                                "it has room again (the next generate call)")
                return self.forward(*args, **kwargs)
            logger.info("enable_cuda_graph: an argument object's tensors changed since the capture; capturing again")
        elif sig not in self.seen:  # first call of this signature: eager, the warm-up
            self._forget_dead()
            self.seen[sig] = None
            if len(self.seen) > _MAX_SEEN:
                self.seen.popitem(last=False)
            return self.forward(*args, **kwargs)
        return self._capture(sig, spec, leaves, (args, kwargs))

    @staticmethod
    def _objects(leaves, named_from=None) -> dict:
        """The argument objects (leaves that are neither tensors nor plain values), by leaf index, or by
        argument name when `named_from` is the call's (args, kwargs)."""
        if named_from is not None:
            with_path, _ = pytree.tree_flatten_with_path(named_from)
            return {_argument_name(path): leaf for path, leaf in with_path if not isinstance(leaf, _TENSOR_OR_PLAIN)}
        return {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, _TENSOR_OR_PLAIN)}

    def _forget_dead(self) -> None:
        for table in (self.graphs, self.seen, self.eager, self.full):
            for sig in [s for s in table if not all(k.alive for k in s[1] if isinstance(k, _Ref))]:
                del table[sig]

    def _capture(self, sig, spec, leaves, call):
        self.seen.pop(sig, None)
        self.graphs.pop(sig, None)
        objects = self._objects(leaves, named_from=call)
        before, windows = argument_state(objects, paths=True)
        counts = [getattr(w, _WINDOW_COUNT) for w in windows]
        reads: list = []
        with torch.inference_mode(False):  # input buffers usable inside and outside inference mode
            inputs = [torch.empty_like(x).copy_(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(inputs, spec)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device):
                if self.pool is None:
                    self.pool = _pool(self.device)
                # thread_local: other threads' CUDA calls (NCCL's watchdog polling its events) must not void it
                capture = torch.cuda.graph(graph, pool=self.pool.id, capture_error_mode="thread_local")
            with torch.cuda.device(self.device), _no_gc(), capture, _watch_counts(windows, reads):
                out = self.forward(*args, **kwargs)
        except Exception as err:
            raise CaptureError(f"enable_cuda_graph: the forward could not be captured in a CUDA graph ({err}); "
                               f"pass enable_cuda_graph=False") from err
        self.captures += 1
        out_leaves, out_spec = pytree.tree_flatten(out)
        entry = _Graph()
        entry.graph, entry.out_spec = graph, out_spec
        # argument objects come back as the call's own (held by index: a graph keeps no cache alive)
        position = {id(x): i for i, x in enumerate(leaves) if not isinstance(x, _TENSOR_OR_PLAIN)}
        entry.out_leaves = [_Argument(position[id(x)]) if id(x) in position else x for x in out_leaves]
        entry.inputs = [(i, x) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        after, _ = argument_state(objects, paths=True)
        entry.steps = [getattr(w, _WINDOW_COUNT) - count for w, count in zip(windows, counts)]
        new = [x for x in out_leaves if not isinstance(x, _TENSOR_OR_PLAIN) and id(x) not in position]
        full = any(count + step > w.max_cache_len or step < 0 for w, count, step in zip(windows, counts, entry.steps))
        if after != before or new or reads or full:
            if new:
                why = (f"the forward returns a new {type(new[0]).__name__} each call, which a graph would hand "
                       f"out again (use_cache=False, or a cache passed in)")
            elif after != before:
                why = (f"the forward changes {_changed(before, after)} (Python state a graph cannot replay: a "
                       f"DynamicCache?; generate with a static cache)")
            elif reads:
                why = (f"the forward calls a sliding-window cache layer's {reads[0]}() (its token count, which a "
                       f"graph would keep: a prompt's attention mask, positions when none are passed)")
            else:
                why = "a sliding-window cache layer's window is full"
                self.full[sig] = entry.steps  # captured again once the windows have room
            self.eager[sig] = why
            self._warn_once(f"{why}; calls like it run without a graph" + (" until it has room again" if full else ""))
            return self._outputs(entry, leaves)  # capture ran the Python, the replay runs the GPU work: one call
        entry.state = [item for _path, item in after]
        self.graphs[sig] = entry
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
            self._warn_once(f"more than {MAX_GRAPHS} input signatures; the least recently used graphs are dropped")
        logger.info("enable_cuda_graph: captured graph %d (%s)", self.captures,
                    ", ".join(str(tuple(x.shape)) for x in leaves if isinstance(x, torch.Tensor)))
        return self._outputs(entry, leaves)

    def _replay(self, entry: _Graph, leaves):
        for i, buffer in entry.inputs:
            buffer.copy_(leaves[i])
        self.replays += 1
        return GraphedForward._outputs(entry, leaves)

    @staticmethod
    def _outputs(entry: _Graph, leaves):
        entry.graph.replay()
        out = [x.clone() if isinstance(x, torch.Tensor) else leaves[x.index] if isinstance(x, _Argument) else x
               for x in entry.out_leaves]
        return pytree.tree_unflatten(out, entry.out_spec)


@contextlib.contextmanager
def _watch_counts(windows: list, reads: list):
    """Inside: a window layer's public methods other than `_WINDOW_SAFE` (get_seq_length, which hands its
    token count to the forward; crop, reset...) append their names to `reads` when called."""
    def watched(name, method):
        def call(*args, **kwargs):
            reads.append(name)
            return method(*args, **kwargs)
        return call

    patched = []
    for window in windows:
        names = [n for n in dir(type(window)) if not n.startswith("_") and n not in _WINDOW_SAFE
                 and callable(getattr(type(window), n, None)) and n not in vars(window)]
        for name in names:
            setattr(window, name, watched(name, getattr(window, name)))
        patched.append((window, names))
    try:
        yield
    finally:
        for window, names in patched:
            for name in names:
                delattr(window, name)


def _weak(method):
    """A callable returning `method`; for a bound method, without holding its object: the runner and the
    wrappers install puts on the model add no reference cycle, so a dropped model that has none of its own
    is freed at once by reference counting, not later by the garbage collector, which may run during a
    capture (`_no_gc`; `init_inference`'s model has one: its `.module` is itself). The method's function
    is held: a forward set on the instance (a MethodType over a closure, as TRL's GRPO puts on its policy)
    is referenced by nothing else once install replaces it (a `WeakMethod` would then return None)."""
    if not inspect.ismethod(method):
        return lambda: method
    func, owner = method.__func__, weakref.ref(method.__self__)

    def bound():
        obj = owner()
        return None if obj is None else types.MethodType(func, obj)

    return bound


@contextlib.contextmanager
def _no_gc():
    """The garbage collector off while inside. Freeing a dead model's CUDA graph during a capture invalidates
    the capture ("operation not permitted when stream is capturing"); freeing a MemPool aborts the process."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _pool(device: torch.device):
    """The device's graph memory pool: one MemPool per device for every runner, kept for the life of the
    process (later captures reuse a dropped model's blocks). Not one per runner: a model in a reference
    cycle of its own is freed by the garbage collector, which may run during some other capture (this
    runner's runs with gc off, torch.compile's does not), and a MemPool's destructor there aborts the
    process (torch 2.11: "captures_underway.empty() INTERNAL ASSERT FAILED", reproduced on the H200). Not a
    graph_pool_handle: the allocator frees that pool with its last graph, and a later capture into the
    same id asserts."""
    pool = _POOLS.get(device)
    if pool is None:
        pool = _POOLS[device] = torch.cuda.MemPool()
    return pool


class _Argument:
    """An output that is one of the call's argument objects (the KV cache generate passes in)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _KeptStaticCaches:
    """transformers (5.x) makes a new StaticCache for every `generate` call, so each call's decode step
    would be a new signature, captured again. Wrapping the model's `generate` and `_prepare_static_cache`,
    this keeps the cache per (implementation, batch) and hands it back reset when the next call's fits in
    it: the decode steps of later calls replay the graphs of the first. Only for calls that pass no cache
    of their own and do not return theirs (`return_dict_in_generate`), and not for encoder-decoders."""

    def __init__(self, model):
        self.model = weakref.ref(model)
        self.prepare = _weak(model._prepare_static_cache)
        self.params = inspect.signature(model._prepare_static_cache)
        self.kept: dict = {}
        self.reuse = False  # set for the length of a `generate` call that may reuse

    def generate(self, generate):
        generate, name, doc = _weak(generate), generate.__name__, generate.__doc__

        def wrapped(*args, **kwargs):
            config = kwargs.get("generation_config") or self.model().generation_config
            own = any(kwargs.get(k) is not None for k in ("cache", "past_key_values"))
            returned = kwargs.get("return_dict_in_generate", getattr(config, "return_dict_in_generate", False))
            self.reuse = not own and not returned
            try:
                return generate()(*args, **kwargs)
            finally:
                self.reuse = False
        wrapped.__name__, wrapped.__doc__ = name, doc
        return wrapped

    def prepare_static_cache(self, *args, **kwargs):
        if not self.reuse:
            return self.prepare()(*args, **kwargs)
        bound = self.params.bind(*args, **kwargs).arguments
        key = (bound.get("cache_implementation"), bound.get("batch_size"))
        length = bound.get("max_cache_len")
        kept = self.kept.get(key)
        if kept is not None and length is not None and length <= kept[0]:
            kept[1].reset()
            return kept[1]
        cache = self.prepare()(*args, **kwargs)
        self.kept = {key: (max(length or 0, kept[0] if kept else 0), cache)}  # one at a time: the cache is big
        return cache


def install(model: torch.nn.Module, device: torch.device) -> GraphedForward:
    """Replace `model.forward` by a GraphedForward (the runner, holding the original, is `model.forward.graphs`).
    A Hugging Face generation config is set to a static KV cache (when it names none) and to no
    auto-compile, so the model's own `generate` replays its decode steps; its static cache is kept from
    one `generate` call to the next (`_KeptStaticCaches`)."""
    if hasattr(model.forward, "graphs"):
        raise ValueError("init_inference: enable_cuda_graph: the model's forward is graphed already")
    runner = attach(model, runner_for(model, device))
    caches = kept_static_caches(model) if hasattr(model, "generate") else None
    if caches is not None:
        model.generate = caches.generate(model.generate)
        model._prepare_static_cache = caches.prepare_static_cache
    return runner


def runner_for(model: torch.nn.Module, device: torch.device) -> GraphedForward:
    """A GraphedForward for `model` on `device` (not put on the model: `attach`)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    needs_grad = any(p.requires_grad for p in model.parameters())
    return GraphedForward(model.forward, device, needs_grad)


def attach(model: torch.nn.Module, runner: GraphedForward) -> GraphedForward:
    """Put `runner` (with its graphs) in place of the model's own forward, which it calls from then on, and
    set a Hugging Face generation config to a static KV cache (when it names none; its `_prepare_static_cache`
    is the model's own) and to no auto-compile. `detach` undoes it."""
    if hasattr(model.forward, "graphs"):
        raise ValueError("enable_cuda_graph: the model's forward is graphed already")
    runner._forward = _weak(model.forward)
    own = model.__dict__.get("forward")  # a forward set on the instance (TRL's GRPO sets one): detach puts it back
    bound = inspect.ismethod(own) and own.__self__ is model
    runner.own_forward = None if own is None else (bound, own.__func__ if bound else own)  # no cycle if bound

    @torch.compiler.disable
    def forward(*args, **kwargs):
        return runner(*args, **kwargs)

    # what functools.wraps would copy, but not __wrapped__ (the bound forward: a reference cycle)
    forward.__signature__ = inspect.signature(model.forward)  # generate inspects it for the arguments it passes
    forward.__name__, forward.__doc__ = model.forward.__name__, model.forward.__doc__
    forward.graphs = runner
    model.forward = forward
    config = getattr(model, "generation_config", None)
    runner.restore = {}
    if config is not None:
        runner.restore = {key: getattr(config, key) for key in ("cache_implementation", "disable_compile")
                          if hasattr(config, key)}
        static = getattr(model, "_can_compile_fullgraph", None) or getattr(model, "_supports_static_cache", None)
        if getattr(config, "cache_implementation", None) is None and static:
            config.cache_implementation = "static"
            logger.info("enable_cuda_graph: generation_config.cache_implementation = 'static'")
        elif not static:
            runner._warn_once(f"{type(model).__name__} does not support a static KV cache; generate's decode "
                              f"steps will run without graphs")
        if hasattr(config, "disable_compile"):
            config.disable_compile = True  # transformers would otherwise torch.compile the graphed forward
    return runner


def detach(model: torch.nn.Module) -> GraphedForward:
    """Undo `attach`: the model's forward back (the instance's own where it had one, else the class's), the
    generation config as it was. Returns the runner."""
    runner = model.forward.graphs
    model.__dict__.pop("forward", None)
    if runner.own_forward is not None:
        bound, own = runner.own_forward
        model.forward = types.MethodType(own, model) if bound else own
        runner.own_forward = None
    for key, value in runner.restore.items():
        setattr(model.generation_config, key, value)
    runner.restore = {}
    return runner


def kept_static_caches(model: torch.nn.Module) -> _KeptStaticCaches | None:
    """The static-cache keeper for `model`'s `generate` calls (`_KeptStaticCaches`), or None where it does
    not apply (no static cache preparation, an encoder-decoder)."""
    if hasattr(model, "_prepare_static_cache") \
            and not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return _KeptStaticCaches(model)
    return None


def uninstall(model: torch.nn.Module) -> None:
    """Undo `install`: the class's forward, generate and cache preparation, the generation config as it was."""
    detach(model)
    for name in ("generate", "_prepare_static_cache"):
        model.__dict__.pop(name, None)
