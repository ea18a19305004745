"""Run by the DeepSpeed test environment's Python (see lightspeed/testing/deepspeed_env.py), not by pytest.

Usage: ``python deepspeed_sp_worker.py SPEC.json``. In one world of the spec's `world_size` processes (gloo,
DeepSpeed's CPU accelerator), sp 2 (DeepSpeed's `parallel_state_sp` groups): for each ZeRO stage of the
spec, a per-token MLP trained by SGD with an active gradient clip on its slice of each sequence, with
transformers' sequence-parallel loss (each rank backpropagates its own share, times sp at ZeRO-3:
`deepspeed_sp_compute_loss` for DeepSpeed < 0.20.2). Rank 0 writes ``{stage: [grad norm per step]}`` to
the spec's ``result`` path. `build`, `batches` and `sp_loss` are what the lightspeed side of the test runs
too (this file imports nothing of lightspeed or DeepSpeed at module level).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # worker_exit, beside this file
from worker_exit import free_port, leave  # noqa: E402

SP, SEQ, STEPS, CLIP, LR = 2, 12, 3, 0.05, 0.1


def build():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def batches(dp: int):
    """Per step, one (x, y) per data-parallel replica."""
    import torch

    gen = torch.Generator().manual_seed(1)
    return [[(torch.randn(2, SEQ, 8, generator=gen), torch.randn(2, SEQ, 8, generator=gen)) for _ in range(dp)]
            for _ in range(STEPS)]


def sp_loss(engine, x, y, sp_rank: int, sp_group, times_sp: bool):
    """transformers' rule: the token-weighted mean over the sp group, the gradient of this rank's share."""
    import torch
    import torch.distributed as dist

    mine = slice(sp_rank * SEQ // SP, (sp_rank + 1) * SEQ // SP)
    local_sum = ((engine(x[:, mine]) - y[:, mine]) ** 2).mean(-1).sum()
    count = torch.tensor(float(x.shape[0] * (SEQ // SP)))
    totals = torch.stack((local_sum.detach(), count))
    dist.all_reduce(totals, group=sp_group)
    share = local_sum * SP if times_sp else local_sum
    return (share + (totals[0] - share.detach())) / totals[1]


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "sequence_parallel_size": SP,
            "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 1000}


def _run(rank: int, spec: dict, port: int) -> None:
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    world = spec["world_size"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    mpu.initialize_sequence_parallel(SP)
    sp_group, sp_rank, dp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), rank // SP
    out = {}
    for stage in spec["stages"]:
        model = build()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                          config=config(stage), mpu=mpu)
        norms = []
        for step in batches(world // SP):
            x, y = step[dp_rank]
            engine.backward(sp_loss(engine, x, y, sp_rank, sp_group, times_sp=stage == 3))
            engine.step()
            norms.append(float(engine.get_global_grad_norm()))
        out[stage] = norms
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump(out, f)
    leave()  # every result is on disk


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    port = free_port()
    mp.spawn(_run, args=(spec, port), nprocs=spec["world_size"])
