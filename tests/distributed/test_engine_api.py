"""DeepSpeed's engine API on real gloo processes: what `initialize` returns and builds, the accessors
and counters over an accumulation run, the LR schedule, the global grad norm, rank-0 logging, the
communication volume of stage 0, config errors and memory_breakdown.

Spawning a world costs more than anything checked here, so one world of 2 ranks runs every scenario
(`_api_world`) and returns plain data; the tests below assert on it.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed._utils.sizes import human_bytes
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

WORLD = 2
MICRO, GAS = 2, 3
GLOBAL_BATCH = MICRO * GAS * WORLD  # 12
STEPS = 4
NUM_SAMPLES = GLOBAL_BATCH * STEPS  # one epoch of the returned data loader = STEPS optimizer steps
WARMUP = {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3, "warmup_type": "linear"}

MAIN_CONFIG = {
    "train_batch_size": GLOBAL_BATCH,
    "train_micro_batch_size_per_gpu": MICRO,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": WARMUP},
    "gradient_clipping": 0.05,  # active (the norm is larger): get_global_grad_norm is the norm before clipping
    "steps_per_print": 2,
    "wall_clock_breakdown": True,
}


def _trainable_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _capture_rank_logs() -> io.StringIO:
    """Point lightspeed's own (rank-filtered) handler at a buffer: what this rank would print."""
    from lightspeed._utils.logging import get_logger

    root = get_logger()
    root.setLevel(logging.INFO)
    buf = io.StringIO()
    for handler in root.handlers:
        handler.setStream(buf)
    return buf


def _error_of(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the type is what is checked
        return type(err).__name__, str(err)
    return None


def _small_config(**extra) -> dict:
    cfg = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 3, "steps_per_print": 1000}
    cfg.update(extra)
    return cfg


def _one_step(engine, seed: int = 3) -> None:
    x, y = regression_data(engine.train_micro_batch_size_per_gpu() * WORLD, seed=seed)
    rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
    dtype = next(engine.module.parameters()).dtype
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(x[rank * micro:(rank + 1) * micro].to(dtype), y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()


def _main_run(config_path: str) -> dict:
    """The accumulation run: config from args.deepspeed_config, data from the returned loader."""
    out: dict = {}
    logs = _capture_rank_logs()
    x, y = regression_data(NUM_SAMPLES)
    dataset = torch.utils.data.TensorDataset(x, y, torch.arange(NUM_SAMPLES))
    model = TinyMLP()
    args = argparse.Namespace(deepspeed_config=config_path, local_rank=dist.get_rank())
    engine, optimizer, loader, scheduler = lightspeed.initialize(args=args, model=model,
                                                                 model_parameters=model.parameters(),
                                                                 training_data=dataset)
    out["types"] = (type(engine).__name__, type(optimizer).__name__, type(loader).__name__, type(scheduler).__name__)
    out["same_objects"] = (engine.optimizer is optimizer, engine.lr_scheduler is scheduler,
                           engine.training_dataloader is loader, engine.module is model)
    out["sampler"] = type(loader.sampler).__name__
    out["optimizer_lr_groups"] = [g["lr"] for g in optimizer.param_groups]
    out["accessors"] = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                        engine.gradient_accumulation_steps(), engine.zero_optimization_stage(),
                        engine.gradient_clipping())
    out["lr_at_start"] = engine.get_lr()
    out["norm_at_start"] = engine.get_global_grad_norm()
    out["bytes_after_init"] = engine.comm.stats.total_bytes()
    out["numel"] = _trainable_numel(model)
    trace = []
    for xb, yb, ib in loader:
        boundary = engine.is_gradient_accumulation_boundary()
        loss = engine(xb, yb)
        engine.backward(loss)
        bytes_after_backward = engine.comm.stats.total_bytes()
        engine.step()
        trace.append({"indices": ib.tolist(), "boundary": boundary, "loss": loss.item(),
                      "bytes_after_backward": bytes_after_backward,
                      "bytes_after_step": engine.comm.stats.total_bytes(),
                      "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                      "lr": engine.get_lr(), "grad_norm": engine.get_global_grad_norm()})
    out["trace"] = trace
    out["memory"] = engine.memory_breakdown()
    engine.eval()
    out["after_eval"] = [m.training for m in engine.module.modules()] + [engine.training]
    engine.train()
    out["after_train"] = [m.training for m in engine.module.modules()] + [engine.training]
    out["logs"] = logs.getvalue()
    return out


def _errors(config_path: str) -> dict:
    """Misuse and bad configs: every call raises the same error on every rank, before any collective."""
    out = {}
    args = argparse.Namespace(deepspeed_config=config_path)
    out["config_and_args"] = _error_of(lambda: lightspeed.initialize(args=args, model=TinyMLP(), config=_small_config()))
    out["stage7"] = _error_of(lambda: lightspeed.initialize(
        model=TinyMLP(), config=_small_config(zero_optimization={"stage": 7})))
    out["bad_triad"] = _error_of(lambda: lightspeed.initialize(
        model=TinyMLP(), config={"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,
                                 "gradient_accumulation_steps": 1}))
    out["stage2"] = _error_of(lambda: lightspeed.initialize(
        model=TinyMLP(), config=_small_config(zero_optimization={"stage": 2, "zero_quantized_gradients": True})))
    model = TinyMLP()
    out["two_optimizers"] = _error_of(lambda: lightspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config=_small_config(optimizer={"type": "Adam", "params": {"lr": 0.1}})))
    return out


def _client_objects() -> dict:
    out = {}
    # a client optimizer instance and a client lr_scheduler callable (taking the optimizer)
    model = TinyMLP()
    client_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    made = []

    def make_scheduler(opt):
        made.append(opt)
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    engine, opt, loader, sched = lightspeed.initialize(model=model, optimizer=client_opt, lr_scheduler=make_scheduler,
                                                       config=_small_config())
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    _one_step(engine)
    out["instance"] = {
        "same_optimizer": opt is client_opt and engine.optimizer is client_opt,
        "scheduler_type": type(sched).__name__, "scheduler_got_optimizer": made == [client_opt],
        "scheduler_is_engine_s": engine.lr_scheduler is sched, "loader": loader,
        "lr_after_step": engine.get_lr(),
        "changed": sorted(k for k, v in engine.module.state_dict().items() if not torch.equal(v, before[k])),
    }
    # a callable optimizer and a client scheduler instance
    model = TinyMLP()
    seen = []

    def make_optimizer(params):
        params = list(params)
        seen.append(len(params))
        return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.2)

    engine, opt, _, sched = lightspeed.initialize(model=model, model_parameters=model.parameters(),
                                                  optimizer=make_optimizer, config=_small_config())
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    _one_step(engine)
    out["callable"] = {
        "type": type(opt).__name__, "is_engine_s": engine.optimizer is opt, "lr": engine.get_lr(),
        "num_params_given": seen, "scheduler": sched,
        "changed": sorted(k for k, v in engine.module.state_dict().items() if not torch.equal(v, before[k])),
    }
    return out


def _bf16_memory() -> dict:
    model = TinyMLP()
    cfg = _small_config(bf16={"enabled": True}, optimizer={"type": "Adam", "params": {"lr": 0.01}})
    engine, _, _, _ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    _one_step(engine)
    return {"memory": engine.memory_breakdown(), "numel": _trainable_numel(model),
            "num_trainable_tensors": sum(1 for p in model.parameters() if p.requires_grad)}


def _comm_config() -> dict:
    """The ds_config's comm section reaches the group's timeout, the heartbeat and the checkpoint commit."""
    from lightspeed.comm import heartbeat

    engine, _, _, _ = lightspeed.initialize(model=TinyMLP(), config=_small_config(
        optimizer={"type": "SGD", "params": {"lr": 0.1}}, comm={"timeout_seconds": 300, "stall_seconds": 20}))
    gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
    return {"group_s": gloo.options._timeout.total_seconds(), "stall_s": heartbeat.current().stall_s,
            "commit_s": engine._checkpoint_writer.options.commit_timeout_s}


def _api_world(config_path: str) -> dict:
    torch.manual_seed(0)
    return {"rank": dist.get_rank(), "main": _main_run(config_path), "errors": _errors(config_path),
            "client": _client_objects(), "bf16": _bf16_memory(), "comm": _comm_config()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_api") / "ds_config.json"
    path.write_text(json.dumps(MAIN_CONFIG))
    return run_world(_api_world, WORLD, str(path), timeout=120)


@pytest.fixture(scope="module")
def main(world):
    return [r["main"] for r in world]


# ---------------------------------------------------------------------------------------- initialize
def test_the_configs_comm_section_sets_the_timeouts(world):
    for r in world:
        assert r["comm"] == {"group_s": 300.0, "stall_s": 20.0, "commit_s": 300.0}


def test_initialize_builds_optimizer_scheduler_and_loader_from_the_args_config_file(main):
    for m in main:
        assert m["types"][0] == "LightspeedEngine"
        assert m["types"][2] == "DataLoader" and m["sampler"] == "DistributedSampler"
        assert "adam" in m["types"][1].lower()
        assert m["types"][3] == "WarmupLR"
        assert m["same_objects"] == (True, True, True, True)
        assert m["accessors"] == (GLOBAL_BATCH, MICRO, GAS, 0, MAIN_CONFIG["gradient_clipping"])


def test_config_given_both_as_config_and_args_is_a_config_error(world):
    for r in world:
        kind, message = r["errors"]["config_and_args"]
        assert kind == "ConfigError" and "deepspeed_config" in message


def test_client_optimizer_instance_and_scheduler_callable(world):
    for r in world:
        c = r["client"]["instance"]
        assert c["same_optimizer"] and c["scheduler_got_optimizer"] and c["scheduler_is_engine_s"]
        assert c["scheduler_type"] == "StepLR" and c["loader"] is None
        assert c["lr_after_step"] == [pytest.approx(0.05)]  # StepLR stepped once, at the boundary
        assert {"fc1.weight", "fc2.weight", "norm.weight", "tiny"} <= set(c["changed"])
        assert "frozen" not in c["changed"]
    assert world[0]["client"]["instance"]["changed"] == world[1]["client"]["instance"]["changed"]


def test_callable_optimizer_gets_the_model_parameters(world):
    for r in world:
        c = r["client"]["callable"]
        assert c["type"] == "SGD" and c["is_engine_s"] and c["lr"] == [0.2] and c["scheduler"] is None
        assert c["num_params_given"] == [len(list(TinyMLP().parameters()))]
        assert {"fc1.weight", "fc2.bias", "norm.bias", "tiny"} <= set(c["changed"])


# ---------------------------------------------------------------------------------------- data loader
def test_returned_loader_gives_micro_batches_and_each_rank_its_own_samples(main):
    per_rank = []
    for m in main:
        batches = [t["indices"] for t in m["trace"]]
        assert len(batches) == STEPS * GAS
        assert all(len(b) == MICRO for b in batches)
        per_rank.append([i for b in batches for i in b])
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(NUM_SAMPLES))


# ---------------------------------------------------------------------------------------- accessors
def test_accumulation_boundary_and_counters_over_gas3(main):
    for m in main:
        trace = m["trace"]
        assert [t["boundary"] for t in trace] == [False, False, True] * STEPS
        assert [t["global_steps"] for t in trace] == [i // GAS for i in range(1, STEPS * GAS + 1)]
        assert [t["global_samples"] for t in trace] == [GLOBAL_BATCH * (i // GAS) for i in range(1, STEPS * GAS + 1)]


def test_get_lr_follows_warmup_lr(main):
    lo, hi, warm = WARMUP["warmup_min_lr"], WARMUP["warmup_max_lr"], WARMUP["warmup_num_steps"]

    def expected(steps_taken: int) -> float:
        # DeepSpeed's WarmupLR: the lr of batch n (n = steps taken - 1) is lo + (hi - lo) * n / W while n < W
        n = steps_taken - 1
        return lo if n < 0 else lo + (hi - lo) * (min(n / warm, 1.0))

    for m in main:
        assert m["lr_at_start"] == [pytest.approx(lo)]
        assert m["optimizer_lr_groups"] == [pytest.approx(lo)]
        for t in m["trace"]:
            assert t["lr"] == [pytest.approx(expected(t["global_steps"]), rel=1e-12)], t["global_steps"]
        assert m["trace"][-1]["lr"] == [pytest.approx(hi)]


def test_global_grad_norm_equals_the_single_process_norm(main):
    assert main[0]["norm_at_start"] is None
    step1 = [i for m in main for t in m["trace"][:GAS] for i in t["indices"]]
    assert len(step1) == GLOBAL_BATCH
    x, y = regression_data(NUM_SAMPLES)
    model = TinyMLP()
    model(x[step1], y[step1]).backward()
    ref = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.requires_grad]))
    for m in main:
        norm = m["trace"][GAS - 1]["grad_norm"]
        assert norm == pytest.approx(ref.item(), rel=1e-5)
        assert norm > MAIN_CONFIG["gradient_clipping"]  # so clipping was active, and the norm is from before it
        assert all(t["grad_norm"] == norm for t in m["trace"][GAS - 1:2 * GAS - 1])  # kept until the next step


def test_train_and_eval_propagate_to_the_module(main):
    for m in main:
        assert not any(m["after_eval"])
        assert all(m["after_train"])


# ---------------------------------------------------------------------------------------- logging
def test_rank0_logs_progress_and_wall_clock_breakdown_rank1_nothing(main):
    logs = main[0]["logs"]
    progress = [line for line in logs.splitlines() if re.search(r"\bstep \d+:", line)]
    assert [re.search(r"\bstep (\d+):", line).group(1) for line in progress] == ["2", "4"]
    first = progress[0]
    for token in ("loss", "lr", "loss_scale", "grad_norm", "samples/s", "ms/step"):
        assert re.search(rf"(^|\s){re.escape(token)} ", first), (token, first)
    losses = [t["loss"] for t in main[0]["trace"][:2 * GAS]]  # rank 0's micro-step losses since the start
    assert float(re.search(r"loss ([-\d.]+)", first).group(1)) == pytest.approx(sum(losses) / len(losses), abs=1e-4)
    assert re.search(r"lr \[0\.004\]", first), first  # after 2 steps: 0.001 + 0.009 * 1/3
    grad_norm = float(re.search(r"grad_norm ([\d.]+)", first).group(1))
    assert grad_norm == pytest.approx(main[0]["trace"][2 * GAS - 1]["grad_norm"], abs=1e-4)

    breakdown = [line for line in logs.splitlines() if "time per step" in line]
    assert len(breakdown) == 2
    for line in breakdown:
        for name in ("forward", "backward", "step", "comm"):
            assert re.search(rf"\b{name} \d+\.\d+", line), (name, line)
        # stage 0, fp32: one all-reduce of the gradient buffer per step, nothing else
        assert f"communication {human_bytes(4 * main[0]['numel'])} per step" in line, line
    assert main[1]["logs"] == ""


# ---------------------------------------------------------------------------------------- communication
def test_stage0_all_reduces_the_gradient_buffer_once_per_step(main):
    for m in main:
        step_bytes = 4 * m["numel"]  # fp32, one flat buffer (no padding at stage 0)
        assert m["bytes_after_init"] == 0  # the start-up broadcast is not a training step's traffic
        trace = m["trace"]
        assert trace[GAS - 1]["bytes_after_step"] == step_bytes  # after exactly one step
        previous = m["bytes_after_init"]
        for t in trace:
            sent = t["bytes_after_backward"] - previous
            assert sent == (step_bytes if t["boundary"] else 0)
            previous = t["bytes_after_step"]


# ---------------------------------------------------------------------------------------- errors
def test_bad_configs_raise_config_error_naming_the_key_on_every_rank(world):
    for r in world:
        errors = r["errors"]
        kind, message = errors["stage7"]
        assert kind == "ConfigError" and "zero_optimization.stage" in message and "7" in message
        kind, message = errors["bad_triad"]
        assert kind == "ConfigError" and "train_batch_size" in message and "world_size 2" in message
        kind, message = errors["two_optimizers"]
        assert kind == "ConfigError" and "optimizer" in message


def test_unimplemented_stage_raises_not_implemented_naming_it(world):
    for r in world:
        kind, message = r["errors"]["stage2"]
        assert kind == "NotImplementedError" and "zero_optimization.zero_quantized_gradients" in message


# ---------------------------------------------------------------------------------------- memory
def test_memory_breakdown_matches_the_model_size(main, world):
    for m in main:
        n = m["numel"]
        mem = m["memory"]
        assert set(mem) == {"cpu"}
        cats = mem["cpu"]
        assert set(cats) == {"lp_params", "grads", "optimizer_state"}  # fp32: the params are the master
        assert cats["lp_params"] == 4 * n and cats["grads"] == 4 * n
        # Adam: exp_avg and exp_avg_sq in fp32, plus at most a 4-byte step counter per tensor
        assert 8 * n <= cats["optimizer_state"] <= 8 * n + 8 * 7
    for r in world:
        b = r["bf16"]
        n, cats = b["numel"], b["memory"]["cpu"]
        assert set(cats) == {"lp_params", "master_params", "grads", "optimizer_state"}
        assert cats["lp_params"] == 2 * n and cats["master_params"] == 4 * n
        assert 2 * n <= cats["grads"] <= 6 * n  # bf16 accumulation, plus the fp32 copy the optimizer reads
        assert 8 * n <= cats["optimizer_state"] <= 8 * n + 8 * b["num_trainable_tensors"]
