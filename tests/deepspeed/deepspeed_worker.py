"""Run by the DeepSpeed test environment's Python (see lightspeed/testing/deepspeed_env.py), not by pytest.

Usage: ``python deepspeed_worker.py SPEC.json``. For each case of the spec, in one world of `world_size`
processes (gloo, DeepSpeed's CPU accelerator): build TinyMLP, ``deepspeed.initialize`` it with the case's
config, ``load_checkpoint`` the case's checkpoint, check that every trainable parameter's fp32 master and
Adam moments equal the expected ones (exactly), train the case's steps (each rank its micro-batches,
DeepSpeed averages), and ``save_checkpoint`` to the case's output directory. Rank 0 writes
``{"cases": {name: {"losses": [[per micro-batch, rank-major] per step], "global_steps": N}}}`` to the
spec's ``result`` path. Imports nothing of lightspeed (TinyMLP is loaded from its file): DeepSpeed's
own environment runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # worker_exit, beside this file
from worker_exit import free_port, leave  # noqa: E402


def _models(path: str):
    spec = importlib.util.spec_from_file_location("ls_testing_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _full_state(engine, stage: int, dtype: str):
    """{name: {"fp32": master, "exp_avg": ..., "exp_avg_sq": ...}} as the live engine holds them."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if stage > 0 and getattr(engine.optimizer, "_hp_optimizer_states_linked", None) is not None:
        engine.optimizer._hp_optimizer_states_linked = False  # link the loaded moments to the parameters
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        entry = {}
        if stage == 0:
            opt = engine.optimizer
            if dtype == "fp32":
                master, state = p, opt.state.get(p, {})
            else:
                flat = [q for g in opt.fp16_groups for q in g]
                master = [q for g in opt.fp32_groups for q in g][next(i for i, q in enumerate(flat) if q is p)]
                state = opt.optimizer.state.get(master, {})
            entry["fp32"] = master.detach().float().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = state[key].detach().float().clone()
        else:
            entry["fp32"] = safe_get_full_fp32_param(p).detach().float().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(p, key)
                entry[key] = None if value is None else value.detach().float().clone()
        out[name] = entry
    return out


def _run_case(case: dict, rank: int, world: int, models) -> dict:
    import deepspeed
    import torch

    model = models.TinyMLP()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=case["config"])
    path, _ = engine.load_checkpoint(case["checkpoint"])
    if path is None:
        raise RuntimeError(f"{case['checkpoint']}: DeepSpeed loaded nothing")
    stage, dtype = case["config"]["zero_optimization"]["stage"], case["dtype"]
    expected = torch.load(case["expected"], weights_only=True)
    got = _full_state(engine, stage, dtype)
    for name, want in expected.items():
        for key, value in want.items():
            have = got[name][key]
            if have is None or not torch.equal(have, value):
                diff = None if have is None else float((have - value).abs().max())
                raise AssertionError(f"{case['name']}: {name} {key} after load differs from the checkpoint "
                                     f"(max abs diff {diff})")
    if engine.global_steps != case["global_steps"]:
        raise AssertionError(f"{case['name']}: global_steps {engine.global_steps}, want {case['global_steps']}")
    data = torch.load(case["batches"], weights_only=True)  # {"x": [step][micro][...], "y": ...}
    per_rank = len(data["x"][0]) // world
    lowp = torch.float32 if dtype == "fp32" else torch.bfloat16
    losses = []
    for step in case["steps"]:
        mine = []
        for i in range(rank * per_rank, (rank + 1) * per_rank):
            loss = engine(data["x"][step][i].to(lowp), data["y"][step][i])
            engine.backward(loss)
            engine.step()
            mine.append(float(loss.detach().float()))
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, mine)
        losses.append([x for part in gathered for x in part])
    engine.save_checkpoint(case["output"])
    return {"losses": losses, "global_steps": engine.global_steps}


def _worker(rank: int, world: int, port: int, spec: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    models = _models(spec["models"])
    results = {}
    for case in spec["cases"]:
        try:
            results[case["name"]] = _run_case(case, rank, world, models)
        except Exception:
            results[case["name"]] = {"error": traceback.format_exc()}
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump({"cases": results}, f)
    leave()  # every result is on disk


def main() -> None:
    import torch.multiprocessing as mp

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    port = free_port()
    mp.start_processes(_worker, args=(spec["world_size"], port, spec), nprocs=spec["world_size"],
                       start_method="spawn")


if __name__ == "__main__":
    main()
