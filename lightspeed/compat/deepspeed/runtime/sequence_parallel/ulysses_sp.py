"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: the names accelerate imports when a run asks for
DeepSpeed's sequence parallelism (`ParallelismConfig(sp_backend="deepspeed")`). Importable, so the
error says what is missing; every use raises NotImplementedError naming the feature."""

from lightspeed.compat.deepspeed._missing import missing_class, missing_function

_FEATURE = "Ulysses sequence parallelism (DeepSpeed's ALST, sequence_parallel_size > 1)"

UlyssesSPAttentionHF = missing_class("deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF", _FEATURE)
UlyssesSPAttentionHF.register_with_transformers = staticmethod(missing_function(
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF.register_with_transformers", _FEATURE))
UlyssesSPDataLoaderAdapter = missing_class(
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter", _FEATURE)

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
