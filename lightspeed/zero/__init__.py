"""ZeRO: flat partitioned buffers and the sharding strategies of stages 0-3.

`lightspeed.zero.Init`, `GatheredParameters` and `register_external_parameter` mirror
`deepspeed.zero`'s names, and DeepSpeed's `safe_get_*` / `safe_set_*` parameter accessors
(`deepspeed.utils`) live in `param_access`; they are imported lazily so that `import lightspeed.zero.partition` stays light.

Modules: `partition.py` (pure shard arithmetic), `flat_params.py`, `buckets.py`, `reduce.py`,
`grad_buffers.py`, `memory.py`, `sharded_step.py` and `step_runner.py` (the step, written once),
`graphed_step.py` (the fused step's launches captured in a CUDA graph: `optimizer.cuda_graph`),
`grad_clip.py` and `norm.py` (the norm), `optimizers.py`, `fragments.py` (the saved layout),
`param_access.py`, and the strategies `stage0.py`, `stage12.py`, `stage3/`. Every strategy implements
runtime/strategy.py's `ShardingStrategy`, including `compile_regions()` (for `engine.compile()`),
`masters_loaded()` / `masters_from_params()` (the low-precision parameters follow the fp32 masters after
a load, or the reverse) and `module_shapes()` (full shapes, so a load is checked before it changes
anything).

Stage 0's step: backward hooks (`register_post_accumulate_grad_hook`) accumulate into `grad_flat`
(autograd writes straight into it when the gradient dtype equals the parameter dtype); at the
accumulation boundary full buckets start asynchronous all-reduces in index order; `step()` waits, checks
fp16 overflow with one fused check, computes one global norm, applies one unscale-and-clip coefficient,
steps the optimizer on fp32 master views and copies the masters into the low-precision parameters in
one copy. With an optimizer that `ReducesOwnGradients` (one-bit), stage 0 skips the bucket all-reduce on
the steps the optimizer asks, agrees only the inf/nan decision and clips by each rank's own norm, as
DeepSpeed's one-bit optimizers do.

Stages 1-2: rank r owns the r-th chunk of every bucket (stage12.py's Note), so each bucket is
reduce-scattered and all-gathered on its own; stage 2 finishes the oldest reduce-scatter once more than
two are in flight (`GradBuckets(max_inflight=)`), so at most two bucket-sized staging buffers are alive,
and on NCCL reduce-scatters in place into the staging buffer.

The fused ZeRO step (every stage, when the optimizer is one of lightspeed.ops' fused ones): no fp32 copy
of the gradients exists; the strategy computes the global norm from the low-precision gradients (fp32
accumulation) and calls `optimizer.step(grads={master: grad}, grad_scale=coef, lowp_out={master:
[(offset, lp_view), ...]})`, so one kernel reads grad, master and moments once and writes master,
moments and the 16-bit parameters once (the 0-dim `coef` stays on the device: no host sync). Stages 1-2
then all-gather the lp chunks without a copy; stages 0 and 3 skip their master -> lp copies.

Gradient memory between steps (stages 1-3, grad_buffers.py's Note): the device gradient buffers exist
from the first gradient of a backward to the end of the step, so the forward, where activations peak,
holds none. Views cut later (`param_access` fragments) are cut only while allocated, and a fragment read
between steps has no gradient (the gradient accessors raise ValueError there, as DeepSpeed's do after
its step at stages 1-2). Host gradient buffers of an offloaded optimizer are not released.
"""

_STAGE3_EXPORTS = ("Init", "GatheredParameters", "register_external_parameter")
_FRAGMENT_EXPORTS = ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                     "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
                     "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_grad",
                     "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state")

__all__ = list(_STAGE3_EXPORTS)  # deepspeed.zero's names (the accessors are deepspeed.utils')


def __getattr__(name: str):
    if name in _STAGE3_EXPORTS:
        from lightspeed.zero import stage3

        return getattr(stage3, name)
    if name in _FRAGMENT_EXPORTS:
        from lightspeed.zero import param_access as fragments

        return getattr(fragments, name)
    raise AttributeError(f"module 'lightspeed.zero' has no attribute {name!r}")
