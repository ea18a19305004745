"""How often a short two-process CPU job ends in SIGABRT after all its work ("terminate called without
an active exception"), counted over N runs through the `lightspeed` launcher. Not a CI test: it
takes N times the job's start-up (about 10-25 s a run on two busy cores).

    python benchmarks/exit_abort.py --runs 40            # this checkout
    python benchmarks/exit_abort.py --runs 40 --root DIR # another copy of the package (e.g. before a fix)

The job trains TinyMLP for a few steps with `lightspeed.initialize` and exits without destroying its
process group, as examples/train_gpt.py does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import torch, lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
lightspeed.init_distributed()
model = TinyMLP()
x, y = regression_data(64)
engine, _, loader, _ = lightspeed.initialize(model=model, training_data=torch.utils.data.TensorDataset(x, y),
    config={"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
for xb, yb in loader:
    engine.backward(engine(xb, yb))
    engine.step()
print("job done", flush=True)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="directory holding lightspeed/")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": args.root}
    aborted, failed = 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(JOB)
        for run in range(1, args.runs + 1):
            start = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "lightspeed.launcher.cli", "--num_procs", "2", str(job)],
                                  env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
            abort = "terminate called without an active exception" in proc.stderr
            aborted += abort
            failed += proc.returncode != 0
            print(f"run {run}: exit {proc.returncode}{' SIGABRT at exit' if abort else ''} "
                  f"({time.monotonic() - start:.1f} s)", flush=True)
            if proc.returncode != 0:
                print("  " + "\n  ".join(proc.stderr.strip().splitlines()[-8:]), flush=True)
    print(f"{aborted} of {args.runs} runs aborted at exit; {failed} exited non-zero")
    return 0


if __name__ == "__main__":
    sys.exit(main())
