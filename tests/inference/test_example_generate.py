"""examples/generate_quantized.py runs as documented: the tiny random Llama, quantized while loading;
saved with --save and loaded back from that directory (also with --kernel-inject), the same greedy tokens."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import generate_quantized  # noqa: E402


def _tokens(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("tokens: "))


@pytest.mark.parametrize("quant", ["fp6", "int4"])
def test_example_generates_and_reloads(tmp_path, capsys, quant):
    generate_quantized.main(["--quant", quant, "--max-new-tokens", "6", "--dtype", "float32", "--device", "cpu",
                             "--save", str(tmp_path / "q")])
    first = capsys.readouterr().out
    assert "new tokens in" in first and f"saved to {tmp_path / 'q'}" in first
    generate_quantized.main(["--model", str(tmp_path / "q"), "--quant", quant, "--max-new-tokens", "6",
                             "--dtype", "float32", "--device", "cpu"])
    again = capsys.readouterr().out
    assert _tokens(first) == _tokens(again) and len(_tokens(first).split(",")) == 8 + 6
    generate_quantized.main(["--model", str(tmp_path / "q"), "--quant", quant, "--max-new-tokens", "6",
                             "--dtype", "float32", "--device", "cpu", "--kernel-inject"])  # q/k/v, gate/up fused
    assert _tokens(capsys.readouterr().out) == _tokens(first)


def test_example_cuda_graph_needs_a_gpu():
    with pytest.raises(ValueError, match="enable_cuda_graph=True needs a CUDA device"):
        generate_quantized.main(["--quant", "int8", "--max-new-tokens", "2", "--dtype", "float32", "--device", "cpu",
                                 "--cuda-graph"])
