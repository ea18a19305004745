"""Inference: `init_inference` (DeepSpeed's entry point) and what it builds: weight-only quantized linear
layers and MoE experts, tensor parallelism (AutoTP without kernel injection), projection fusion for
`replace_with_kernel_inject`, CUDA graphs, and inference checkpoints. Uses ops/, _utils/, parallel/'s
plan and checkpoint/'s atomic writes; never imports triton, and nothing in training imports it.

`engine.py` (`init_inference`, `quantize_linears`), `quantized_linear.py` (`QuantizedLinear`),
`experts.py` (`QuantizedExperts`), `tensor_parallel.py`, `fusion.py`, `cuda_graph.py`, `checkpoint.py`
(the streaming load, the save), `checkpoint_files.py`, `checkpoint_keys.py`. A model built on the meta
device (`lightspeed.OnDevice`, `_utils/init_on_device.py`) gets every parameter from the checkpoint.
`examples/generate_quantized.py` is the user-facing script (meta build, checkpoint, quant, --tp, --save).
The CUDA-graph logic is tested on CPU through `tests/inference/fake_cuda_graph.py` (capture records
aten ops, replay re-runs them without Python); the real graphs are tested on a GPU."""

from lightspeed.inference.engine import init_inference, quantize_linears
from lightspeed.inference.quantized_linear import QuantizedLinear

__all__ = ["QuantizedLinear", "init_inference", "quantize_linears"]
