"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: the names accelerate imports when a run asks for
DeepSpeed's sequence parallelism (`ParallelismConfig(sp_backend="deepspeed")`). Importable, so the
error says what is missing; every use raises NotImplementedError naming the feature."""

_MISSING = ("Ulysses sequence parallelism (DeepSpeed's ALST, sequence_parallel_size > 1) is not implemented in "
            "lightspeed yet")


class UlyssesSPAttentionHF:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"UlyssesSPAttentionHF: {_MISSING}")

    @classmethod
    def register_with_transformers(cls, *args, **kwargs):
        raise NotImplementedError(f"UlyssesSPAttentionHF.register_with_transformers: {_MISSING}")


class UlyssesSPDataLoaderAdapter:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"UlyssesSPDataLoaderAdapter: {_MISSING}")


__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
