"""`hybrid_engine.enable_cuda_graph` (lightspeed/hybrid/graphs.py) in one process: the config's accept / refuse
rules, generate with the option on giving token for token what it gives with the option off (stage 0 and
ZeRO-3, DeepSpeed-Chat LoRA fused, training steps between the calls), the runner on the model only for the
length of a generate call (also when it raises), and when graphs are dropped (`module_state` / `stale`).
On the CPU the runner runs every call eagerly (`eager`); with tests/inference/fake_cuda_graph.py's
stand-ins it captures and replays on the CPU (`fake`: the replay counts are checked); on a GPU the last
test runs real graphs."""

from __future__ import annotations

import logging

import pytest
import torch

import lightspeed
from lightspeed.config import ConfigError, load
from lightspeed.hybrid.graphs import module_state, stale
from lightspeed.inference import cuda_graph
from lightspeed.testing.lora import LinearLayer_LoRA
from lightspeed.zero.stage3 import options as stage3_options
from tests.inference.fake_cuda_graph import use_fake_graphs

pytestmark = pytest.mark.timeout(120)

transformers = pytest.importorskip("transformers")

from tests.distributed.test_hybrid_engine import GEN, config, dschat_lora, tiny_opt  # noqa: E402

BASE = {"train_batch_size": 2}


def _init(model, cfg):
    engine, *_ = lightspeed.initialize(model=model, config=cfg, dist_init_required=False)
    return engine


def _rounds(engine, rounds: int = 2) -> list:
    """`rounds` x (a training step, then a greedy generate), and a last generate with its scores (it returns
    its cache: a new one, captured anew)."""
    prompt = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(3)).to(engine.device)
    out = []
    for i in range(rounds):
        x = torch.randint(4, 96, (2, 8), generator=torch.Generator().manual_seed(i)).to(engine.device)
        engine.train()
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        engine.eval()
        out.append(engine.generate(prompt, **GEN))
    scores = engine.generate(prompt, output_scores=True, return_dict_in_generate=True, **GEN)
    return out + [scores.sequences, torch.stack(scores.scores)]


# ------------------------------------------------------------------ config
def test_config_accepts_whole_weights_and_refuses_unpinned_stage3():
    for stage, pin in ((0, False), (2, False), (3, True)):
        cfg = load({**BASE, "zero_optimization": {"stage": stage},
                    "hybrid_engine": {"enabled": True, "enable_cuda_graph": True, "pin_parameters": pin}}, world_size=1)
        assert cfg.hybrid_engine.enable_cuda_graph is True
    with pytest.raises(ConfigError, match=r"^hybrid_engine.enable_cuda_graph: needs hybrid_engine.pin_parameters "
                                          r"true at zero_optimization.stage 3"):
        load({**BASE, "zero_optimization": {"stage": 3},
              "hybrid_engine": {"enabled": True, "enable_cuda_graph": True, "pin_parameters": False}}, world_size=1)
    # DeepSpeed reads the section only when the engine is enabled
    load({**BASE, "zero_optimization": {"stage": 3},
          "hybrid_engine": {"enable_cuda_graph": True, "pin_parameters": False}}, world_size=1)


# ------------------------------------------------------------------ generate

def _stand_in_graphs(monkeypatch):
    """The stand-in graphs replace torch.cuda's API, which a model on the GPU needs: off CUDA only (the CUDA
    tests below replay real graphs)."""
    if torch.cuda.is_available():
        pytest.skip("stand-in CUDA graphs run off CUDA; test_cuda_* replay real graphs")
    use_fake_graphs(monkeypatch)

@pytest.mark.parametrize("stage", [0, 3])
def test_generate_matches_the_option_off(stage, monkeypatch):
    """At stage 3 with the gather and release around every generate (the one-rank views off), as at any
    larger world: where the gathered storage lands at another address, the graphs are dropped and captured
    again. The option on, eagerly (the
    CPU) and replaying the stand-in graphs: the tokens of the option off, and the replays' scores are the
    eager static-cache forward's, bit for bit."""
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", False)
    want = _rounds(_init(dschat_lora(tiny_opt()), config(1, stage)))
    eager = _init(dschat_lora(tiny_opt()), config(1, stage, enable_cuda_graph=True))
    eager_on = _rounds(eager)
    if eager.device.type == "cuda":  # real graphs: the option off's tokens (the stand-ins replace torch.cuda's API)
        assert eager._decode_graphs.runner.replays > 0
        for a, b in zip(eager_on[:-1], want[:-1]):
            assert torch.equal(a, b)
        return
    assert eager._decode_graphs.runner.captures == eager._decode_graphs.runner.replays == 0  # eager off CUDA
    _stand_in_graphs(monkeypatch)
    engine = _init(dschat_lora(tiny_opt()), config(1, stage, enable_cuda_graph=True))
    got = _rounds(engine)
    for a, b, c in zip(got[:-1], want[:-1], eager_on[:-1]):
        assert torch.equal(a, b) and torch.equal(c, b)
    assert torch.equal(got[-1], eager_on[-1])  # the scores of the last call
    graphs = engine._decode_graphs
    # 6 tokens a call: the prefill (eager) and 5 decode steps; the first call's first decode step is the
    # warm-up, its second the capture; every later one replays, also in later calls (the kept cache); the
    # last call (a cache of its own) captures again
    assert 2 <= graphs.runner.captures <= 2 + graphs.drops and not graphs.runner.eager
    assert len(graphs.runner.graphs) <= 1  # the last call's graph is not kept, the kept cache's may be
    if stage == 0:  # the weights never move
        assert graphs.drops == 0 and graphs.runner.captures == 2 and graphs.runner.replays == 3 + 5 + 3
        assert len(graphs.runner.graphs) == 1


def _state_on_model(model, seen):
    def hook(module, args):
        seen.append(("forward" in vars(model), model.generation_config.cache_implementation))
    return model.model.decoder.layers[0].register_forward_pre_hook(hook)


def _off_the_model(engine):
    model = engine.module
    assert not {"forward", "_prefill", "_prepare_static_cache"} & set(vars(model))
    assert model.forward.__func__ is type(model).forward
    assert model.generation_config.cache_implementation is None and not model.generation_config.disable_compile
    assert not engine._decode_graphs.runner.paused
    assert not any(m.fuse_lora for m in model.modules() if isinstance(m, LinearLayer_LoRA))
    assert all(g.state == "released" for g in engine.strategy.groups)


def test_the_runner_is_on_the_model_only_inside_generate(monkeypatch):
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", False)
    _stand_in_graphs(monkeypatch)
    engine = _init(dschat_lora(tiny_opt()), config(1, 3, enable_cuda_graph=True))
    engine.eval()
    prompt = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(3)).to(engine.device)
    seen: list = []
    handle = _state_on_model(engine.module, seen)
    engine.generate(prompt, **GEN)
    assert seen and set(seen) == {(True, "static")}
    _off_the_model(engine)
    seen.clear()
    with torch.no_grad():
        engine(input_ids=prompt)  # training's forward: the model's own
    assert seen == [(False, None)]
    handle.remove()

    calls = []

    def fail_on(which):
        def hook(module, args):
            calls.append(1)
            if len(calls) == which:
                raise RuntimeError("inside generate")
        return engine.module.model.decoder.layers[0].register_forward_pre_hook(hook)

    handle = fail_on(2)  # the first decode step (the warm-up: eager)
    with pytest.raises(RuntimeError, match="^inside generate$"):
        engine.generate(prompt, **GEN)
    _off_the_model(engine)
    handle.remove()
    calls.clear()
    handle = fail_on(3)  # inside the capture: named with the config key
    with pytest.raises(RuntimeError, match=r"^hybrid_engine.enable_cuda_graph: OPTForCausalLM's decode step could "
                                           r"not be captured in a CUDA graph \(inside generate\); set "
                                           r"hybrid_engine.enable_cuda_graph false"):
        engine.generate(prompt, **GEN)
    _off_the_model(engine)
    handle.remove()
    out = engine.generate(prompt, **GEN)  # and generates again
    assert torch.equal(out, engine.generate(prompt, **GEN))


def test_release_inference_cache_drops_graphs_and_cache_after_every_call(monkeypatch):
    _stand_in_graphs(monkeypatch)
    engine = _init(tiny_opt(), config(1, 0, enable_cuda_graph=True, release_inference_cache=True))
    engine.eval()
    prompt = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(3)).to(engine.device)
    for _ in range(2):
        engine.generate(prompt, **GEN)
        graphs = engine._decode_graphs
        assert not graphs.runner.graphs and graphs.caches.kept == {}
    assert graphs.runner.captures == 2 and graphs.runner.replays == 2 * 3
    engine.destroy()


def test_a_peft_model_and_a_callers_own_cache(monkeypatch, ls_caplog):
    """A PEFT model's generate runs its base model's: the runner goes there. A caller's own cache choice
    wins: a dynamic cache runs eagerly, said once."""
    pytest.importorskip("peft")
    from tests.distributed.test_hybrid_engine import peft_lora

    _stand_in_graphs(monkeypatch)
    off = _init(peft_lora(tiny_opt()), config(1, 0))
    engine = _init(peft_lora(tiny_opt()), config(1, 0, enable_cuda_graph=True))
    prompt = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(3)).to(engine.device)
    for e in (off, engine):
        e.eval()
    want = off.generate(prompt, **GEN)
    for _ in range(2):
        assert torch.equal(engine.generate(prompt, **GEN), want)
    runner = engine._decode_graphs.runner
    assert runner.captures == 1 and runner.replays == 3 + 5
    assert "forward" not in vars(engine.module.get_base_model())
    assert torch.equal(engine.generate(prompt, cache_implementation="dynamic", **GEN), want)
    assert runner.captures == 2 and runner.replays == 3 + 5  # captured once, found not replayable: eager
    assert "generate with a static cache" in ls_caplog.text


# ------------------------------------------------------------------ when graphs are dropped
def test_stale_names_what_a_graph_cannot_replay_over():
    model = dschat_lora(tiny_opt()).eval()
    lora = model.model.decoder.layers[0].self_attn.q_proj
    before = module_state(model)
    assert stale(None, before) is None and stale(before, module_state(model)) is None
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # values changed in place: the graph reads them
    assert stale(before, module_state(model)) is None
    old = lora.weight.data
    lora.weight.data = old.clone()
    where = "model.decoder.layers.0.self_attn.q_proj"
    assert stale(before, module_state(model)) == f"{where}.weight (moved to other storage)"
    lora.weight.data = old
    lora.fuse_lora_weight()
    assert stale(before, module_state(model)) == f"{where}.fuse_lora (changed)"
    lora.unfuse_lora_weight()
    lora.weight.data = old
    assert stale(before, module_state(model)) is None
    model.train()
    assert stale(before, module_state(model)) == "model (replaced or switched between train and eval)"
    model.eval()
    handle = lora.register_forward_hook(lambda *a: None)
    assert stale(before, module_state(model)) == f"{where}._forward_hooks (changed)"
    handle.remove()
    model.model.decoder.layers[1].fc1 = torch.nn.Linear(32, 64)
    assert stale(before, module_state(model)).startswith("model.decoder.layers.1.fc1 (replaced")


def test_moved_weights_drop_the_graphs_at_the_next_call(monkeypatch, ls_caplog):
    ls_caplog.set_level(logging.INFO, logger="lightspeed")
    _stand_in_graphs(monkeypatch)
    engine = _init(tiny_opt(), config(1, 0, enable_cuda_graph=True))
    engine.eval()
    prompt = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(3)).to(engine.device)
    first = engine.generate(prompt, **GEN)
    graphs = engine._decode_graphs
    assert graphs.runner.captures == 1 and graphs.drops == 0
    weight = engine.module.model.decoder.layers[1].fc1.weight
    kept = weight.data
    weight.data = kept.clone()  # the old storage alive: another address
    assert torch.equal(engine.generate(prompt, **GEN), first)
    assert graphs.drops == 1 and graphs.runner.captures == 2
    assert "model.decoder.layers.1.fc1.weight (moved to other storage) since the last generate call" in ls_caplog.text
    assert torch.equal(engine.generate(prompt, **GEN), first)
    assert graphs.drops == 1 and graphs.runner.captures == 2


def make_inputs_require_grads(module, args, output):
    """A hook of this test's own under transformers' hook's name: it does not pass for it."""


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(enable|disable)` is deprecated:FutureWarning")
@pytest.mark.parametrize("stage", [0, 2])
def test_trl_gradient_checkpointing_toggles_keep_the_graphs(stage, monkeypatch, ls_caplog):
    """TRL's GRPO step: checkpointing off around generate, on after, off and on again around the log-prob
    pass, then the training step. Each `gradient_checkpointing_enable` adds a `make_inputs_require_grads`
    hook to the embeddings (none removed): the graphs survive (Note: [gradient-checkpointing hooks]), the
    tokens are the option off's; another hook, even one of that name from elsewhere, drops them."""
    ls_caplog.set_level(logging.INFO, logger="lightspeed")
    _stand_in_graphs(monkeypatch)
    prompt = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    tokens, engines = [], []
    for on in (False, True):
        engine = _init(tiny_opt(), config(1, stage, enable_cuda_graph=on))
        model = engine.module
        model.gradient_checkpointing_enable()  # Trainer's, before the first step
        out = []
        for i in range(3):
            model.gradient_checkpointing_disable()
            engine.eval()
            out.append(engine.generate(prompt.to(engine.device), **GEN))
            model.gradient_checkpointing_enable()
            model.gradient_checkpointing_disable()  # the log-prob pass
            model.gradient_checkpointing_enable()
            engine.train()
            x = torch.randint(4, 96, (2, 8), generator=torch.Generator().manual_seed(i)).to(engine.device)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        tokens.append(out)
        engines.append(engine)
    for a, b in zip(*tokens):
        assert torch.equal(a, b)
    model, graphs = engines[1].module, engines[1]._decode_graphs
    embed = model.get_input_embeddings()
    assert len(embed._forward_hooks) == 1 + 2 * 3  # transformers' hooks piled up, none removed
    # one capture (the first call's second decode step), every later decode step replayed
    assert graphs.drops == 0 and graphs.runner.captures == 1 and graphs.runner.replays == 3 + 5 + 5
    for hook, drops in ((lambda module, args, output: None, 1), (make_inputs_require_grads, 2)):
        handle = embed.register_forward_hook(hook)
        engines[1].eval()
        assert torch.equal(engines[1].generate(prompt, **GEN), engines[0].generate(prompt, **GEN))
        assert graphs.drops == drops
        handle.remove()
    assert "model.decoder.embed_tokens._forward_hooks (changed) since the last generate call" in ls_caplog.text
    for engine in engines:
        engine.destroy()


# ------------------------------------------------------------------ real graphs
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("views", [True, False], ids=["stage3", "stage3-gathered"])
def test_cuda_stage3_replays_and_matches_eager_across_training(views, monkeypatch):
    """Against the same engine and static cache run eagerly (the runner kept from capturing): the tokens, and
    the scores to rounding (cuBLAS may pick other algorithms inside a capture). `stage3-gathered`: the
    weights gathered and released around every call, maybe at other addresses (the graphs then dropped)."""
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", views)
    engine = _init(dschat_lora(tiny_opt()), config(1, 3, enable_cuda_graph=True))
    assert engine.device.type == "cuda", engine.device
    with monkeypatch.context() as eager_only:
        eager_only.setattr(cuda_graph, "GRAPH_DEVICE_TYPES", frozenset())
        want = _rounds(_init(dschat_lora(tiny_opt()), config(1, 3, enable_cuda_graph=True)), rounds=4)
    got = _rounds(engine, rounds=4)
    for a, b in zip(got[:-1], want[:-1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[-1], want[-1], rtol=0, atol=1e-4)
    runner, graphs = engine._decode_graphs.runner, engine._decode_graphs
    assert 2 <= runner.captures <= 2 + graphs.drops and not runner.eager
    assert runner.replays >= 3 * 5  # every call replays at least the 3 steps after a capture
    if views:  # the weights never move: one capture, every decode step of later calls replayed
        assert graphs.drops == 0 and runner.captures == 2 and runner.replays == 3 + 5 * 3 + 3
    # each call captured afresh (release_inference_cache): the same tokens
    fresh = _rounds(_init(dschat_lora(tiny_opt()), config(1, 3, enable_cuda_graph=True, release_inference_cache=True)),
                    rounds=4)
    for a, b in zip(got[:-1], fresh[:-1]):
        assert torch.equal(a, b)
