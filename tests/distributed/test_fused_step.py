"""The fused ZeRO step inside the engine: FusedAdam's Triton kernel (interpreted on CPU, real on a GPU)
reading low-precision gradient shards, applying the unscale/clip coefficient and writing the
low-precision parameters, against the same engine on the plain-PyTorch reference, stages 0-3, gloo."""

from __future__ import annotations

import os

import pytest
import torch

from lightspeed.testing.run_world import run_world
from tests.distributed.test_data_parallel import STEPS, _config, engine_losses

pytestmark = pytest.mark.dist
pytest.importorskip("triton")


def _losses(backend: str, config: dict):
    os.environ["LIGHTSPEED_OPS_BACKEND"] = backend  # read when the optimizer is built
    os.environ.setdefault("TRITON_INTERPRET", "1")  # no effect when triton was imported on a GPU machine
    return engine_losses(STEPS, config)


def _fp32(stage: int) -> dict:
    return _config(2, gas=2, gradient_clipping=0.05, zero_optimization={"stage": stage, "reduce_bucket_size": 50,
                                                                       "allgather_bucket_size": 50})


def _bf16(stage: int) -> dict:
    return _config(2, gradient_clipping=0.05, bf16={"enabled": True}, zero_optimization={"stage": stage})


CASES = {("fp32", 0): _fp32(0), ("fp32", 2): _fp32(2), ("fp32", 3): _fp32(3), ("bf16", 1): _bf16(1),
         ("bf16", 3): _bf16(3)}


def _both_backends(cases: dict) -> dict:
    return {key: (_losses("reference", cfg), _losses("triton", cfg)) for key, cfg in cases.items()}


@pytest.fixture(scope="module")
def runs():
    """Every case on both backends, in one spawned world (rank 0's results)."""
    return run_world(_both_backends, 2, CASES)[0]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_kernel_in_engine_matches_reference_fp32(stage, runs):
    (ref, ref_state, ref_norm), (got, state, norm) = runs[("fp32", stage)]
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-7)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_kernel_in_engine_matches_reference_bf16(stage, runs):
    (ref, _, _), (got, _, _) = runs[("bf16", stage)]
    # the interpreter rounds fp32 -> bf16 toward zero, the GPU and torch to nearest: an ulp apart
    assert got == pytest.approx(ref, rel=2e-2, abs=1e-2)
