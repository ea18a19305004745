"""A tiny job: all-reduce the ranks over gloo and write what this rank saw to OUT/rank<R>.json."""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)  # declared: the launcher passes it
parser.add_argument("--out", required=True)
args = parser.parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
        "LIGHTSPEED_ACCELERATOR", "OMP_NUM_THREADS", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "FROM_ENV_FILE")
seen = {key: os.environ.get(key) for key in keys}
seen.update(sum=total.item(), local_rank_arg=args.local_rank, cores=sorted(os.sched_getaffinity(0)))
with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(seen, f)
print(f"rank {dist.get_rank()} done", flush=True)
dist.destroy_process_group()
