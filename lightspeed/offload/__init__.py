"""ZeRO-Offload and ZeRO-Infinity: the optimizer's fp32 state (and at stage 3 the parameter shards) in
host memory or NVMe swap files.

Modules: `policy.py` (`OffloadPolicy`, frozen, built once from `offload_optimizer` / `offload_param` /
`aio`: the strategies ask it where a tensor goes and never read those keys), `nvme.py` (`NvmeSwapper`),
`swapped_step.py` (NVMe optimizer offload, one sub-group at a time), `overlap.py` (the one-step-delayed
CPU step, `offload_optimizer.overlap_step`, lightspeed's own key), `early_step.py` (stepping during
backward), `speculative.py` (`offload_optimizer.super_offload`: stepping during backward whatever
the step clips or scales, rolled back exactly when it does), `zenflow_config.py` (DeepSpeed's
`zero_optimization.zenflow` options; ZenFlow's step is `zero/zenflow.py`). Elsewhere: `_utils/pinned.py` (exact-size pinned host memory), `ops/lowp_writer.py` (stepped
pieces to the device), `zero/step_runner.py` (`StepRunner`, the one driver of the plain, swapped,
overlapped and early steps for stages 1-3; it calls back into the strategy only for `write_back` and
`write_sub_group(i)`), and the strategies, which place the tensors.

Where things live: stages 1-2 keep the master shard and `master_grad` on the host; stage 3's
`ParamGroup` keeps the master there (and with `offload_param` the lp shard, copied to the device at
gather; past `offload_param.max_in_cpu` elements swapped and read back at gather, the coordinator's
prefetch starting those reads through `read_ahead()`). `optim.build_optimizer(cpu_offload=True)` maps
Adam/AdamW, Lion and Adagrad to the CPU kernels, and `initialize()` applies DeepSpeed's
`zero_force_ds_cpu_optimizer` rule to a client optimizer. Offload++ (`ratio` < 1, stage 3): groups past
that fraction of the trainable elements keep master and state on the device (the policy with
`optimizer="none"`), stepped by the same optimizer. `MemoryTally` reports swapped bytes under "nvme".

The step: at the accumulation boundary each reduction is finished and copied to the host gradient buffer
on a copy stream as soon as it is launched (`reduce.PendingToHost` at stages 1-2, `PendingGrad(to_host=)`
at stage 3; `ShardViews.early_filled` / `master_grads_filled` tell the step not to copy again). The
norm reads the device gradients (`ShardViews.norm_grads`). The CPU optimizers take the fused call
(`zero/optimizers.fused_step` says when: CPU optimizer offload, not NVMe, not `ratio` < 1, not parameters
on NVMe, not `overlap_step`): masters stepped in pieces with the clip coefficient inside the kernel,
each piece written to the device by `LowpWriter` while the next is stepped, the host gradient read and
never written (`ops/adam/cpu_adam.py`'s Note); the non-fused write-backs
use the same writer. Without clipping and loss scaling (exact only then) stages 1-2 step each bucket's
range during backward as its host copy completes (`StepRunner.host_copy_queued`, `EarlyStep`, the CPU
optimizer's `begin_zero_step` / `zero_step_range` / `end_zero_step`), stage 3 each group's pieces
(`ParamGroup.on_host_queued`); `EarlyStep.finish` steps whatever no range covered. Offload at stages 1-2
caps the layout bucket so the copies run under backward.

Not built: splitting a stage-1/2 shard into `sub_group_size` pieces (each flat buffer's shard is one
sub-group, so NVMe holds that whole shard's state in memory while it steps), GPUDirect Storage
(`aio.use_gds`, refused). `lightspeed report` has an offload section (host memory, pinned buffers,
whether the temporary directory takes O_DIRECT, CPU optimizer cores).
"""
