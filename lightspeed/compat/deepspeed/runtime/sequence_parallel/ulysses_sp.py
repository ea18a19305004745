"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: the names accelerate and the HF Trainer use for
DeepSpeed's sequence parallelism (`ParallelismConfig(sp_backend="deepspeed")`), from lightspeed.sequence.
ALST's tiled compute (`TiledMLP`, `SequenceTiledCompute`, `TiledFusedLogitsLoss`) is not built."""

from lightspeed.compat.deepspeed._missing import missing_class, missing_function
from lightspeed.sequence import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

_TILED = "ALST tiled compute (sequence_tiled_compute, TiledMLP, TiledFusedLogitsLoss)"
SequenceTiledCompute = missing_class("deepspeed.runtime.sequence_parallel.ulysses_sp.SequenceTiledCompute", _TILED)
TiledMLP = missing_class("deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP", _TILED)
TiledFusedLogitsLoss = missing_class("deepspeed.runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss", _TILED)
sequence_tiled_compute = missing_function("deepspeed.runtime.sequence_parallel.ulysses_sp.sequence_tiled_compute",
                                          _TILED)

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]
