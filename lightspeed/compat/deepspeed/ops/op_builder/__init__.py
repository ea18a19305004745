"""`deepspeed.ops.op_builder`: DeepSpeed's builders of its C++/CUDA extensions, by their class names and
`NAME`s. lightspeed builds none of those extensions (its kernels are Triton and PyTorch, and its
optimizers `ops.adam.FusedAdam`, ... are its own), so every builder reports itself incompatible, as
`deepspeed.ops.__compatible_ops__` does, and `load()` raises NotImplementedError naming the op. Code
that checks compatibility before loading (DeepSpeed's tests, which skip) takes its no-extension path."""

from __future__ import annotations


class OpBuilder:
    """A DeepSpeed op builder for an extension lightspeed does not build."""

    NAME = "deepspeed_not_implemented"
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def load(self, verbose: bool = True):
        raise NotImplementedError(f"deepspeed.ops.op_builder {type(self).__name__}: lightspeed builds none of "
                                  f"DeepSpeed's C++/CUDA extensions (op {self.NAME!r})")

    def builder(self):
        return self.load()


# class name -> NAME, DeepSpeed 0.18.2's builders
_BUILDERS = {
    "AsyncIOBuilder": "async_io", "CPUAdagradBuilder": "cpu_adagrad", "CPUAdamBuilder": "cpu_adam",
    "CPULionBuilder": "cpu_lion", "DeepCompileBuilder": "dc", "EvoformerAttnBuilder": "evoformer_attn",
    "FPQuantizerBuilder": "fp_quantizer", "FusedAdamBuilder": "fused_adam", "FusedLambBuilder": "fused_lamb",
    "FusedLionBuilder": "fused_lion", "GDSBuilder": "gds", "InferenceCoreBuilder": "inference_core_ops",
    "InferenceCutlassBuilder": "cutlass_ops", "QuantizerBuilder": "quantizer", "RaggedOpsBuilder": "ragged_device_ops",
    "RaggedUtilsBuilder": "ragged_ops", "RandomLTDBuilder": "random_ltd", "SparseAttnBuilder": "sparse_attn",
    "SpatialInferenceBuilder": "spatial_inference", "StochasticTransformerBuilder": "stochastic_transformer",
    "TransformerBuilder": "transformer", "InferenceBuilder": "transformer_inference", "UtilsBuilder": "utils",
}

for _class_name, _op in _BUILDERS.items():
    globals()[_class_name] = type(_class_name, (OpBuilder,), {
        "NAME": _op, "BUILD_VAR": f"DS_BUILD_{_op.upper()}", "__module__": __name__,
        "__doc__": f"DeepSpeed's builder of the {_op!r} extension (not built by lightspeed)."})

__all__ = ["OpBuilder", *_BUILDERS]
