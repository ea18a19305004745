"""AutoEP in one process: `grouped_mlp` against its loop definition (values and gradients, experts with no
rows, no rows at all; with per-expert biases and GPT-OSS's clamped interleaved SwiGLU on uneven loads,
through the CPU path, ops/grouped_gemm's reference and Triton (interpreted) paths, against a per-expert
loop written out here), `ClampedSwiGLU` bit-equal to GPT-OSS's own, the `expert_parallel` section's keys
and defaults (DeepSpeed's `parse_autoep_config`), detection (by model_type, by preset_model, the pattern
overrides, nothing found; GPT-OSS by its model_type, experts whose biases the preset does not name
refused), the refused keys, and `initialize()` at autoep_size 1 (every expert local, logits equal to the
unwrapped model's, one training step's loss and gradients as the unwrapped model's: Qwen2-MoE, and
GPT-OSS with random expert biases and a clamp that bites, grouped and looped); a GPT-OSS built under
zero.Init through initialize() at ZeRO-3 as the whole-built one, and meta experts with no values refused."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

import lightspeed
from lightspeed.config import load
from lightspeed.config.errors import ConfigError
from lightspeed.config.expert_parallel import ExpertParallelConfig
from lightspeed.parallel.experts.autoep import detect_moe_blocks
from lightspeed.parallel.experts.autoep_layer import EPExperts
from lightspeed.parallel.experts.grouped_mlp import ClampedSwiGLU, grouped_kernel, grouped_mlp, grouped_mlp_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # tests/conftest.py sets it without CUDA


def _weights(experts=3, hidden=5, inter=4):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(experts, 2 * inter, hidden, generator=gen, requires_grad=True),
            torch.randn(experts, hidden, inter, generator=gen, requires_grad=True))


@pytest.mark.parametrize("counts", [[3, 0, 2], [0, 0, 4], [1, 1, 1], [0, 0, 0]])
def test_grouped_mlp_matches_the_loop(counts):
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    results = []
    # the GPU's path through ops/grouped_gemm (here its reference backend): the same layout, read transposed
    through_ops = functools.partial(grouped_kernel, backend="reference")
    for fn in (grouped_mlp, through_ops, grouped_mlp_reference):
        w1, w2 = _weights()
        out = fn(x, counts, w1, w2, F.silu)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad.clone(), w1.grad, w2.grad))
        x.grad = None
    for other in results[:2]:  # fp32, summed in another order than the loop's: fp32's tolerance
        for got, want in zip(other, results[2]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the definition: expert e's rows through its own gated MLP
    w1, w2 = _weights()
    if int(counts.sum()):
        e = int(torch.nonzero(counts)[0])
        start = int(counts[:e].sum())
        gate, up = (x[start:start + 1] @ w1[e].T).chunk(2, -1)
        torch.testing.assert_close(grouped_mlp(x, counts, w1, w2, F.silu)[start:start + 1],
                                   (F.silu(gate) * up) @ w2[e].T)


def test_grouped_mlp_refuses_mismatched_shapes():
    w1, w2 = _weights()
    with pytest.raises(ValueError, match="number of experts"):
        grouped_mlp(torch.zeros(2, 5), torch.tensor([1, 1]), w1, w2, F.silu)
    with pytest.raises(ValueError, match=r"b_down must be \[E, out\]"):
        grouped_mlp(torch.zeros(2, 5), torch.tensor([1, 1, 0]), w1, w2, F.silu, None, torch.zeros(3, 4))


def _biased_loop(x, counts, w1t, b1, w2t, b2, glu):
    """GPT-OSS's layout written out: expert e's rows times w1t[e] [H, 2I] plus b1[e], gated, times w2t[e]."""
    out, start = torch.zeros(x.shape[0], w2t.shape[-1]), 0
    for e, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        out[rows] = glu(x[rows] @ w1t[e] + b1[e]) @ w2t[e] + b2[e]
        start += n
    return out


@pytest.mark.parametrize("counts", [[4, 0, 1, 6, 2], [0, 0, 0, 7, 0], [0, 0, 0, 0, 0]])
def test_biased_grouped_mlp_matches_a_per_expert_loop(counts):
    counts, hidden, inter = torch.tensor(counts), 6, 5
    glu = ClampedSwiGLU(1.702, 0.5)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(int(counts.sum()), hidden, generator=gen, requires_grad=True)
    params = [torch.randn(5, hidden, 2 * inter, generator=gen), torch.randn(5, 2 * inter, generator=gen),
              torch.randn(5, inter, hidden, generator=gen), torch.randn(5, hidden, generator=gen)]
    dout = torch.randn(x.shape[0], hidden, generator=gen)
    paths = {"loop": lambda *a: _biased_loop(*a, glu),
             "cpu": lambda x, c, w1, b1, w2, b2: grouped_mlp(x, c, w1.transpose(1, 2), w2.transpose(1, 2), glu, b1, b2),
             "reference": lambda x, c, w1, b1, w2, b2: grouped_mlp_reference(x, c, w1.transpose(1, 2),
                                                                              w2.transpose(1, 2), glu, b1, b2),
             "ops_reference": lambda x, c, w1, b1, w2, b2: grouped_kernel(x, c, w1.transpose(1, 2), w2.transpose(1, 2),
                                                                          glu, "reference", b1, b2)}
    if INTERPRET:
        paths["triton"] = lambda x, c, w1, b1, w2, b2: grouped_kernel(x, c, w1.transpose(1, 2), w2.transpose(1, 2),
                                                                      glu, "triton", b1, b2)
    results = {}
    for name, fn in paths.items():
        leaves = [p.clone().requires_grad_() for p in params]
        out = fn(x, counts, leaves[0], leaves[1], leaves[2], leaves[3])
        (out * dout).sum().backward()
        results[name] = [out.detach(), x.grad.clone()] + [p.grad for p in leaves]
        x.grad = None
    want = results.pop("loop")
    if counts.sum():
        assert (x @ params[0][3] + params[1][3]).abs().max() > 0.5  # the clamp bites
        assert want[3][1].abs().sum() == 0 and want[3][3].abs().sum() > 0  # expert 1 has no rows, 3 has
    for name, got in results.items():
        for what, g, w in zip(("out", "dx", "dw1", "db1", "dw2", "db2"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {what}: {m}")


def test_clamped_swiglu_is_gpt_oss_own():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    h = 3 * torch.randn(7, 10, generator=torch.Generator().manual_seed(5))
    model = GptOssExperts.__new__(GptOssExperts)  # _apply_gate reads only alpha and limit
    model.alpha, model.limit = 1.702, 1.5
    assert (h.abs() > 1.5).any()
    assert torch.equal(ClampedSwiGLU(1.702, 1.5)(h), GptOssExperts._apply_gate(model, h))


def test_section_defaults_are_deepspeeds():
    section = ExpertParallelConfig()
    assert (section.enabled, section.autoep_size, section.expert_tensor_parallel_size, section.preset_model,
            section.use_grouped_mm, section.route_scale, section.score_apply, section.combine_impl,
            section.score_func, section.top_k, section.routed_scaling_factor, section.expert_w3_given) == \
        (False, 1, 1, None, True, 1.0, "auto", "auto", "auto", "auto", "auto", False)
    with pytest.raises(ConfigError, match="expert_parallel.score_func"):
        load({"train_batch_size": 1, "expert_parallel": {"score_func": "tanh"}}, world_size=1)
    with pytest.raises(ConfigError, match="expert_parallel.experts_pattern"):
        load({"train_batch_size": 1, "expert_parallel": {"experts_pattern": "experts"}}, world_size=1)


def _tiny(kind="mixtral"):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=16, initializer_range=0.2)
    if kind == "gpt_oss":  # random expert biases (the model initialises them to zero), a clamp that bites; the
        # model's experts run its eager per-expert loop (its grouped_mm one needs 16-byte strides on the CPU)
        model = tf.GptOssForCausalLM(tf.GptOssConfig(intermediate_size=6, num_local_experts=4, num_experts_per_tok=2,
                                                     head_dim=4, sliding_window=4, swiglu_limit=0.4,
                                                     experts_implementation="eager",
                                                     **{**common, "num_attention_heads": 4, "num_key_value_heads": 2}))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0.0, 0.3)
        return model
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                                                      **common))
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(intermediate_size=8, moe_intermediate_size=8,
                                                    shared_expert_intermediate_size=8, num_experts=4,
                                                    num_experts_per_tok=2, decoder_sparse_step=1, **common))


def test_detection():
    section = ExpertParallelConfig(enabled=True)
    blocks = detect_moe_blocks(_tiny("qwen2"), section)
    assert [(b.name, b.preset_name, b.num_experts) for b in blocks] == \
        [("model.layers.0.mlp", "qwen3_moe", 4), ("model.layers.1.mlp", "qwen3_moe", 4)]
    only_first = ExpertParallelConfig(enabled=True, preset_model="mixtral", moe_layer_pattern=r"model\.layers\.0\.mlp")
    assert [b.name for b in detect_moe_blocks(_tiny(), only_first)] == ["model.layers.0.mlp"]
    base = _tiny().model  # a bare base model: names without the "model." prefix
    assert [b.name for b in detect_moe_blocks(base, section)] == ["layers.0.mlp", "layers.1.mlp"]
    with pytest.raises(ConfigError, match="expert_parallel.enabled: no MoE block"):
        detect_moe_blocks(_tiny(), ExpertParallelConfig(enabled=True, router_pattern="router"))
    with pytest.raises(ConfigError, match="expert_parallel.has_shared_experts"):
        detect_moe_blocks(_tiny(), ExpertParallelConfig(enabled=True, has_shared_experts=True,
                                                        shared_experts_pattern="shared_expert"))
    gpt_oss = _tiny("gpt_oss")
    assert [(b.name, b.preset_name, b.num_experts) for b in detect_moe_blocks(gpt_oss, section)] == \
        [("model.layers.0.mlp", "gpt_oss", 4), ("model.layers.1.mlp", "gpt_oss", 4)]
    # a preset without biases, pointed at GPT-OSS's block: its biases are named in the refusal
    with pytest.raises(NotImplementedError, match="down_proj_bias, gate_up_proj_bias; it names down_proj, "):
        detect_moe_blocks(gpt_oss, ExpertParallelConfig(enabled=True, preset_model="mixtral", router_pattern="router"))


CFG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.mark.parametrize("extra,error,match", [
    ({"autoep_size": 2}, ConfigError, "expert_parallel.autoep_size=2"),
    ({"preset_model": "gpt"}, ConfigError, "expert_parallel.preset_model='gpt'"),
    ({"top_k": 3}, NotImplementedError, "expert_parallel.top_k=3"),
    ({"expert_tensor_parallel_size": 2}, NotImplementedError, "expert_parallel.expert_tensor_parallel_size=2"),
    ({"load_balance_coeff": 0.001}, NotImplementedError, "expert_parallel.load_balance_coeff"),
    # DeepSpeed 0.19.8's AutoEP implementation switches
    ({"comm_backend": "deepep"}, NotImplementedError, "expert_parallel.comm_backend='deepep'"),
    ({"gate_up_impl": "fused"}, NotImplementedError, "expert_parallel.gate_up_impl='fused'"),
    ({"expert_activation": "silu"}, NotImplementedError, "expert_parallel.expert_activation='silu'"),
    ({"combine_impl": "fused_weighted_sum"}, NotImplementedError, "expert_parallel.combine_impl"),
])
def test_refusals_name_the_key(extra, error, match):
    config = {**CFG, "expert_parallel": {"enabled": True, **extra}}
    with pytest.raises(error, match=match):
        lightspeed.initialize(model=_tiny(), config=config, dist_init_required=False)


def test_unknown_model_names_enabled():
    with pytest.raises(ConfigError, match="expert_parallel.enabled"):
        lightspeed.initialize(model=torch.nn.Linear(2, 2), config={**CFG, "expert_parallel": {"enabled": True}},
                              dist_init_required=False)


@pytest.mark.parametrize("kind,grouped", [("qwen2", True), ("gpt_oss", True), ("gpt_oss", False)])
def test_autoep_size_one_is_the_unwrapped_model(kind, grouped):
    ref = _tiny(kind)
    engine, *_ = lightspeed.initialize(model=_tiny(kind), dist_init_required=False, config={
        **CFG, "expert_parallel": {"enabled": True, "autoep_size": 1, "use_grouped_mm": grouped}})
    swapped = [n for n, m in engine.module.named_modules() if isinstance(m, EPExperts)]
    assert swapped == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert set(engine.module.state_dict()) == set(ref.state_dict())
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(3))
    want = ref(input_ids=ids, labels=ids)
    got = engine(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    want.loss.backward()
    engine.backward(got.loss)
    grads = dict(ref.named_parameters())
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_zero_init_built_experts_at_autoep_size_one():
    """GPT-OSS (transposed weights and biases: four parameters per experts group) built under zero.Init in
    one process, its expert biases written through GatheredParameters, equals the whole-built model with
    the same initial values through initialize() at ZeRO-3 (zero/stage3/init_rows.py at a world of one)."""
    from lightspeed.zero.stage3 import GatheredParameters, Init, initialize_module_weights

    with Init(seed=5):
        built = _tiny("gpt_oss")  # its bias randomization ran on empty placeholders: written below
    assert all(p.numel() == 0 for p in built.parameters())
    ref = initialize_module_weights(_tiny("gpt_oss"), 5)
    gen = torch.Generator().manual_seed(4)
    for (name, p), q in zip(built.named_parameters(), ref.parameters()):
        if name.endswith("_bias"):
            with torch.no_grad(), GatheredParameters([p], modifier_rank=0):
                q.copy_(torch.randn(q.shape, generator=gen) * 0.3)
                p.copy_(q)
    engine, *_ = lightspeed.initialize(model=built, dist_init_required=False, config={
        **CFG, "zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": True, "autoep_size": 1}})
    experts = {n: m for n, m in engine.module.named_modules() if isinstance(m, EPExperts)}
    assert list(experts) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    shapes = dict(ref.named_parameters())
    for name, m in experts.items():
        for pname, p in m.named_parameters():
            assert p.ds_shape == shapes[f"{name}.{pname}"].shape  # autoep_size 1: every expert
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_meta_experts_without_values_are_refused():
    with lightspeed.OnDevice(dtype=torch.float32, device="meta"):
        model = _tiny()
    with pytest.raises(NotImplementedError, match="expert_parallel.enabled: the experts of model.layers.0.mlp are "
                                                  "on the meta device with no values"):
        lightspeed.initialize(model=model, dist_init_required=False, config={
            **CFG, "zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": True}})


@pytest.mark.parametrize("kind", ["gpt_oss", "mixtral"])
def test_experts_sliced_over_tp_sum_to_the_whole(kind):
    """expert_tensor_parallel_size: the two tp ranks' slices (GPT-OSS: interleaved gate/up columns and
    biases, transposed weights; Mixtral: gate and up halves) are the placements' boxes of the whole
    experts, a whole state dict loads as them, and their partial MLP outputs, summed, plus the down bias
    once, are the whole experts' output; the boxes a rank of a model built under zero.Init receives
    (`_wanted`, at ep 2) are its slices too."""
    from lightspeed.comm.collectives import Communicator
    from lightspeed.parallel.experts.autoep import EXPERT_ACTIVATIONS, PRESETS

    preset = PRESETS[kind]
    source = _tiny(kind).model.layers[0].mlp.experts
    args = (source, (preset.w1, preset.w2), 4, 0, 1, EXPERT_ACTIVATIONS[preset.activation]("block", source))
    kw = dict(use_grouped_mm=False, bias_names=(preset.b1, preset.b2), transposed=preset.transposed)
    whole = EPExperts(*args, **kw)
    gen = torch.Generator().manual_seed(3)
    x, counts = torch.randn(10, 8, generator=gen), torch.tensor([3, 0, 4, 3])
    total = 0
    for rank in range(2):
        comm = Communicator(None, 2)
        comm.rank = rank  # slicing only: no collective runs here
        part = EPExperts(*args, tp_comm=comm, **kw)
        for name in part.param_names:
            placement, full, local = part.tp_placement(name, rank), getattr(whole, name), getattr(part, name)
            torch.testing.assert_close(local, full if placement is None else placement.slice_of(full), rtol=0, atol=0)
        with torch.no_grad():
            for p in part.parameters():
                p.zero_()
        part.load_state_dict(whole.state_dict())  # whole over tp: this rank's units kept
        b1, b2 = part._biases()
        total = total + grouped_mlp_reference(x, counts, *part._weights(), part.activation, b1, None)
    if b2 is not None:
        total = total + b2.repeat_interleave(counts, dim=0)
    torch.testing.assert_close(total, whole._mlp(x, counts), rtol=1e-5, atol=1e-6)
    # experts partitioned by zero.Init: the boxes each (ep rank, tp rank) receives are its slices
    from lightspeed.parallel.experts.autoep import _wanted

    block = detect_moe_blocks(_tiny(kind), ExpertParallelConfig(enabled=True))[0]
    for ep_rank, tp_rank in ((0, 0), (1, 1)):
        comm = Communicator(None, 2)
        comm.rank = tp_rank
        sliced = EPExperts(source, (preset.w1, preset.w2), 4, ep_rank, 2, args[5], tp_comm=comm, **kw)
        for name, boxes in _wanted(block, source, ep_rank, 2, (tp_rank, 2), args[5]).items():
            dim = next((d for d in range(len(boxes[0])) if len({b[d] for b in boxes}) > 1), 0)
            got = torch.cat([getattr(source, name).detach()[tuple(slice(a, b) for a, b in box)] for box in boxes], dim)
            torch.testing.assert_close(got, getattr(sliced, name).detach(), rtol=0, atol=0)
    if kind == "gpt_oss":  # tp rank 1 holds units 3..5: gate_up columns 6..11, interleaved as saved
        assert part.tp_placement("gate_up_proj", 1).boxes == (((0, 4), (0, 8), (6, 12)),)
    else:
        assert part.tp_placement("gate_up_proj", 1).boxes == (((0, 4), (4, 8), (0, 8)), ((0, 4), (12, 16), (0, 8)))
