"""Compute, no communication: the optimizers' kernels and classes (import paths mirror `deepspeed.ops`:
`ops.adam.FusedAdam`, `ops.adam.CPUAdam`, ...), and the kernels of ZeRO++'s and 1-bit's wire formats and of
inference's weight-only quantization.

One folder per op family: `reference.py` (plain torch on one tensor: the spec, and the CPU path),
`triton.py` (the kernels; the only modules that import triton, lazily), a dispatcher, and for optimizers
the Optimizer classes. `adam/`, `adagrad/`, `lion/`, `lamb/` hold the fused device optimizers (DeepSpeed's
signatures; Triton on CUDA, the reference on CPU; fp32 state and math for fp32/fp16/bf16 parameters) and
the CPU optimizers of ZeRO-Offload (torch's CPU kernels called directly, chunked fp32 scratch for 16-bit
parameters, no C++ build). `multi_tensor/` is what the device optimizers share: the launch plan and
`FusedOptimizer`, whose `step(grads=, grad_scale=, lowp_out=)` is the fused ZeRO step; the CPU optimizers
take the same call and write through `lowp_writer.py`. `onebit/` packs signs (1-bit optimizers),
`quantize/` quantizes rows block-wise (ZeRO++), `wquant/` is the FP6 / INT8 / INT4 weight-only matmul
(one folder for the three formats because they share one kernel). `grouped_gemm/` is mixture-of-experts
training's grouped GEMM (forward and both gradients), the routing's permute / unpermute and the experts'
gated MLP (`grouped_mlp`); on CUDA it also picks `torch._grouped_mm` where that is faster (its Note:
[backend rule]).
`sparse_attention/` is DeepSpeed's block-sparse attention (`deepspeed.ops.sparse_attention`) on PyTorch
FlexAttention: layouts, `SparseSelfAttention`, the BERT layer and the HF helpers.

Backend: Triton for CUDA tensors, the reference otherwise; `LIGHTSPEED_OPS_BACKEND=reference|triton`
overrides the automatic choice (e.g. to rule the kernels out while debugging, or to run them under
`TRITON_INTERPRET=1` on CPU). `lightspeed report` says which kernel families can run on this machine.
"""
