"""DeepSpeed's own unit tests run against lightspeed: the figure of how much unchanged DeepSpeed code
relies on works. Not a CI test: it needs a DeepSpeed source checkout (none of its code is vendored here)
and takes minutes.

    git clone --branch v0.18.2 https://github.com/deepspeedai/DeepSpeed /tmp/DeepSpeed
    python benchmarks/deepspeed_unit_tests.py /tmp/DeepSpeed            # the files in FILES
    python benchmarks/deepspeed_unit_tests.py /tmp/DeepSpeed unit/runtime/zero/test_zero_config.py

Each file runs in its own pytest process (cwd: the checkout's tests/, so its conftest and `unit.common`
apply), as a user gets lightspeed: a `sitecustomize` that calls `lightspeed.register_as_deepspeed()` in
every process (also DeepSpeed's spawned test ranks), DS_ACCELERATOR=cpu (gloo), and a per-test timeout so
that nothing hangs. DeepSpeed pins pytest < 8.4; the pytest of the running interpreter is used. Reports
per file, and in all, the tests passed, failed, errored and skipped, and the fraction of those that ran
(passed + failed + errored) which passed; a file that cannot be imported counts as an error.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The CPU-runnable selection: runtime (config, initialize, LR schedules, precision configs, no_sync,
# fp16/bf16), ZeRO (config, Init context, leaf modules, tensor fragments, gradient clipping, partition
# cache / unwrap for generation), checkpoints and ops/adam. Paths relative to the checkout's tests/.
FILES = [
    "unit/pipe/test_pipe_module.py",
    "unit/runtime/pipe/test_topology.py",
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_ds_config_model.py",
    "unit/runtime/test_ds_initialize.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/runtime/test_no_sync_ctxt.py",
    "unit/runtime/test_runtime_utils.py",
    "unit/runtime/half_precision/test_fp16.py",
    "unit/runtime/half_precision/test_dynamic_loss_scale.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_leaf_module.py",
    "unit/runtime/zero/test_zero_tensor_fragment.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/checkpoint/test_other_optimizer.py",
    "unit/checkpoint/test_lr_scheduler.py",
    "unit/ops/adam/test_adamw.py",
]

SITECUSTOMIZE = "import lightspeed\nlightspeed.register_as_deepspeed()\n"


def run_file(tests_dir: Path, rel: str, site_dir: str, timeout: int, out_dir: Path,
             file_timeout: int) -> dict[str, int]:
    """Run one test file; returns its counts (passed, failed, errors, skipped)."""
    xml = out_dir / (rel.replace("/", "_") + ".xml")
    # LOCAL_SIZE: how many devices DeepSpeed's CPU accelerator (and lightspeed's) reports; its harness skips a
    # test whose world needs more, so without it every multi-rank test skips on a CPU machine
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE=os.environ.get("LOCAL_SIZE", "4"), PYTHONPATH=os.pathsep.join(
        p for p in (site_dir, str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={timeout}",
           f"--junitxml={xml}", rel]
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    # its own session, so that a hung file (DeepSpeed's pool workers outliving a test) is killed whole
    proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=file_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"{rel}: killed after {file_timeout} s", file=sys.stderr)
    if not xml.exists():
        counts["errors"] = 1
        return counts
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if "error" in kinds:
            counts["errors"] += 1
        elif "failure" in kinds:
            counts["failed"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    if not any(counts.values()) and proc.returncode not in (0, 5):
        counts["errors"] = 1  # collection failed without a test case in the report
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("deepspeed", type=Path, help="a DeepSpeed source checkout (holding tests/unit)")
    parser.add_argument("files", nargs="*", help="test files relative to its tests/ (default: FILES)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--keep", type=Path, help="directory to keep the JUnit XML reports in")
    parser.add_argument("--file-timeout", type=int, default=1800,
                        help="seconds per file; a file still running then is killed and counts as one error")
    args = parser.parse_args()
    tests_dir = args.deepspeed / "tests"
    if not (tests_dir / "unit").is_dir():
        sys.exit(f"{args.deepspeed}: no tests/unit directory (pass a DeepSpeed source checkout)")
    total = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    with tempfile.TemporaryDirectory() as site_dir, tempfile.TemporaryDirectory() as tmp:
        Path(site_dir, "sitecustomize.py").write_text(SITECUSTOMIZE)
        out_dir = args.keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for rel in args.files or FILES:
            counts = run_file(tests_dir, rel, site_dir, args.timeout, out_dir, args.file_timeout)
            for k, v in counts.items():
                total[k] += v
            print(f"{rel:60s} " + " ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    ran = total["passed"] + total["failed"] + total["errors"]
    print("total: " + " ".join(f"{k} {v}" for k, v in total.items())
          + (f"; passed / ran = {total['passed'] / ran:.2f}" if ran else ""))


if __name__ == "__main__":
    main()
