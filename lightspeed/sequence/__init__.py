"""Ulysses sequence parallelism (DeepSpeed's `deepspeed.sequence` and the ALST pieces of
`deepspeed.runtime.sequence_parallel.ulysses_sp`).

`layer.py` `DistributedAttention` (all-to-all around a local attention), `ulysses_hf.py`
`UlyssesSPAttentionHF` (the same for transformers models, through its attention registry),
`dataloader.py` `UlyssesSPDataLoaderAdapter` (whole sequences -> per-rank slices), `loss.py`
`sequence_parallel_loss` (the token-weighted loss over the sp group), `transform.py`
`apply_sequence_parallel` (initialize's model transform). The groups and the differentiable collectives
live in `lightspeed.comm` (`sequence_groups.py`, `differentiable.py`); `initialize_sequence_parallel(n)`
builds this process's groups before the model (a model holding `DistributedAttention` needs its group
at construction) and returns them (`.sp_group`, `.sp_rank`, ...); `initialize()` then uses the same ones.
Imports comm/, _utils/ and parallel/'s `split_tp_size` only.

ZeRO reduces and partitions over dp x sp (the `Topology`'s "dp_sp" group); it sums the sp ranks' gradients
and averages over dp at stages 0-2 and averages over dp x sp at stage 3, DeepSpeed 0.19.8's rule
(zero/reduce.py's Note), which `sequence_parallel_loss` follows;
with sp > 1 gradients are reduced in `seq_parallel_communication_data_type` (fp32 by default), DeepSpeed's rule.
With tensor parallelism (tp x sp x dp, Megatron's layout) the tp transform leaves each tp rank H/tp heads
(column-parallel q/k/v) and Ulysses all-to-alls those over the sp group: H/tp and the key/value heads per
tp rank must divide by sp, else an error naming `sequence_parallel_size`. A model split by
`tp_model_init` before `register_with_transformers` gets the mesh's groups and per-rank head counts. The compat modules `deepspeed.utils.groups`, `deepspeed.sequence.layer` and
`deepspeed.runtime.sequence_parallel.{ulysses_sp, parallel_state_sp}` re-export these; ALST's tiled
compute raises NotImplementedError.
"""

from lightspeed.comm.sequence_groups import initialize_sequence_parallel

from lightspeed.sequence.dataloader import UlyssesSPDataLoaderAdapter
from lightspeed.sequence.layer import DistributedAttention
from lightspeed.sequence.loss import sequence_parallel_loss
from lightspeed.sequence.transform import apply_sequence_parallel
from lightspeed.sequence.ulysses_hf import UlyssesSPAttentionHF

__all__ = ["DistributedAttention", "initialize_sequence_parallel", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "apply_sequence_parallel",
           "sequence_parallel_loss"]
