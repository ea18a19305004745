"""What checking DeepSpeed's files against the CRC-32s torch stored in them costs a read of the checkpoint.

A synthetic ZeRO checkpoint in DeepSpeed's layout (lightspeed.testing.deepspeed_layout, as
zero_to_fp32_memory.py makes it: fp32 masters, Adam moments, bf16 module) of about `--size-gb` GB of
masters is written once; then, in this process and with the files in the page cache (each measurement
is the best of `--repeat`, so the disk is not what is measured):

  crc        integrity.verify_zip over every file: the check alone (GB/s of file bytes)
  open       DeepSpeedCheckpointSource(dir): opening, verify=False vs True (True checks the model file
             and rank 0's optimizer file, which opening reads)
  convert    convert_zero_checkpoint_to_fp32_state_dict to safetensors, verify=False vs True (True
             checks every file once, before its first use; conversion itself reads only the masters)
  read all   every parameter's master and optimizer states read through the source, as a load into
             an engine (universal.read_training_state) reads them, verify=False vs True

    python benchmarks/checkpoint_read_verify.py --size-gb 1 --workdir /tmp/crc
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="fp32 masters in the synthetic checkpoint (GB)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from benchmarks.zero_to_fp32_memory import make_checkpoint
    from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource
    from lightspeed.checkpoint.integrity import verify_zip
    from lightspeed.checkpoint.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    work = args.workdir or tempfile.mkdtemp(prefix="crc_bench_")
    ckpt = os.path.join(work, "ckpt")
    if not os.path.isdir(ckpt):
        make_checkpoint(ckpt, args.size_gb, args.world_size, args.stage)
    tag = os.path.join(ckpt, "global_step1")
    files = [os.path.join(tag, n) for n in sorted(os.listdir(tag))]
    total = sum(os.path.getsize(f) for f in files)
    for f in files:  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    crc = best(lambda: [verify_zip(f) for f in files], args.repeat)
    print(f"checkpoint: {total / 1e9:.2f} GB in {len(files)} files (stage {args.stage}, {args.world_size} ranks)")
    print(f"crc        {crc:.3f} s  ({total / crc / 1e9:.2f} GB/s)")
    def read_all(verify: bool) -> None:
        source = DeepSpeedCheckpointSource(ckpt, verify=verify)
        for name in source.param_names():
            for key in ["fp32", *source.state_keys()]:
                source.read(name, key)

    for what, run in (("open", lambda v: DeepSpeedCheckpointSource(ckpt, verify=v)), ("read all", read_all),
                      ("convert", lambda v: convert_zero_checkpoint_to_fp32_state_dict(
                          ckpt, os.path.join(work, "out"), safe_serialization=True, verify=v))):
        off = best(lambda: run(False), args.repeat)
        on = best(lambda: run(True), args.repeat)
        print(f"{what:<10} verify=False {off:.3f} s  verify=True {on:.3f} s  (+{(on - off) / off * 100:.0f}%)")
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
