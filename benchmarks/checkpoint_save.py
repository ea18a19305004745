"""Engine checkpoint saves: the cost of checksums, and the training stall of a synchronous save
against a background (`checkpoint.writer.decoupled`) one, measured in the same run.

Claims:
  1. Recording checksums costs at most 5% of a save: each rank reads the CRC-32s torch already
     computed into the zip's central directory (checkpoint/integrity.py's Note). Measured as the
     save time with checksums against the same save with the checksum step replaced by a size-only
     entry. For reference the table also shows what hashing every tensor ourselves would add
     (xxh3_64 over the state's bytes, when `xxhash` is installed) and the save through a Python file
     object (the writer before this one).
  2. A background save holds training only while it queues the host snapshot's copies: its stall
     is at most 0.10x a synchronous save's (and DeepSpeed's, with `--deepspeed`), first save
     included when the snapshot pool is allocated at start-up (`checkpoint.writer.snapshot_pool:
     startup`). The stall of a save is the time from the save_checkpoint call until it has returned
     and the device has finished what it queued (CUDA: the snapshot's copies, on a side stream; an
     upper bound, as training could overlap them), plus what the next step waited for those copies,
     plus whatever the training steps after it did not hide of the write (a final wait_checkpoint). The
     first save and the median of the later ones are reported apart, with the pool allocations
     each did and the median step time while the writer works, against steps with no save.
  Also: the verified load (every record's CRC-32 recomputed) against an unverified torch.load.

The model is an MLP language model (embedding, `--layers` blocks of h -> 4h -> h, head), trained by
one process with Adam (ZeRO stage `--stage`); `--hidden 2048 --layers 32 --vocab 50304` is about 1.3B
parameters. Files go to `--dir` (default: a temporary directory); the page cache is not dropped.

    python benchmarks/checkpoint_save.py --smoke                              # seconds, CPU
    python benchmarks/checkpoint_save.py --hidden 1024 --layers 8             # CPU, ~0.5B state bytes
    python benchmarks/checkpoint_save.py --hidden 2048 --layers 32 --bf16 --dir /local/nvme/ckpt   # GPU
    python benchmarks/checkpoint_save.py --smoke --stall-only --deepspeed     # part 2, against DeepSpeed
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import sync  # noqa: E402


class MLPLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                torch.nn.Linear(4 * hidden, hidden)) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make_engine(args, decoupled: bool, pool: str = "first_save"):
    import lightspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if decoupled:
        config["checkpoint"] = {"writer": {"type": "PYTHON", "decoupled": True, "snapshot_pool": pool}}
    engine, *_ = lightspeed.initialize(model=MLPLM(args.vocab, args.hidden, args.layers), config=config)
    return engine


def step(engine, args):
    device = next(engine.module.parameters()).device
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    loss = engine(tokens, tokens.roll(1, dims=1))
    engine.backward(loss)
    engine.step()
    return loss


def timed_steps(engine, args, n: int) -> list[float]:
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        step(engine, args)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure_checksum_cost(engine, root: str, repeats: int) -> dict[str, float]:
    from lightspeed.checkpoint import writer as writer_mod
    from lightspeed.checkpoint.atomic import _atomic_write

    real_entry = writer_mod.file_entry

    def size_only(path):
        return {"bytes": os.path.getsize(path)}

    engine.save_checkpoint(os.path.join(root, "warmup"), tag="w")  # first-call costs out of the timings
    shutil.rmtree(os.path.join(root, "warmup"))
    with_sums, without = [], []
    for i in range(repeats):  # interleaved, so drifts of the machine hit both alike
        for label, entry, out in (("with", real_entry, with_sums), ("without", size_only, without)):
            writer_mod.file_entry = entry
            try:
                sync()
                t0 = time.perf_counter()
                engine.save_checkpoint(os.path.join(root, label), tag=f"t{i}")
                out.append(time.perf_counter() - t0)
            finally:
                writer_mod.file_entry = real_entry
            shutil.rmtree(os.path.join(root, label, f"t{i}"))
    engine.save_checkpoint(os.path.join(root, "ref"), tag="ref")
    tag_path = os.path.join(root, "ref", "ref")
    result = {"with_s": statistics.median(with_sums), "without_s": statistics.median(without),
              "with_min_s": min(with_sums), "without_min_s": min(without), "bytes": dir_bytes(tag_path)}
    # The checksum step alone (what `file_entry` adds to each file after its write), timed directly:
    # robust to a noisy machine, unlike the difference of two whole saves.
    t0 = time.perf_counter()
    for f in sorted(os.listdir(tag_path)):
        if f.endswith(".pt"):
            real_entry(os.path.join(tag_path, f))
    result["entry_s"] = time.perf_counter() - t0
    # Reference points: hashing the state ourselves, and the previous file-object writer.
    states = [torch.load(os.path.join(tag_path, f), weights_only=True, map_location="cpu")
              for f in sorted(os.listdir(tag_path)) if f.endswith(".pt")]
    try:
        import xxhash

        tensors = []

        def collect(o):
            if torch.is_tensor(o):
                tensors.append(o.contiguous())
            elif isinstance(o, dict):
                for v in o.values():
                    collect(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    collect(v)

        for s in states:
            collect(s)
        t0 = time.perf_counter()
        for t in tensors:
            xxhash.xxh3_64_intdigest(t.view(torch.uint8).numpy() if t.numel() else b"")
        result["xxh3_s"] = time.perf_counter() - t0
    except ImportError:
        result["xxh3_s"] = float("nan")
    t0 = time.perf_counter()
    for i, s in enumerate(states):
        _atomic_write(os.path.join(root, f"fileobj{i}.pt"), lambda f, s=s: torch.save(s, f))
    result["fileobj_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, s in enumerate(states):
        torch.save(s, os.path.join(root, f"bypath{i}.pt"))
    result["bypath_s"] = time.perf_counter() - t0
    # Loading: verified (engine_checkpoint.load) against plain torch.load of the same files.
    from lightspeed.checkpoint import engine_checkpoint
    from lightspeed.checkpoint.atomic import safe_torch_load

    t0 = time.perf_counter()
    engine_checkpoint.load(os.path.join(root, "ref"), "ref", dp_rank=0)
    result["load_verified_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for f in sorted(os.listdir(tag_path)):
        if f.endswith(".pt"):
            safe_torch_load(os.path.join(tag_path, f))
    result["load_plain_s"] = time.perf_counter() - t0
    return result


def measure_stall(args, root: str, decoupled: bool, pool: str = "first_save") -> dict[str, float]:
    engine = make_engine(args, decoupled, pool)
    writer = engine._checkpoint_writer
    timed_steps(engine, args, args.warmup)
    base = timed_steps(engine, args, args.steps)
    out_dir = os.path.join(root, f"async_{pool}" if decoupled else "sync")
    stalls, parts, during, overlapped, allocations, firsts = [], [], [], [], [], []
    for i in range(args.saves):
        before = writer._pool.num_allocations
        sync()
        t0 = time.perf_counter()
        engine.save_checkpoint(out_dir, tag=f"s{i}")
        # what the save queued on the device (a background save's snapshot copies) drains here: the timed
        # steps below synchronize the device before their clock starts, so it would show in no step
        sync()
        returned = time.perf_counter() - t0
        allocations.append(writer._pool.num_allocations - before)
        # a background writer works during these: train on until it is done (at most --max-steps)
        steps = 0
        while steps < args.steps or (writer.writing and steps < args.max_steps):
            during.extend(timed_steps(engine, args, 1))
            if steps == 0:
                firsts.append(during[-1])
            steps += 1
        sync()
        t0 = time.perf_counter()
        engine.wait_checkpoint()
        unhidden = time.perf_counter() - t0  # whatever the steps did not hide
        step_wait = writer.last_stats.step_wait_s  # the next step's wait for the snapshot's copies
        stalls.append(returned + step_wait + unhidden)
        parts.append((returned, step_wait, unhidden))
        overlapped.append(steps)
        shutil.rmtree(os.path.join(out_dir, f"s{i}"))  # one save on disk at a time
    engine.destroy()
    later = parts[1:] or parts
    return {"stall_s": statistics.median(stalls[1:] or stalls), "first_stall_s": stalls[0],
            "parts_ms": "/".join(f"{statistics.median(p[k] for p in later) * 1e3:.1f}" for k in range(3)),
            "first_allocations": allocations[0], "later_allocations": sum(allocations[1:]),
            "step_s": statistics.median(base), "step_during_s": statistics.median(during),
            # the first step after a save: where copies the host did not wait for would show
            "first_after_s": statistics.median(firsts),
            "steps_during": statistics.median(overlapped)}


def measure_deepspeed_stall(args, root: str) -> dict[str, float]:
    """DeepSpeed's engine on the same model, config and data: its save_checkpoint is synchronous (its
    decoupled writers need the aio ops, not built with DS_BUILD_OPS=0), so the stall is the save."""
    import deepspeed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=MLPLM(args.vocab, args.hidden, args.layers), config=config)
    timed_steps(engine, args, args.warmup)
    base = timed_steps(engine, args, args.steps)
    stalls = []
    for i in range(args.saves):
        sync()
        t0 = time.perf_counter()
        engine.save_checkpoint(os.path.join(root, "deepspeed"), tag=f"s{i}")
        sync()
        stalls.append(time.perf_counter() - t0)
        saved = dir_bytes(os.path.join(root, "deepspeed", f"s{i}"))
        shutil.rmtree(os.path.join(root, "deepspeed", f"s{i}"))
        timed_steps(engine, args, args.steps)
    return {"stall_s": statistics.median(stalls[1:] or stalls), "first_stall_s": stalls[0],
            "step_s": statistics.median(base), "bytes": saved}


def print_stall_table(args, root: str) -> None:
    rows = [("synchronous", measure_stall(args, root, decoupled=False)),
            ("background, pool at first save", measure_stall(args, root, decoupled=True, pool="first_save")),
            ("background, pool at startup", measure_stall(args, root, decoupled=True, pool="startup"))]
    deepspeed_note = ""
    if args.deepspeed:
        try:
            import deepspeed  # noqa: F401
        except ImportError as err:
            deepspeed_note = f"DeepSpeed not measured: it does not import ({err})"
        else:
            rows.append(("DeepSpeed (synchronous)", measure_deepspeed_stall(args, root)))
    sync_row = rows[0][1]
    ds_row = rows[-1][1] if rows[-1][0].startswith("DeepSpeed") else None
    print("\n2. training stall per save: save_checkpoint's return + the next step's wait + what the steps after it "
          "did not hide (%d saves; later = median of saves 2..%d; at least %d steps after each; device %s)"
          % (args.saves, args.saves, args.steps, "cuda" if torch.cuda.is_available() else "cpu"))
    head = f"  {'':<32}{'first ms':>10}{'later ms':>10}{'first/sync':>11}{'later/sync':>11}"
    if ds_row is not None:
        head += f"{'first/DS':>9}{'later/DS':>9}"
    print(head + f"{'later: return/wait/rest ms':>28}{'pool allocs 1st/later':>23}{'step ms':>9}"
          f"{'step ms, writing':>20}{'1st step after':>15}")
    for name, r in rows:
        line = (f"  {name:<32}{r['first_stall_s'] * 1e3:10.1f}{r['stall_s'] * 1e3:10.1f}"
                f"{r['first_stall_s'] / sync_row['first_stall_s']:11.3f}{r['stall_s'] / sync_row['stall_s']:11.3f}")
        if ds_row is not None:
            line += f"{r['first_stall_s'] / ds_row['first_stall_s']:9.3f}{r['stall_s'] / ds_row['stall_s']:9.3f}"
        allocs = f"{r['first_allocations']}/{r['later_allocations']}" if "first_allocations" in r else "-"
        during = f"{r['step_during_s'] * 1e3:8.1f} ({r['steps_during']:.0f} steps)" if "step_during_s" in r else "-"
        first_after = f"{r['first_after_s'] * 1e3:.1f}" if "first_after_s" in r else "-"
        print(line + f"{r.get('parts_ms', '-'):>28}{allocs:>23}{r['step_s'] * 1e3:9.1f}{during:>20}{first_after:>15}")
    if deepspeed_note:
        print("  " + deepspeed_note)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="saves per variant for the checksum cost (median)")
    p.add_argument("--saves", type=int, default=4, help="saves per mode for the stall (first, median of the rest)")
    p.add_argument("--steps", type=int, default=4, help="training steps after each save (at least)")
    p.add_argument("--max-steps", type=int, default=5000,
                   help="background saves: train on while the writer works, up to this many steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
    p.add_argument("--deepspeed", action="store_true", help="also time DeepSpeed's save (must be importable)")
    p.add_argument("--stall-only", action="store_true", help="only part 2 (the training stall per save)")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.seq, args.repeats, args.saves, args.steps = 64, 2, 256, 16, 1, 3, 2
    os.environ.setdefault("LIGHTSPEED_LOG_LEVEL", "WARNING")
    root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)
    try:
        if not args.stall_only:
            engine = make_engine(args, decoupled=False)
            num_params = sum(p.numel() for p in engine.module.parameters())
            timed_steps(engine, args, 1)
            cost = measure_checksum_cost(engine, root, args.repeats)
            del engine
            gb = cost["bytes"] / 1e9
            print(f"model: {num_params / 1e6:.1f}M parameters, stage {args.stage}, "
                  f"{'bf16' if args.bf16 else 'fp32'}; checkpoint {gb:.3f} GB; device "
                  f"{'cuda' if torch.cuda.is_available() else 'cpu'}; files in {root}")
            print("\n1. save time (median of %d), checksums vs none" % args.repeats)
            extra = cost["with_s"] / cost["without_s"] - 1
            print(f"  save with checksums      {cost['with_s']:8.3f} s  ({gb / cost['with_s']:.2f} GB/s)")
            print(f"  save without checksums   {cost['without_s']:8.3f} s  -> checksums add {extra * 100:+.1f}%")
            print(f"  fastest of each          {cost['with_min_s']:8.3f} s vs {cost['without_min_s']:.3f} s "
                  f"({(cost['with_min_s'] / cost['without_min_s'] - 1) * 100:+.1f}%; whole saves are noisy on a busy machine)")
            print(f"  checksum step alone      {cost['entry_s']:8.4f} s = {cost['entry_s'] / cost['without_s'] * 100:.2f}% "
                  "of a save (read back from each file's zip directory)")
            print(f"  (xxh3_64 over every tensor: {cost['xxh3_s']:.3f} s = "
                  f"{cost['xxh3_s'] / cost['without_s'] * 100:.1f}% of a save, not used)")
            print(f"  (torch.save of the same files by path {cost['bypath_s']:.3f} s; through a Python file object, "
                  f"the previous writer, {cost['fileobj_s']:.3f} s; neither fsynced nor checksummed)")
            print(f"  load, verified {cost['load_verified_s']:.3f} s; plain torch.load {cost['load_plain_s']:.3f} s")
            for entry in os.listdir(root):  # section 1's files out of the way: the disk holds few saves
                path = os.path.join(root, entry)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        print_stall_table(args, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
