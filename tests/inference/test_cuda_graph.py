"""init_inference(enable_cuda_graph=True) (lightspeed/inference/cuda_graph.py): the model's forward replayed
from graphs, one per input signature. On the CPU the graphs are tests/inference/fake_cuda_graph.py's
stand-ins (capture records aten ops without leaving effects, replay re-runs them without Python); on a GPU
they are real. Every graphed result is compared with the same model run eagerly."""
from __future__ import annotations

import copy
import gc
import inspect
import types
import weakref

import pytest
import torch

from lightspeed.inference import cuda_graph, init_inference
from tests.inference.fake_cuda_graph import FakeGraph, fake_graph, use_fake_graphs

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, ids, **kw):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits)


@pytest.fixture
def fake(monkeypatch):
    use_fake_graphs(monkeypatch)


# --- the stand-in itself: what the tests below rely on ---

def test_fake_graph_capture_has_no_effect_and_replay_runs_no_python():
    seen = []
    counter, x = torch.zeros(()), torch.arange(3.0)
    graph = FakeGraph()
    with fake_graph(graph):
        seen.append(1)
        counter.add_(1)
        y = x * 2
    assert counter.item() == 0 and seen == [1]  # the capture computed nothing on tensors that existed
    x.copy_(torch.tensor([5.0, 6.0, 7.0]))
    graph.replay()
    graph.replay()
    assert counter.item() == 2 and seen == [1]
    assert torch.equal(y, torch.tensor([10.0, 12.0, 14.0]))
    with pytest.raises(RuntimeError, match="capturing"), fake_graph(FakeGraph()):
        counter.item()


# --- the model's own generate ---

@pytest.mark.parametrize("quant", [None, "fp6"])
def test_generate_replays_decode_steps_and_matches_eager(fake, quant):
    """The decode step's first call runs eagerly, the second is captured, the rest replay; tokens and
    every step's logits equal the eager model's with the same (static) cache."""
    model = _llama()
    kwargs = {"quant": {"weight": quant}} if quant else {}
    init_inference(model, dtype=torch.float32, device="cpu", **kwargs)
    graphed = copy.deepcopy(model)
    runner = cuda_graph.install(graphed, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    want_ids, want_logits = _generate(model, ids, cache_implementation="static")
    got_ids, got_logits = _generate(graphed, ids)  # install made the static cache the default
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_logits, want_logits)
    assert runner.captures == 1 and not runner.eager
    (entry,) = runner.graphs.values()
    assert entry.graph.replays == 7  # 9 tokens: the prefill's, then 8 decode steps: 1 eager, 7 from the graph
    got_ids, _ = _generate(graphed, ids)  # a second call (a new cache object): graphs again
    assert torch.equal(got_ids, want_ids) and runner.captures == 2


def test_generate_keeps_its_static_cache_between_calls(fake):
    """Later generate calls get the first call's cache back, reset, so their decode steps replay the
    first call's graph (and a prompt length seen again is captured too); a longer call gets a new cache;
    a call returning its cache never shares it."""
    model = _llama()
    eager = copy.deepcopy(model)
    runner = cuda_graph.install(model, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)

    def tokens(m, ids, n, **kw):
        return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, **kw)

    # captures: the decode step; + the prefill (same cache, prompt length seen again); none (a shorter call
    # fits the cache); a new cache's decode step; its prefill (the shorter call reuses it)
    for n, captures in ((6, 1), (6, 2), (4, 2), (9, 3), (6, 4)):
        ids = torch.randint(0, VOCAB, (2, 5), generator=gen)
        assert torch.equal(tokens(model, ids, n), tokens(eager, ids, n, cache_implementation="static"))
        assert runner.captures == captures, n
    out = tokens(model, ids, 6, return_dict_in_generate=True)
    kept = out.cache if "cache" in out else out.past_key_values
    before = [layer.keys.clone() for layer in kept.layers]
    tokens(model, ids, 6)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, kept.layers))  # not reset, not written
    cuda_graph.uninstall(model)
    assert "forward" not in vars(model) and "generate" not in vars(model)
    assert model.generation_config.cache_implementation is None


def test_generate_with_a_dynamic_cache_runs_eagerly_with_a_warning(fake, ls_caplog):
    model = _llama()
    graphed = copy.deepcopy(model)
    runner = cuda_graph.install(graphed, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    want_ids, want_logits = _generate(model, ids)
    got_ids, got_logits = _generate(graphed, ids, cache_implementation="dynamic")
    assert torch.equal(got_ids, want_ids) and torch.equal(got_logits, want_logits)
    assert not runner.graphs
    if runner.captures:  # transformers >= 5.2x: the step's signature repeats, and the capture is refused
        assert len(runner.eager) == 1 and "the forward changes cache.layers[0].keys" in ls_caplog.text


def _sliding(family: str, window: int):
    """A small Mistral (every layer a sliding window) or Gemma 2 (sliding and full layers alternating)."""
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, sliding_window=window)
    if family == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(head_dim=16, **common)).eval()
    return transformers.MistralForCausalLM(transformers.MistralConfig(**common)).eval()


def _cache_of(out):
    return out.get("cache", out.get("past_key_values"))  # transformers >= 5.2x / before


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@pytest.mark.parametrize("window", [64, 8])
def test_sliding_window_layers_replay_while_the_window_has_room(fake, ls_caplog, family, window):
    """A sliding-window layer counts its tokens in a Python int, which the runner advances after each replay.
    Window 64: every decode step after the warm-up replays. Window 8 (5 prompt + 9 new tokens): the steps
    replay until the window is full, then run eagerly (a warning), and the next generate call (the kept
    cache, reset) replays again. Tokens, every step's logits and the layers' counts equal eager generate's
    with a static cache."""
    model = _sliding(family, window)
    eager = copy.deepcopy(model)
    runner = cuda_graph.install(model, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)

    def run(m, ids, **kw):
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kw)
        return out.sequences, torch.stack(out.logits), [getattr(x, "cumulative_length_int", None)
                                                        for x in _cache_of(out).layers]

    ids = torch.randint(0, VOCAB, (2, 5), generator=gen)
    want_ids, want_logits, want_counts = run(eager, ids, cache_implementation="static")
    got_ids, got_logits, got_counts = run(model, ids)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_logits, want_logits)
    assert got_counts == want_counts and want_counts[0] == 13
    (entry,) = runner.graphs.values()
    assert runner.captures == 1 and entry.graph.replays == (7 if window == 64 else 2)  # the capture's own too
    assert ("window is full" in ls_caplog.text) == (window == 8)
    # the kept cache: its decode step is captured at the first call, its prompt at the second (when the
    # prompt's attention mask is made inside the forward from a layer's count, as for this Mistral at
    # window 64, the prompt runs eagerly from then on)
    for captures in (2, 3, 3):
        ids = torch.randint(0, VOCAB, (2, 5), generator=gen)
        want = eager.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                              pad_token_id=0, cache_implementation="static")
        assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9,
                                          do_sample=False, pad_token_id=0), want)
        assert runner.captures == captures
    assert len(runner.graphs) + len(runner.eager) == 2
    assert all("calls a sliding-window cache layer's get_seq_length()" in why for why in runner.eager.values())
    (step,) = [e for e in runner.graphs.values() if e.inputs[0][1].shape == (2, 1)]
    assert step.graph.replays == (7 + 8 + 8 if window == 64 else 2 + 3 + 3)  # later calls: every step with room


def test_a_forward_reading_a_window_count_runs_eagerly(fake, ls_caplog):
    """Called without position_ids, the model makes them from the cache's get_seq_length(): a sliding-window
    layer's Python count, which a graph would keep. Such calls run eagerly, with a warning."""
    model = _sliding("mistral", 64)
    eager = copy.deepcopy(model)
    runner = cuda_graph.install(model, torch.device("cpu"))
    caches = [transformers.StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    with torch.no_grad():
        for _ in range(4):
            ids = torch.randint(0, VOCAB, (1, 1))
            got = model(ids, past_key_values=caches[0]).logits
            assert torch.equal(got, eager(ids, past_key_values=caches[1]).logits)
    assert runner.captures == 1 and not runner.graphs and list(runner.eager)
    assert "calls a sliding-window cache layer's get_seq_length()" in ls_caplog.text
    assert caches[0].layers[0].cumulative_length_int == 4 and set(vars(caches[0].layers[0])) == set(
        vars(caches[1].layers[0]))  # the watch is gone


def test_install_keeps_the_signature_and_sets_the_generation_config():
    model = _llama()
    before = inspect.signature(model.forward)
    cuda_graph.install(model, torch.device("cpu"))
    assert inspect.signature(model.forward) == before  # generate inspects it for the arguments it passes
    assert model.generation_config.cache_implementation == "static"
    assert model.generation_config.disable_compile is True
    with pytest.raises(ValueError, match="graphed already"):
        cuda_graph.install(model, torch.device("cpu"))


def test_a_forward_set_on_the_instance_keeps_running_after_install_and_comes_back(fake):
    """TRL's GRPO sets `model.forward = MethodType(closure, model)`: once install replaces it, nothing else
    holds that closure, and the runner (eager or capturing) must still call it; uninstall puts it back."""
    model = _Scale()
    original = model.forward

    def patched(self, x, state=None):
        return {k: v * 2 for k, v in original(x, state).items()}

    model.forward = types.MethodType(patched, model)
    del patched
    runner = cuda_graph.install(model, torch.device("cpu"))
    x = torch.randn(3, 5)
    for _ in range(3):
        assert torch.equal(model(x)["y"], 2 * x * model.w)
    assert runner.captures == 1
    runner.device = torch.device("meta")  # the eager path calls it too
    assert torch.equal(model(x)["y"], 2 * x * model.w)
    cuda_graph.uninstall(model)  # the instance's forward is back, not the class's
    assert not hasattr(model.forward, "graphs") and torch.equal(model(x)["y"], 2 * x * model.w)


def test_a_model_without_static_cache_support_keeps_its_cache(ls_caplog):
    class NoStatic(transformers.LlamaForCausalLM):
        _can_compile_fullgraph = False
        _supports_static_cache = False

    model = NoStatic(_llama().config).eval()
    cuda_graph.install(model, torch.device("cpu"))
    assert model.generation_config.cache_implementation is None
    assert "NoStatic does not support a static KV cache" in ls_caplog.text


# --- direct calls ---

class _Scale(torch.nn.Module):
    """forward(x, state): x * w + state.shift, and state.calls += 1 when state.count is set."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5), requires_grad=False)

    def forward(self, x, state=None):
        y = x * self.w
        if state is not None:
            y = y + state.shift
            if state.count:
                state.calls += 1  # Python state: a graph cannot replay it
                state.device_calls.add_(1)
        return {"y": y, "sum": y.sum()}


class _State:
    def __init__(self, count=False):
        self.shift = torch.randn(5)
        self.count, self.calls, self.device_calls = count, 0, torch.zeros(())


def test_direct_calls_copy_inputs_and_outputs(fake):
    model = _Scale()
    runner = cuda_graph.install(model, torch.device("cpu"))
    xs = [torch.randn(3, 5) for _ in range(4)]
    outs = [model(x) for x in xs]
    assert runner.captures == 1
    for x, out in zip(xs, outs):  # each call's inputs went in; earlier outputs were not overwritten
        assert torch.equal(out["y"], x * model.w) and torch.equal(out["sum"], (x * model.w).sum())
    model(torch.randn(2, 5))  # another shape: another graph
    model(torch.randn(2, 5))
    assert runner.captures == 2 and len(runner.graphs) == 2


def test_a_new_object_returned_each_call_runs_eagerly(fake, ls_caplog):
    """A causal LM called without a cache makes a new DynamicCache each call and returns it: a graph
    would return the captured one again, so such calls run eagerly; use_cache=False graphs them."""
    model = _llama()
    eager = copy.deepcopy(model)
    runner = cuda_graph.install(model, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        for use_cache in (True, False):
            for _ in range(3):
                ids = torch.randint(0, VOCAB, (2, 6))
                out = model(ids, use_cache=use_cache)
                assert torch.equal(out.logits, eager(ids, use_cache=use_cache).logits)
            cache = out.get("cache", out.get("past_key_values"))  # transformers >= 5.2x / before
            assert (cache is not None) == use_cache
    assert runner.captures == 2 and len(runner.graphs) == 1 and len(runner.eager) == 1
    assert "returns a new DynamicCache each call" in ls_caplog.text


def test_python_state_changed_by_the_forward_runs_eagerly(fake, ls_caplog):
    """Capture and one replay make one call: the Python counter and the device counter stay equal."""
    model = _Scale()
    runner = cuda_graph.install(model, torch.device("cpu"))
    state = _State(count=True)
    for i in range(5):
        x = torch.randn(4, 5)
        assert torch.equal(model(x, state)["y"], x * model.w + state.shift)
        assert state.calls == i + 1 and state.device_calls.item() == i + 1
    assert runner.captures == 1 and not runner.graphs and list(runner.eager) and "args[1].calls" in ls_caplog.text


def test_argument_tensors_replaced_between_calls_are_captured_again(fake):
    model = _Scale()
    runner = cuda_graph.install(model, torch.device("cpu"))
    state, x = _State(), torch.randn(4, 5)
    model(x, state=state)
    model(x, state=state)
    state.shift = torch.randn(5)  # a new tensor: the graph read the old one's memory
    assert torch.equal(model(x, state=state)["y"], x * model.w + state.shift)
    state.shift.mul_(2)  # in place: the graph reads it
    assert torch.equal(model(x, state=state)["y"], x * model.w + state.shift)
    assert runner.captures == 2


def test_dead_argument_objects_are_forgotten_and_graphs_are_bounded(fake, monkeypatch, ls_caplog):
    model = _Scale()
    runner = cuda_graph.install(model, torch.device("cpu"))
    monkeypatch.setattr(cuda_graph, "MAX_GRAPHS", 2)
    x, states = torch.randn(4, 5), [_State(), _State()]
    for state in states:
        model(x, state=state)
        model(x, state=state)
    assert len(runner.graphs) == 2  # the graphs hold their argument objects weakly
    del states, state
    gc.collect()
    model(torch.randn(1, 5))  # a first call: dead entries are swept
    assert len(runner.graphs) == 0
    for n in (2, 3, 4):
        model(torch.randn(n, 5))
        model(torch.randn(n, 5))
    assert len(runner.graphs) == 2 and "more than 2 input signatures" in ls_caplog.text


def test_a_dropped_model_is_freed_at_once_and_captures_run_without_the_garbage_collector(fake):
    """The runner and the wrappers install puts on the model hold no reference back to it, so a dropped
    model (graphs, cache and all) is freed by reference counting. A collection during a capture would free
    other dead models' graphs inside it, which invalidates a CUDA capture: captures run with gc off."""
    enabled = []

    def probe(module, args):
        if torch.cuda.is_current_stream_capturing():
            enabled.append(gc.isenabled())

    model = _llama()
    model.model.layers[0].register_forward_pre_hook(probe)
    runner = cuda_graph.install(model, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (2, 5))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert runner.captures == 2 and enabled == [False, False] and gc.isenabled()
    refs = [weakref.ref(x) for x in (model, runner, model._prepare_static_cache.__self__)]
    gc.disable()
    try:
        del model, runner
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


def test_autograd_or_other_devices_run_eagerly(fake, ls_caplog):
    model = _Scale()
    model.w.requires_grad_(True)
    runner = cuda_graph.install(model, torch.device("cpu"))
    x = torch.randn(3, 5)
    for _ in range(3):
        model(x)["sum"].backward()
    assert runner.captures == 0 and "autograd is recording" in ls_caplog.text
    with torch.no_grad():
        model(x)
        model(x)
    assert runner.captures == 1
    runner.device = torch.device("cuda", 0)
    with torch.no_grad():
        model(x)
    assert "not on cuda:0" in ls_caplog.text
    runner.device = torch.device("meta")  # a runner off CUDA captures nothing
    with torch.no_grad():
        model(x)
        model(x)
    assert runner.captures == 1 and "meta is not a CUDA device" in ls_caplog.text


# --- real graphs ---

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.parametrize("quant", [None, "fp6", "int4"])
def test_cuda_generate_matches_eager(quant):
    """Against generate with the same static cache, eager (disable_compile: transformers would otherwise
    compile the forward for a static cache on a GPU). cuBLAS may pick other algorithms inside a capture,
    so fp16 logits agree to rounding, not bit for bit."""
    model = _llama()
    kwargs = {"quant": {"weight": quant}} if quant else {}
    eager = init_inference(copy.deepcopy(model), dtype=torch.float16, **kwargs)
    graphed = init_inference(model, dtype=torch.float16, enable_cuda_graph=True, **kwargs)
    runner = graphed.forward.graphs
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(3)).cuda()
    want_ids, want_logits = _generate(eager, ids, cache_implementation="static", disable_compile=True)
    got_ids, got_logits = _generate(graphed, ids)
    assert runner.captures == 1 and not runner.eager and len(runner.graphs) == 1
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-3)


@gpu
@pytest.mark.parametrize("window", [64, 8])
def test_cuda_sliding_window_generate_matches_eager(window, monkeypatch):
    replays, outputs = [], cuda_graph.GraphedForward._outputs
    monkeypatch.setattr(cuda_graph.GraphedForward, "_outputs",
                        staticmethod(lambda entry, leaves: replays.append(1) or outputs(entry, leaves)))
    model = _sliding("mistral", window)
    eager = init_inference(copy.deepcopy(model), dtype=torch.float16, quant={"weight": "fp6"})
    graphed = init_inference(model, dtype=torch.float16, quant={"weight": "fp6"}, enable_cuda_graph=True)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3)).cuda()
    want_ids, want_logits = _generate(eager, ids, cache_implementation="static", disable_compile=True)
    got_ids, got_logits = _generate(graphed, ids)
    runner = graphed.forward.graphs
    assert len(replays) == (7 if window == 64 else 2) and len(runner.graphs) == 1 and not runner.eager
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-3)


@gpu
def test_cuda_direct_calls_match_eager():
    model = _llama()
    eager = init_inference(copy.deepcopy(model), dtype=torch.float16, quant={"weight": "fp6"})
    graphed = init_inference(model, dtype=torch.float16, quant={"weight": "fp6"}, enable_cuda_graph=True)
    with torch.no_grad():
        for seed in range(4):
            ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed)).cuda()
            got = graphed(ids, use_cache=False).logits
            torch.testing.assert_close(got, eager(ids, use_cache=False).logits, rtol=0, atol=2e-3)
    assert graphed.forward.graphs.captures == 1
