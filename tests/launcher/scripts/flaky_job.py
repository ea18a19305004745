"""Fails (rank 1, exit 3) on the first attempt, leaving a marker file; succeeds on the next attempt.
No --local_rank option, so the launcher must not pass one. argv: OUT_DIR."""

import os
import sys

out = sys.argv[1]
marker = os.path.join(out, "failed_once")
if os.environ["RANK"] == "1" and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(3)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
total = torch.tensor([1.0])
dist.all_reduce(total)
with open(os.path.join(out, f"done{dist.get_rank()}"), "w") as f:
    f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {total.item():.0f} {sys.argv[2:]}")
dist.destroy_process_group()
