"""The offloaded updates that are not the synchronous step: their effect on convergence.

    python benchmarks/offload_convergence.py [--world 2] [--steps 300] [--preset small] [--zenflow]
        [--zenflow-sweep] [--speculative] [--warmups 30 100]

Trains the demo task (benchmarks/onebit.py's harness: examples/train_gpt.py's byte-level GPT on its
Shakespeare text, AdamW, warm-up + cosine schedule, clipping 1.0) at ZeRO-2 with the optimizer
offloaded to the CPU, once with the usual step and once with `overlap_step` (the CPU step of step t
runs during the forward and backward of step t+1, so each update is one step late), and with
`overlap_step_warmup` (the first steps synchronous), on gloo processes, same data, schedule and seed;
and the same run without offload. `--zenflow` adds ZenFlow (`zero_optimization.zenflow`: topk 0.05,
update_interval 4, as benchmarks/offload.py runs it; sequential and with `overlap_step`),
`--zenflow-sweep` ZenFlow at other settings (topk 0.1 and 0.2, update_interval 2, 30 full warm-up
rounds; with `--deepspeed` also on DeepSpeed, plus its warm-up row without its division of the loss by
update_interval in the warm-up steps, a check), and
`--speculative` the speculative CPU step (`offload_optimizer.super_offload`: each bucket stepped during
backward, rolled back when the clip or an overflow says so). `--finetune N` makes it a fine-tuning
task: N steps of plain ZeRO-2 on the first half of the text, then every run from those weights on the
second half. Reported: the final validation loss of
each and its gap to the usual offloaded run.

`--deepspeed` also runs the same training (benchmarks/demo_task.py's loop: model init, data order,
schedule, clipping, seed, gloo world; in fine-tuning, the same pretrained weights) under real DeepSpeed
(lightspeed.testing.deepspeed_env's interpreter, DeepSpeed's CPU accelerator, one child process
spawning the world per run) for ZeRO-2 offload and ZeRO-2 offload + ZenFlow (the same zenflow
section), each row's gap taken to DeepSpeed's own offloaded run: whether a ZenFlow gap is the
algorithm's or lightspeed's. DeepSpeed 0.19.8's ZenFlow mixes up the layout of the 2-D weights (see
FIXED): the table says when a run's initialize changed its weights, and two more rows run DeepSpeed's
ZenFlow with that one method patched (and, as the patch's check, with update_interval 1, which must
give DeepSpeed's offloaded run). A DeepSpeed run that fails reports its error as its row.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# torch-only modules: the DeepSpeed child (--ds-child) imports this file and never lightspeed
from benchmarks.demo_task import PRESETS, train_demo  # noqa: E402
from benchmarks.harness import emit_result, run_deepspeed_child  # noqa: E402

VARIANTS = {
    "ZeRO-2": {"stage": 2},
    "ZeRO-2 offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "ZeRO-2 offload, overlap_step": {"stage": 2, "offload_optimizer": {"device": "cpu", "overlap_step": True}},
}
WARMUP_NAME = "ZeRO-2 offload, overlap_step, {} synchronous steps first"
_ZENFLOW = {"topk_ratio": 0.05, "update_interval": 4, "full_warm_up_rounds": 0}
ZENFLOW = {
    "ZeRO-2 offload, ZenFlow": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": dict(_ZENFLOW)},
    "ZeRO-2 offload, ZenFlow, overlap_step": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                              "zenflow": {**_ZENFLOW, "overlap_step": True}},
    # DeepSpeed's tutorial recommends the adaptive update interval
    "ZeRO-2 offload, ZenFlow, update_interval auto": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                      "zenflow": {**_ZENFLOW, "update_interval": "auto"}},
}
# other ZenFlow settings (--zenflow-sweep): more columns on the GPU, a shorter interval, full warm-up rounds
ZENFLOW_SWEEP = {
    f"ZeRO-2 offload, ZenFlow, {label}": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                          "zenflow": {**_ZENFLOW, **change}}
    for label, change in (("topk 0.1", {"topk_ratio": 0.1}), ("topk 0.2", {"topk_ratio": 0.2}),
                          ("update_interval 2", {"update_interval": 2}),
                          ("full_warm_up_rounds 30", {"full_warm_up_rounds": 30}))}
SPECULATIVE = {"ZeRO-2 offload, speculative (super_offload)": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}}}
# the DeepSpeed rows: the same zero_optimization sections as lightspeed's rows of these names
DEEPSPEED = ("ZeRO-2 offload", "ZeRO-2 offload, ZenFlow")
# DeepSpeed 0.19.8's ZeRO-1/2 ZenFlow keeps the flat buffers in each 2-D weight's transposed layout
# (zenflow_utils._flatten_dense_tensors; the gradients reach its CPU Adam in that layout, its column
# selection reads them so) but points each parameter back at its slice with a plain view
# (stage_1_and_2._update_model_bit16_weights): after `deepspeed.initialize` every 2-D weight W holds
# W.t() read in W's shape, and each element is updated with another element's gradient. From a random
# init the first is another draw of the same init; a fine-tuning run loses its weights, and every run
# trains on mismatched updates (measured 2026-12-05: 97.7% of the elements' updates agree in sign with
# plain offload's update re-laid out so, 52% without). These rows patch that one method in the child
# to view each 2-D slice transposed (the layout fix); update_interval 1 (every step a full CPU update)
# must then give DeepSpeed's plain offloaded run: the check of the fix.
FIXED = {"ZeRO-2 offload, ZenFlow, layout fix": dict(_ZENFLOW),
         "ZeRO-2 offload, ZenFlow, layout fix, update_interval 1 (check)": {**_ZENFLOW, "update_interval": 1}}


def _fix_zenflow_layout() -> None:
    """In the DeepSpeed child: ZenFlow's parameters view their flat slices in its transposed layout
    (see FIXED); other runs keep DeepSpeed's method."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._update_model_bit16_weights

    def update(self, group_index):
        if not getattr(self, "zenflow", False):
            return original(self, group_index)
        flat = self.bit16_groups_flat[group_index]
        for p, meta, offset in zip(self.round_robin_bit16_groups[group_index], self.round_robin_bit16_meta[group_index],
                                   self.round_robin_bit16_offsets[group_index]):
            piece = flat.narrow(0, offset, meta.numel())
            p.data = piece.view(meta.shape[1], meta.shape[0]).t() if len(meta.shape) == 2 else piece.view(meta.shape)
        for i, param in enumerate(self.bit16_groups[group_index]):
            param.data = self.round_robin_bit16_groups[group_index][self.round_robin_bit16_indices[group_index][i]].data

    DeepSpeedZeroOptimizer._update_model_bit16_weights = update


def _unscaled_warm_up(rounds: int) -> None:
    """DeepSpeed's engine without its division of the loss by the accumulation steps (ZenFlow's
    update_interval) in the first `rounds` steps, ZenFlow's full warm-up updates of one step's
    gradient each: the check whether this division is what separates its warm-up rows from lightspeed's.
    (DeepSpeed 0.19.8's `backward` divides inline unless `scale_wrt_gas` is False.)"""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.backward

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        if self.micro_steps + 1 <= rounds:
            scale_wrt_gas = False
        return original(self, loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    DeepSpeedEngine.backward = backward


# ---------------------------------------------------------------- DeepSpeed (its own interpreter)
def _ds_worker(rank: int, world: int, port: int, name: str, optimizer: dict, args_dict: dict, run: dict,
               out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    if run["layout_fix"]:
        _fix_zenflow_layout()
    if run.get("warm_up_unscaled"):
        _unscaled_warm_up(run["warm_up_unscaled"])
    deepspeed.init_distributed(dist_backend="gloo")
    row = train_demo(deepspeed.initialize, name, optimizer, args_dict, run["zero"], count_wire=False, check_init=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps({**row, "version": deepspeed.__version__}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _ds_child(spec_path: str) -> None:
    """In DeepSpeed's interpreter: one spawned gloo world per run of the spec; emits each row (or its
    error) for `run_deepspeed_child`."""
    import torch.multiprocessing as mp

    spec = json.loads(Path(spec_path).read_text())
    for name, run in spec["runs"].items():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tempfile.mkdtemp(), "row.json")
        try:
            mp.start_processes(_ds_worker, args=(spec["world"], port, name, spec["optimizer"], spec["args"], run,
                                                 out), nprocs=spec["world"], start_method="spawn")
            emit_result(json.loads(Path(out).read_text()))
        except Exception as err:  # the run's failure is its row's result
            lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
            emit_result({"name": name, "error": " | ".join(lines[-3:])[:600]})


def run_deepspeed(args, optimizer: dict, run_args: dict, runs: dict[str, dict]) -> dict[str, dict]:
    """The `runs` ({name: {"zero": section, "layout_fix": bool}}) under real DeepSpeed in a child
    interpreter; {"DeepSpeed " + name: row}, a row with "error" if it failed."""
    from lightspeed.testing import deepspeed_env

    python = deepspeed_env.python()
    if python is None:
        return {f"DeepSpeed {n}": {"error": deepspeed_env.missing_reason()} for n in runs}
    spec = os.path.join(tempfile.mkdtemp(), "spec.json")
    Path(spec).write_text(json.dumps({"world": args.world, "optimizer": optimizer, "args": run_args, "runs": runs}))
    results, err = run_deepspeed_child([__file__, "--ds-child", spec], str(python), cpu=True, timeout=args.timeout)
    rows = {f"DeepSpeed {r['name']}": r for r in results}
    for n in runs:
        rows.setdefault(f"DeepSpeed {n}", {"error": err or "no result"})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--eval_batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--warmups", type=int, nargs="*", default=[30],
                   help="also overlap_step after this many synchronous steps (overlap_step_warmup)")
    p.add_argument("--zenflow", action="store_true", help="also ZenFlow, sequential and overlapped")
    p.add_argument("--zenflow-sweep", action="store_true",
                   help="also ZenFlow at topk 0.1 and 0.2, update_interval 2, 30 full warm-up rounds")
    p.add_argument("--speculative", action="store_true", help="also the speculative CPU step (super_offload)")
    p.add_argument("--finetune", type=int, default=0, metavar="N",
                   help="fine-tuning: first train N steps (ZeRO-2, lr 3e-3) on the first half of the text, then "
                        "run every variant from those weights on the second half")
    p.add_argument("--deepspeed", action="store_true",
                   help="also real DeepSpeed's ZeRO-2 offload and ZeRO-2 offload + ZenFlow (child interpreter), "
                        "and its ZenFlow with its 2-D weight layout fixed (see FIXED)")
    p.add_argument("--ds-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ds_child:
        _ds_child(args.ds_child)
        return
    from benchmarks.onebit import _train_one, optimizers
    from lightspeed.testing.run_world import run_world

    adamw = optimizers(args.steps, args.lr, args.lr, 1, 1, args.weight_decay)["AdamW"]
    rows = {}
    variants = dict(VARIANTS)
    for w in args.warmups:
        variants[WARMUP_NAME.format(w)] = {"stage": 2, "offload_optimizer": {
            "device": "cpu", "overlap_step": True, "overlap_step_warmup": w}}
    variants.update(ZENFLOW if args.zenflow else {})
    variants.update(ZENFLOW_SWEEP if args.zenflow_sweep else {})
    variants.update(SPECULATIVE if args.speculative else {})
    run_args = dict(vars(args))
    if args.finetune:
        pre = dict(vars(args), steps=args.finetune, lr=3e-3, data_part="first",
                   save_to=os.path.join(tempfile.mkdtemp(), "pretrained.pt"))
        pre_opt = optimizers(args.finetune, 3e-3, 3e-3, 1, 1, args.weight_decay)["AdamW"]
        r = run_world(_train_one, args.world, "pretraining", pre_opt, pre, {"stage": 2}, timeout=args.timeout)[0]
        print(f"  pretraining, {args.finetune} steps on the first half: val loss {r['val_loss']:.4f}", flush=True)
        run_args.update(init_from=pre["save_to"], data_part="second")
    for name, zero in variants.items():
        rows[name] = run_world(_train_one, args.world, name, adamw, run_args, zero, timeout=args.timeout)[0]
        print(f"  {name}: val loss {rows[name]['val_loss']:.4f}, train loss (last 20) "
              f"{rows[name]['train_loss_last']:.4f}", flush=True)
    ds_rows = {}
    if args.deepspeed:
        runs = {n: {"zero": {**VARIANTS, **ZENFLOW}[n], "layout_fix": False} for n in DEEPSPEED}
        fixed = dict(FIXED)
        if args.zenflow_sweep:  # the sweep's settings on DeepSpeed's ZenFlow too (layout fixed)
            fixed.update({f"{n}, layout fix": z["zenflow"] for n, z in ZENFLOW_SWEEP.items()})
        runs.update({n: {"zero": {**VARIANTS["ZeRO-2 offload"], "zenflow": zf}, "layout_fix": True}
                     for n, zf in fixed.items()})
        if args.zenflow_sweep:
            zf = {**_ZENFLOW, "full_warm_up_rounds": 30}
            runs["ZeRO-2 offload, ZenFlow, full_warm_up_rounds 30, layout fix, warm-up losses undivided (check)"] = {
                "zero": {**VARIANTS["ZeRO-2 offload"], "zenflow": zf}, "layout_fix": True, "warm_up_unscaled": 30}
        ds_rows = run_deepspeed(args, adamw, run_args, runs)
        for name, r in ds_rows.items():
            print(f"  {name}: " + (f"failed: {r['error']}" if "error" in r else
                                   f"val loss {r['val_loss']:.4f}, train loss (last 20) {r['train_loss_last']:.4f}"),
                  flush=True)
    print(f"\nworld {args.world}, {args.steps} steps, {rows['ZeRO-2']['params']:,} parameters (fp32, gloo), "
          f"preset {args.preset}")
    width = max([56] + [len(n) for n in ds_rows])
    print(f"{'run':<{width}} {'val loss':>9} {'vs offload':>11}")
    for group in (rows, ds_rows):
        base = group.get("ZeRO-2 offload", group.get("DeepSpeed ZeRO-2 offload", {})).get("val_loss")
        for name, r in group.items():
            if "error" in r:
                print(f"{name:<{width}} failed: {r['error']}")
                continue
            gap = f"{(r['val_loss'] / base - 1) * 100:>+10.2f}%" if base else f"{'n/a':>11}"
            changed = f"  (initialize changed the weights: max |diff| {r['init_max_diff']:.3g})" \
                if r.get("init_max_diff") else ""
            print(f"{name:<{width}} {r['val_loss']:>9.4f} {gap}{changed}")
    if ds_rows:
        print("(each DeepSpeed row's gap is to DeepSpeed's own offloaded run)")


if __name__ == "__main__":
    main()
