"""Tensor-parallel training (DeepSpeed's AutoTP) on real gloo processes against the single-process run:
world 2 as tp2 and world 4 as tp2 x dp2, ZeRO 0 to 3 (and the optimizer offloaded at stages 2 and 3), for a tiny Hugging Face GPT-2 (fused c_attn,
Conv1D layers, the built-in plan), a tiny Llama (its config's base_model_tp_plan) and the demo GPT
(DeepSpeed's partition_config specs). Each step's loss, the first step's gradients (gathered from the tp
slices) and global norm, and the final parameters must match in fp32 within 1e-5 relative. Also: the
consolidated 16-bit save gathers whole tensors; checkpoints load at the same tp size, at another (tp2 ->
tp1 x dp2, no tp -> tp2, with a ZeRO stage change) and consolidate (zero_to_fp32, safetensors) from the
tp slices; tp_model_init before initialize, model_parameters given before the split (a generator, param groups),
a model built under zero.Init split by initialize() (its losses equal the model built whole with the same
values), and the errors (a stale optimizer, a parameter not the model's). In the tp2 x dp2
world, a save overwriting its tag fails at every point of the publisher's and of another rank's part of the
protocol: every rank then loads the old save or the new one, never a mix, and the tag verifies."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from lightspeed.testing.run_world import run_world
from tests.distributed.test_resume_anywhere import _same

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tp_rank_layout"
STEPS = 3
GLOBAL_BATCH = 4
SEQ = 8
VOCAB = 64
LR = 1e-2
CLIP = 0.5  # small enough to clip: the step depends on the global norm
DEMO_SPECS = {"layer_specs": [
    {"patterns": [r".*\.attn\.c_attn\.weight$"], "partition_type": "column", "shape": [3, -1]},
    {"patterns": [r".*\.c_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.mlp\.c_fc\.weight$"], "partition_type": "column"},
]}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=SEQ))
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from examples.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))


def _loss(model, kind: str, ids: torch.Tensor) -> torch.Tensor:
    if kind == "demo":
        return model(ids[:, :-1], ids[:, 1:])
    return model(input_ids=ids, labels=ids).loss


def _batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def reference_run(model, batches, loss_of, clip: float, lr: float):
    """One process: AdamW with clipping over `batches` (`loss_of(model, batch)`); the losses, the norms,
    the first step's gradients and the final state."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    losses, norms, grads = [], [], None
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads, {k: v.clone() for k, v in model.state_dict().items()}


def _reference(kind: str):
    return reference_run(_model(kind), _batches(), lambda model, ids: _loss(model, kind, ids), CLIP, LR)


def _config(tp: int, dp: int, stage: int, kind: str, **extra) -> dict:
    section = {"autotp_size": tp}
    if kind == "demo":
        section["partition_config"] = copy.deepcopy(DEMO_SPECS)
    # the micro batch alone: DeepSpeed's triad counts the tp ranks too (train_batch_size = micro x dp x tp)
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8,
                                                     "weight_decay": 0.01}},
           "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "tensor_parallel": section,
           "steps_per_print": 1000}
    cfg.update(extra)
    return cfg


def _gather(engine, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from this rank's tp slices (every rank of the tp group gets them)."""
    from lightspeed.comm.collectives import Communicator
    from lightspeed.parallel.tensor_parallel import gather_tp_state, tp_layouts

    topology = engine.groups.topology
    return gather_tp_state(named, tp_layouts(engine.module), Communicator(topology.group("tp"), topology.size("tp")))


def _train(kind: str, tp: int, stage: int, offload: bool = False, save_to: str | None = None):
    import torch.distributed as dist

    import lightspeed
    from lightspeed.zero.param_access import safe_get_full_grad

    world = dist.get_world_size()
    dp = world // tp
    model = _model(kind)
    extra = {}
    if offload:
        extra = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = lightspeed.initialize(model=model, config=_config(tp, dp, stage, kind, **extra))
    dp_rank = engine.groups.dp_rank
    micro = GLOBAL_BATCH // dp
    losses, norms, grads = [], [], None
    for ids in _batches():
        loss = _loss(engine, kind, ids[dp_rank * micro:(dp_rank + 1) * micro])
        engine.backward(loss)
        if grads is None:
            # cloned: at stage 0 the gradient is a view the step zeroes
            grads = _gather(engine, {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # tp ranks hold the same loss: the world mean is the dp mean
        losses.append((mean / world).item())
        norms.append(float(engine.get_global_grad_norm()))
    # the module's whole state (stage 3 gathers its partitioned parameters), then the tp slices joined
    state = _gather(engine, {k: v.detach().float().clone() for k, v in engine.strategy.module_state_dict().items()})
    if save_to is not None:
        engine.save_checkpoint(save_to, tag="end")
    return losses, norms, grads, state


def _check(result, reference):
    losses, norms, grads, state = result
    ref_losses, ref_norms, ref_grads, ref_state = reference
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert ref_norms[0] > CLIP  # the clip acted, so the norm steered the step
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    for name, value in ref_state.items():
        # AdamW moves a parameter by about lr whatever its gradient's size, so a gradient that is rounding noise
        # (GPT-2's key bias: softmax ignores it, its true gradient is 0) ends 1e-5 apart after three steps; a
        # wrong gradient would move parameters by ~lr = 1e-2, so 1e-4 absolute still catches one
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")


KINDS = ("gpt2", "llama", "demo")
# tp2 x dp2: every model at stages 0 and 3, and the other sharded stages on models that split differently
# (GPT-2's Conv1D and fused qkv, Llama's separate projections, the demo GPT's own layers), the optimizer
# offloaded at stages 2 and 3; one world for all
TP_DP_RUNS = (("gpt2", 0), ("llama", 0), ("demo", 0), ("llama", 1), ("demo", 1), ("gpt2", 2), ("llama", 2),
              ("gpt2", 3), ("llama", 3), ("demo", 3), ("gpt2", 2, True), ("llama", 3, True))


def _train_kinds(tp: int, stage: int):
    return {kind: _train(kind, tp, stage) for kind in KINDS}  # one world for the three models: fewer start-ups


def _train_runs(tp: int, runs, save_to: str):
    # the GPT-2 runs at ZeRO-0 and ZeRO-3 save their checkpoints: tp2 x dp2 slices, replicated over dp (the
    # dp ranks but 0 of each tp column write no fragments) or partitioned
    saves = {("gpt2", 0): f"{save_to}/s0", ("gpt2", 3): f"{save_to}/s3"}
    results = {run: _train(run[0], tp, *run[1:], save_to=saves.get(run)) for run in runs}
    results["faults"] = _publish_faults(tp, f"{save_to}/faults")
    return results


class _Injected(RuntimeError):
    pass


def _publish_faults(tp: int, root: str):
    """A tp x dp save overwriting its tag, failed at each point of one rank's part of the protocol (each
    file's atomic write, its manifest; on rank 0 also each step of the publish and `latest`), injected
    as an exception at the point, deterministically: rank 0 (the publisher) and the last rank in turn.
    Per trial: whether this rank's save returned, and which save `latest` then loads (1 the old, 2 the
    new, None a mix of the two or neither), with the tag verified from the save directory."""
    import torch.distributed as dist

    import lightspeed
    from lightspeed.checkpoint import atomic
    from lightspeed.checkpoint.errors import CheckpointError
    from lightspeed.checkpoint.tag_dir import resolve
    from lightspeed.checkpoint.tag_reader import verify_tag

    world, rank = dist.get_world_size(), dist.get_rank()
    engine, _, _, _ = lightspeed.initialize(model=_model("demo"), config=_config(tp, world // tp, 1, "demo"))
    micro = GLOBAL_BATCH // (world // tp)
    batches = _batches()

    def train_step(ids):
        dp_rank = engine.groups.dp_rank
        engine.backward(_loss(engine, "demo", ids[dp_rank * micro:(dp_rank + 1) * micro]))
        engine.step()

    def snapshot():
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

    events = []
    atomic._fault_hook = lambda point, path: events.append(point)
    try:
        engine.save_checkpoint(f"{root}/probe", tag="t")
    finally:
        atomic._fault_hook = None
    counts = [None] * world
    dist.all_gather_object(counts, len(events))
    trials = [(r, i) for r in (0, world - 1) for i in range(counts[r])]

    train_step(batches[0])
    old = snapshot()
    for k in range(len(trials)):
        engine.save_checkpoint(f"{root}/{k}", tag="t")
    train_step(batches[1])
    new = snapshot()
    saved = []
    for k, (faulty, at) in enumerate(trials):
        seen = [0]

        def hook(point, path, at=at):
            seen[0] += 1
            if seen[0] - 1 == at:  # once: the failure marker the writer then leaves must go through
                raise _Injected(f"injected at {point} of {path}")

        atomic._fault_hook = hook if rank == faulty else None
        try:
            engine.save_checkpoint(f"{root}/{k}", tag="t")
            saved.append(True)
        except CheckpointError:
            saved.append(False)
        finally:
            atomic._fault_hook = None
    loaded = []
    for k in range(len(trials)):
        engine.load_checkpoint(f"{root}/{k}")
        now = snapshot()
        same = [all(torch.equal(now[n], ref[n]) for n in now) for ref in (old, new)]
        problems, _ = verify_tag(resolve(f"{root}/{k}", "t"), "t") if rank == 0 else ([], [])
        loaded.append((1 if same[0] else 2 if same[1] else None, problems))
    return {"counts": counts, "trials": trials, "saved": saved, "loaded": loaded}


def test_tp2_dp2_matches_single_process(tmp_path):
    from lightspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    references = {kind: _reference(kind) for kind in KINDS}
    results = run_world(_train_runs, 4, 2, TP_DP_RUNS, str(tmp_path))
    for per_rank in results:
        for run in TP_DP_RUNS:
            _check(per_rank[run], references[run[0]])
    _check_publish_faults([per_rank["faults"] for per_rank in results])
    # zero_to_fp32 of the tp2 x dp2 ZeRO-0 and ZeRO-3 checkpoints: the trained model's whole tensors, bit for bit
    for stage in (0, 3):
        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"s{stage}"), tag="end")
        state = results[0][("gpt2", stage)][3]
        assert set(consolidated) == set(state)
        for name, value in consolidated.items():
            assert torch.equal(value, state[name]), (stage, name)


def _check_publish_faults(per_rank):
    """Every trial of `_publish_faults`: all ranks return or all raise, every rank then loads the same
    save, old or new and never a mix, and the tag verifies; the old one exactly when the save raised
    before the publish put the new tag in place."""
    first = per_rank[0]
    counts, trials = first["counts"], first["trials"]
    assert counts[0] > counts[-1] >= 9  # three points per file: its files, its manifest; rank 0 also the publish
    assert len(trials) == counts[0] + counts[-1]
    for k, trial in enumerate(trials):
        saved = {out["saved"][k] for out in per_rank}
        assert len(saved) == 1, (trial, saved)
        versions = {out["loaded"][k][0] for out in per_rank}
        assert len(versions) == 1 and None not in versions, (trial, versions)
        assert first["loaded"][k][1] == [], (trial, first["loaded"][k][1])
        if saved == {True}:
            assert versions == {2}, trial
    # rank 0's points: the old save until the publish puts the new tag in place, the new one after (its
    # files and manifest come first); a failure at any of the last rank's points keeps the old save
    on_rank0 = [out[0] for out in first["loaded"][:counts[0]]]
    switch = on_rank0.index(2)
    assert switch >= counts[-1] and on_rank0 == [1] * switch + [2] * (counts[0] - switch), on_rank0
    assert [out[0] for out in first["loaded"][counts[0]:]] == [1] * counts[-1]
    assert not any(first["saved"])  # every point raised: each trial injected one failure


@pytest.mark.parametrize("stage", [0])
def test_tp2_matches_single_process(stage):
    references = {kind: _reference(kind) for kind in KINDS}
    for results in run_world(_train_kinds, 2, 2, stage):
        for kind in KINDS:
            _check(results[kind], references[kind])


def _zero_init_against_whole() -> list[list[float]]:
    """GPT-2 (Conv1D layers, the fused c_attn) built under zero.Init, then split by initialize() at tp2 and
    ZeRO-3 (each rank receives its slices of the partitioned layers), and the same model built whole with
    the same initial values (`initialize_module_weights`, Init's rule): each one's losses."""
    import lightspeed
    from lightspeed.zero.stage3.init import initialize_module_weights

    config = _config(2, 1, 3, "gpt2")
    out = []
    for zero_init in (True, False):
        if zero_init:
            with lightspeed.zero.Init(config_dict_or_path=config, seed=7):
                model = _model("gpt2")
        else:
            model = initialize_module_weights(_model("gpt2"), 7)
        engine, *_ = lightspeed.initialize(model=model, config=config)
        losses = []
        for ids in _batches():
            loss = _loss(engine, "gpt2", ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append(losses)
    return out


def _model_parameters_follow_the_split():
    """initialize(model_parameters=...) before the split: a generator trains as the config optimizer
    over the model; param groups keep their keys and hold the split parameters of their names."""
    import lightspeed

    model = _model("gpt2")
    engine, optimizer, _, _ = lightspeed.initialize(model=model, config=_config(2, 1, 0, "gpt2"),
                                                    model_parameters=model.parameters())
    losses = []
    for ids in _batches():
        loss = _loss(engine, "gpt2", ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    model = _model("gpt2")
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    engine, optimizer, _, _ = lightspeed.initialize(
        model=model, config=_config(2, 1, 0, "gpt2"),  # stage 0 steps the model's own parameters
        model_parameters=({"params": decay, "weight_decay": 0.1}, {"params": iter(no_decay), "weight_decay": 0.0}))
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = [(g["weight_decay"], sorted(names[id(p)] for p in g["params"])) for g in optimizer.param_groups]
    c_fc = engine.module.transformer.h[0].mlp.c_fc.weight
    return losses, groups, tuple(c_fc.shape), any(p is c_fc for p in optimizer.param_groups[0]["params"])


def _errors():
    import lightspeed

    out = {}
    for name, call in (
        ("optimizer", lambda: lightspeed.initialize(
            model=(m := _model("gpt2")), optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            config={**_config(2, 1, 1, "gpt2"), "optimizer": None})),
        ("size", lambda: lightspeed.initialize(model=_model("gpt2"), config=_config(3, 1, 1, "gpt2"))),
        ("foreign", lambda: lightspeed.initialize(model=_model("gpt2"), config=_config(2, 1, 1, "gpt2"),
                                                  model_parameters=[torch.nn.Parameter(torch.zeros(3))])),
        # DeepSpeed 0.19.8's triad counts the tp ranks (no mpu): 8 = 2 x accumulation x (dp 1 x tp 2)
        ("triad", lambda: (lambda e: (e.train_batch_size(), e.gradient_accumulation_steps()))(lightspeed.initialize(
            model=_model("gpt2"), config={**_config(2, 1, 1, "gpt2"), "train_batch_size": 8,
                                          "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": None})[0])),
    ):
        try:
            out[name] = call()
            if name != "triad":
                out[name] = None
        except Exception as error:  # noqa: BLE001 (the test reads the message)
            out[name] = f"{type(error).__name__}: {error}"
    return out, _model_parameters_follow_the_split(), _zero_init_against_whole()  # one world for all


def test_errors_name_what_is_not_built():
    results = run_world(_errors, 2)
    out = results[0][0]
    assert "ConfigError" in out["optimizer"] and "stale parameters" in out["optimizer"]
    assert "ConfigError" in out["size"] and "does not divide by tp=3" in out["size"]
    assert "ConfigError" in out["foreign"] and "model_parameters[0] (shape (3,)) is not one of the model's" in \
        out["foreign"]
    assert out["triad"] == (8, 2)
    ref_losses = _reference("gpt2")[0]
    weights = sorted(n for n, _ in _model("gpt2").named_parameters() if n.endswith("weight"))
    for _, rank_out, (zero_init, whole) in results:
        assert zero_init == pytest.approx(whole, rel=1e-5) and len(whole) == STEPS  # zero.Init, split by initialize()
        losses, groups, c_fc_shape, c_fc_in_group = rank_out
        assert losses == pytest.approx(ref_losses, rel=1e-5)  # the generator's parameters are the split ones
        assert [decay for decay, _ in groups] == [0.1, 0.0] and groups[0][1] == weights
        assert c_fc_shape == (64, 32) and c_fc_in_group  # the column-parallel c_fc: [4 * 32 / 2, 32]


def _tp_model_init_then_train():
    """DeepSpeed's order (transformers'): tp_model_init, then initialize with the same autotp_size."""
    import lightspeed

    config = _config(2, 1, 0, "gpt2")
    # transformers' call: the whole ds_config, then the split model's trainable parameters to initialize
    model = lightspeed.tp_model_init(model=_model("gpt2"), tp_size=2, dtype=torch.float32, config=config)
    engine, _, _, _ = lightspeed.initialize(model=model, config=config,
                                            model_parameters=[p for p in model.parameters() if p.requires_grad])
    assert engine.module is model
    losses, norms = [], []
    for ids in _batches():
        loss = _loss(engine, "gpt2", ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def test_tp_model_init_then_initialize():
    ref_losses, ref_norms, _, _ = _reference("gpt2")
    for losses, norms in run_world(_tp_model_init_then_train, 2):
        assert losses == pytest.approx(ref_losses, rel=1e-5) and norms == pytest.approx(ref_norms, rel=1e-5)


def _continue(engine, step_ids: torch.Tensor, eval_ids: torch.Tensor) -> list[float]:
    """The loss of one more step on `step_ids` (the dp mean), then the loss on `eval_ids` after that step,
    which the optimizer's moments steer (AdamW's third step moves by m / sqrt(v), not by sign(grad))."""
    import torch.distributed as dist

    dp, rank = engine.groups.dp_world_size, engine.groups.dp_rank
    micro = GLOBAL_BATCH // dp
    loss = _loss(engine, "gpt2", step_ids[rank * micro:(rank + 1) * micro])
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # tp ranks hold the same loss: the world mean is the dp mean
    with torch.no_grad():
        after = _loss(engine, "gpt2", eval_ids).item()
    return [mean.item() / dist.get_world_size(), after]


def _snapshot(engine):
    module = {k: v.clone() for k, v in engine.strategy.module_state_dict().items()}
    masters = [f.master_view().clone() for f in engine.strategy.fragments()]
    moments = {i: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
               for i, st in engine.optimizer.state_dict()["state"].items()}
    return module, masters, moments


def _save_and_load(root: str):
    """One world of 2 for every tp checkpoint check: save at tp2 (ZeRO-1), load it back at tp2 (as saved),
    at tp1 x dp2 (ZeRO-2), save that without tp and load it at tp2 again; each continued run against the
    run that saved. And a model whose whole shapes differ is refused, unchanged."""
    import torch.distributed as dist

    import lightspeed
    from lightspeed.checkpoint.errors import CheckpointError

    def engine_for(tp, stage=1, seed_model=True, n_inner=None):
        model = _model("gpt2") if n_inner is None else transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_inner=n_inner, vocab_size=VOCAB, n_positions=SEQ))
        if not seed_model:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # another starting point, which the load must overwrite
        return lightspeed.initialize(model=model, config=_config(tp, dist.get_world_size() // tp, stage, "gpt2"))[0]

    batches = _batches()
    engine = engine_for(2)
    for ids in batches[:2]:
        engine.backward(_loss(engine, "gpt2", ids))
        engine.step()
    whole = _gather(engine, {k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    engine.save_16bit_model(root, "model.bin")
    engine.save_checkpoint(root + "/ckpt", tag="two")
    uninterrupted = _continue(engine, batches[2], batches[0])

    resumed = engine_for(2, seed_model=False)
    resumed.load_checkpoint(root + "/ckpt", tag="two")  # the same tp size: each tp rank's own files
    same_tp = _continue(resumed, batches[2], batches[0])

    plain = engine_for(1, stage=2, seed_model=False)  # world 2 as dp2: the tp slices merged, then dp-sliced
    plain.load_checkpoint(root + "/ckpt", tag="two")
    merged = _continue(plain, batches[2], batches[0])
    plain.save_checkpoint(root + "/plain", tag="three")
    plain_next = _continue(plain, batches[0], batches[1])
    split = engine_for(2, seed_model=False)  # a checkpoint without tp, cut into this tp rank's slices
    split.load_checkpoint(root + "/plain", tag="three")
    split_next = _continue(split, batches[0], batches[1])

    # ZeRO-3 with tensor parallelism: its checkpoint loads without tp at ZeRO-1, and the tp2 ZeRO-1 one at tp2 ZeRO-3
    z3 = engine_for(2, stage=3, seed_model=False)
    z3.load_checkpoint(root + "/ckpt", tag="two")
    z3.save_checkpoint(root + "/z3", tag="z3")
    z3_next = _continue(z3, batches[2], batches[0])
    from_z3 = engine_for(1, stage=1, seed_model=False)
    from_z3.load_checkpoint(root + "/z3", tag="z3")
    from_z3_next = _continue(from_z3, batches[2], batches[0])

    # the earlier layout (a tp_rank_<RR>/ checkpoint per tp rank), written by an earlier lightspeed
    fixture = str(FIXTURE / "ckpt")
    old_same = engine_for(2, seed_model=False)
    old_same.load_checkpoint(fixture, tag="two")
    old_same_next = _continue(old_same, batches[2], batches[0])
    old_merged = engine_for(1, stage=3, seed_model=False)
    old_merged.load_checkpoint(fixture, tag="two")
    old_merged_next = _continue(old_merged, batches[2], batches[0])

    other = engine_for(2, n_inner=64)  # c_fc / c_proj of another whole shape
    before = _snapshot(other)
    try:
        other.load_checkpoint(root + "/ckpt", tag="two")
        refused = None
    except CheckpointError as error:
        refused = str(error)
    unchanged = _same(before, _snapshot(other))
    saved = None
    if dist.get_rank() == 0:
        saved = torch.load(root + "/model.bin", weights_only=True)
        fresh = _model("gpt2")
        fresh.load_state_dict(saved, strict=True)  # whole tensors in the model's own (Conv1D) layout
    return (whole, saved, uninterrupted, same_tp, merged, plain_next, split_next, refused, unchanged,
            (resumed.global_steps, plain.global_steps, split.global_steps),
            (z3_next, from_z3_next, old_same_next, old_merged_next))


def test_checkpoints_load_at_another_tp_size_and_consolidate(tmp_path):
    from safetensors.torch import load_file

    from lightspeed.checkpoint.errors import CheckpointError
    from lightspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, main

    results = run_world(_save_and_load, 2, str(tmp_path))
    whole, saved = results[0][:2]
    assert set(saved) == set(whole)
    for name, value in whole.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    assert saved["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D [in, out], whole
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    for (_, _, uninterrupted, same_tp, merged, plain_next, split_next, refused, unchanged, steps, more) in results:
        z3_next, from_z3_next, old_same_next, old_merged_next = more
        assert same_tp == pytest.approx(uninterrupted, rel=1e-6)
        assert z3_next == pytest.approx(uninterrupted, rel=1e-5)  # tp2 ZeRO-1 -> tp2 ZeRO-3
        assert from_z3_next == pytest.approx(uninterrupted, rel=1e-5)  # tp2 ZeRO-3 -> tp1 x dp2 ZeRO-1
        assert old_same_next == pytest.approx(expected["next"], rel=1e-6)  # the earlier layout, at tp2
        assert old_merged_next == pytest.approx(expected["next"], rel=1e-5)  # and at tp1 x dp2, ZeRO-3
        assert merged == pytest.approx(uninterrupted, rel=1e-5)  # tp2 -> tp1 x dp2, ZeRO-1 -> ZeRO-2
        assert split_next == pytest.approx(plain_next, rel=1e-5)  # no tp, ZeRO-2 -> tp2, ZeRO-1
        assert steps == (3, 4, 4)  # the saved counters, then the steps taken since
        assert refused is not None and ".mlp.c_fc." in refused and "whole shape" in refused, refused
        assert unchanged
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "two").is_dir() and not (ckpt / "tp_rank_00").exists()  # one tag for every rank of the mesh

    # zero_to_fp32 joins the tp slices of the fp32 masters: the gathered whole model, bit for bit
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="two")
    assert set(consolidated) == set(saved)
    for name, value in saved.items():
        assert torch.equal(consolidated[name], value), name
    assert main([str(ckpt), str(tmp_path / "out"), "--safe_serialization", "-t", "two"]) == 0
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(written) == set(saved) and all(torch.equal(written[k], saved[k]) for k in saved)
    # the earlier layout consolidates from the directory holding tp_rank_<RR>/, not from one of them
    old = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURE / "ckpt"), tag="two")
    assert set(old) == set(expected["masters"]) and all(torch.equal(old[k], v) for k, v in expected["masters"].items())
    with pytest.raises(CheckpointError, match="holds only tp rank 1"):  # one tp rank's slices alone
        get_fp32_state_dict_from_zero_checkpoint(str(FIXTURE / "ckpt" / "tp_rank_01"), tag="two")
