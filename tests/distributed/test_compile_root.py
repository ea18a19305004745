"""engine.compile() at ZeRO-3 on two gloo ranks compiles the root's forward around its units
(zero/stage3/opaque.py): the demo GPT's embeddings, final norm, head and cross-entropy are in the
root's graph, each block is one opaque op of it (and a compiled region of its own), dynamo skips no
frame and breaks no graph, and the losses equal eager ones. One spawned world for every case."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.run_world import run_world

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.gpt import GPT, GPTConfig  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

VOCAB = 64
RELEASE_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
               "stage3_prefetch_bucket_size": 3000}


def _train(compiled: bool, zero: dict, accumulation: int):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    from lightspeed.zero.stage3 import opaque

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("demo", vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=2, block_size=16))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 3, **zero},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    if compiled:
        engine.compile(backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randint(0, VOCAB, (2 * accumulation, 17), generator=g)
    losses = []
    for _ in range(3):
        for i in range(accumulation):
            xi = x[2 * i:2 * i + 2]
            loss = engine(xi[:, :-1], xi[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    with torch.no_grad():  # a forward without backward saves nothing for one
        losses.append(engine(x[:2, :-1], x[:2, 1:]).item())
    unimplemented = "\n".join(counters["unimplemented"])
    return {"losses": losses, "breaks": sum(counters["graph_break"].values()),
            "frames": dict(counters["frames"]), "skipped_loop": "graph break in loop" in unimplemented,
            "root_graph": any(("cross_entropy" in c or "log_softmax" in c) and "unit_forward" in c for c in graphs),
            "unit_backward": any("unit_backward" in c for c in graphs), "saved_left": len(opaque._SAVED)}


def _cases():
    out = {}
    for name, zero, accumulation in (("release-all", RELEASE_ALL, 1), ("defaults-accumulate", {}, 2)):
        out[name] = (_train(False, zero, accumulation), _train(True, zero, accumulation))
    return out


def test_root_forward_compiles_around_opaque_units():
    results = run_world(_cases, 2, timeout=110)
    for rank, result in enumerate(results):
        for name, (eager, compiled) in result.items():
            where = f"{name} rank {rank}"
            assert not compiled["skipped_loop"], f"{where}: dynamo skipped a frame (graph break in loop)"
            assert compiled["breaks"] == 0, f"{where}: {compiled['breaks']} graph break(s)"
            frames = compiled["frames"]
            assert frames.get("total", 0) >= 2 and frames.get("ok") == frames.get("total"), f"{where}: {frames}"
            assert compiled["root_graph"], f"{where}: no graph holds the root's loss around the opaque units"
            assert compiled["unit_backward"], f"{where}: the root's backward graph runs no unit backward"
            assert compiled["saved_left"] == 0, f"{where}: unit calls saved for a backward that never came"
            torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-6, atol=1e-6, msg=where)
            assert eager["losses"][-2] < eager["losses"][0], f"{where}: did not learn"
