"""Run by the DeepSpeed test environment's Python (see lightspeed/testing/deepspeed_env.py), not by pytest.

Usage: ``python deepspeed_pipeline_worker.py SPEC.json``. For each case of the spec, in one world of
`world_size` processes (gloo, DeepSpeed's CPU accelerator): build the pipeline fixtures' model
(tests/fixtures/deepspeed_pipeline/model.py) as a `deepspeed.pipe.PipelineModule` over `stages` stages,
``deepspeed.initialize`` it at the case's ZeRO stage, ``load_checkpoint`` the case's checkpoint, and
``train_batch`` the case's steps on the fixtures' data. Rank 0 writes ``{"cases": {name: {"losses": [...],
"global_steps": N}}}`` (or ``{"error": traceback}``) to the spec's ``result`` path. Imports nothing of
lightspeed: DeepSpeed's own environment runs it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # worker_exit, beside this file
from worker_exit import free_port, leave  # noqa: E402


def _worker(rank: int, spec: dict, port: int) -> None:
    world = spec["world_size"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    sys.path.insert(0, spec["fixtures"])
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    import model as M

    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for case in spec["cases"]:
        try:
            tied = case["tied"]
            torch.manual_seed(0)
            module = PipelineModule(layers=M.layer_specs(LayerSpec, TiedLayerSpec, tied), num_stages=case["stages"],
                                    loss_fn=M.loss_fn(tied), partition_method="parameters", seed_layers=True,
                                    seed_fn=M.seed_layer, base_seed=M.BASE_SEED)
            engine, _, _, _ = deepspeed.initialize(model=module, config=case["config"],
                                                   model_parameters=[p for p in module.parameters() if p.requires_grad])
            engine.load_checkpoint(case["checkpoint"])
            dp_rank = module._grid.data_parallel_id
            losses = []
            for step in case["steps"]:
                data = iter([M.batches(step, m, 2, 7, dp_rank, tied) for m in range(4)])
                losses.append(float(engine.train_batch(data_iter=data)))
            results[case["name"]] = {"losses": losses, "global_steps": engine.global_steps}
        except Exception:  # reported to the test, which shows it
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
    mp.start_processes(_worker, args=(spec, port), nprocs=spec["world_size"], start_method="spawn")


if __name__ == "__main__":
    main()
