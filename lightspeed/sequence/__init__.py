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
"""

from lightspeed.comm.sequence_groups import initialize_sequence_parallel

from lightspeed.sequence.dataloader import UlyssesSPDataLoaderAdapter
from lightspeed.sequence.layer import DistributedAttention
from lightspeed.sequence.loss import sequence_parallel_loss
from lightspeed.sequence.transform import apply_sequence_parallel
from lightspeed.sequence.ulysses_hf import UlyssesSPAttentionHF

__all__ = ["DistributedAttention", "initialize_sequence_parallel", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "apply_sequence_parallel",
           "sequence_parallel_loss"]
