"""The registry of config features that parse but are not implemented yet.

One list, `UNIMPLEMENTED`: each entry is a config path, a predicate saying whether the loaded config
turns the feature on, and optionally the text describing the setting. When a feature lands, its
entry is deleted from the list (and nothing else changes). `check_supported(cfg)` names every active
entry at once, e.g. ``zero_optimization.stage=2 is not implemented yet``.

Implemented today, hence absent: the batch triad, steps_per_print, wall_clock_breakdown,
gradient_clipping, prescale_gradients, gradient_predivide_factor, gradient_allreduce_op, optimizer,
scheduler, fp16 (not auto_cast), bf16, low-precision masters (fp16.fp16_master_weights_and_grads,
bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states: ``lightspeed.precision.policy``, which
refuses what DeepSpeed refuses; zero/optimizers.py checks the optimizer and the offload they go with;
bf16.stochastic_rounding, lightspeed's own key, refused by the same two without bf16 masters or an
optimizer that rounds its bf16 writes), optimizer.cuda_graph (lightspeed's own key: ``zero/graphed_step.py``,
which refuses it where the step cannot be captured),
managed_gradient_accumulation (the engine's step() is the boundary), sparse_gradients (stage 0:
``lightspeed.zero.sparse``; refused at stages 1-3 by ``select_strategy``), torch_autocast (``lightspeed.precision.autocast``; its fp16 dtype and a PipelineModule are refused there),
ZeRO stage 0, data_types.grad_accum_dtype,
communication_data_type, checkpoint.tag_validation, checkpoint.writer (type PYTHON, decoupled, show_statistics,
snapshot_pool), checkpoint.format (lightspeed's own key: "deepspeed" saves DeepSpeed's layout,
checkpoint/deepspeed_writer.py), memory_breakdown, dump_state; also
dataloader_drop_last (the engine's deepspeed_io) and data_types.param_dtype (checked against the
precision mode by ``lightspeed.precision.policy``), data_types.buffer_dtype and data_types.keep_in_fp32_modules
(``lightspeed.precision.module_dtypes``); the tensorboard, csv_monitor, wandb and comet
monitors (``lightspeed.monitor``), flops_profiler (``lightspeed.profiling``), the one-bit optimizers
(OneBitAdam, ZeroOneAdam, OneBitLamb), comms_logger, sequence_parallel_size (Ulysses, ``lightspeed.sequence``),
ZeRO++ at stage 3 (zero_quantized_weights, zero_quantized_nontrainable_weights, zero_quantized_gradients,
zero_hpz_partition_size; ``lightspeed.comm.zeropp``; its LoCo error feedback, zeropp_loco_param, stays below);
compile (enabled, backend, kwargs) and float8 (``config/compiler.py``), less DeepCompile's keys, which are
refused below; expert_parallel (AutoEP, ``lightspeed.parallel.experts.autoep``, which refuses its own
unbuilt keys); the hybrid engine (``hybrid_engine``, ``lightspeed.hybrid``, inference_tp_size and
enable_cuda_graph included) less a tp_gather_partition_size other than the default.
ZeRO-Offload / ZeRO-Infinity (``offload_optimizer``, ``offload_param``, ``aio``) is implemented
(`lightspeed.offload`); its keys that are not are refused by `OffloadPolicy.from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from pydantic import BaseModel

from lightspeed.config.base import as_int, show
from lightspeed.config.model import LightspeedConfig


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else getattr(cfg, part, None)
    return cfg


@dataclass(frozen=True)
class Unimplemented:
    """`path` names the setting; `active(cfg)` is true when the config turns it on; `describe(cfg)`
    replaces the default ``path=value`` text."""

    path: str
    active: Callable[[LightspeedConfig], bool]
    describe: Optional[Callable[[LightspeedConfig], str]] = None

    def message(self, cfg: LightspeedConfig) -> str:
        what = self.describe(cfg) if self.describe else f"{self.path}={show(_get(cfg, self.path))}"
        return f"{what} is not implemented yet"


def _flag(path: str) -> Unimplemented:
    """A boolean (or enabled-switch) setting: active when true."""
    return Unimplemented(path, lambda cfg: _get(cfg, path) is True)


def _set(path: str) -> Unimplemented:
    """A setting (or optional section, then named by its path alone) that is off while None."""

    def describe(cfg):
        value = _get(cfg, path)
        return path if isinstance(value, (dict, BaseModel)) else f"{path}={show(value)}"

    return Unimplemented(path, lambda cfg: _get(cfg, path) is not None, describe)


def _above(path: str, limit: int) -> Unimplemented:
    """An integer setting that is off up to `limit`."""
    return Unimplemented(path, lambda cfg: (as_int(_get(cfg, path)) or limit) > limit)


def _zeropp(entry: Unimplemented) -> Unimplemented:
    """A ZeRO++ setting: built at stage 3, refused at the other stages."""
    return Unimplemented(entry.path, lambda cfg: entry.active(cfg) and cfg.zero_optimization.stage != 3,
                         entry.describe)


IMPLEMENTED_STAGES = (0, 1, 2, 3)  # ZeRO stages the engine runs; the others raise NotImplementedError

UNIMPLEMENTED: list[Unimplemented] = [
    # ZeRO
    Unimplemented("zero_optimization.stage", lambda cfg: cfg.zero_optimization.stage not in IMPLEMENTED_STAGES),
    _flag("zero_optimization.stage3_use_all_reduce_for_fetch_params"),
    _set("zero_optimization.zeropp_loco_param"),
    # ZeRO++ is built for stage 3 (lightspeed.comm.zeropp); DeepSpeed's stages 1 and 2 do not use it either
    _zeropp(_flag("zero_optimization.zero_quantized_weights")),
    _zeropp(_flag("zero_optimization.zero_quantized_nontrainable_weights")),
    _zeropp(_flag("zero_optimization.zero_quantized_gradients")),
    _zeropp(_above("zero_optimization.zero_hpz_partition_size", 1)),
    _above("zero_optimization.mics_shard_size", 0),
    _flag("zero_optimization.mics_hierarchical_params_gather"),
    # Precision
    _flag("fp16.auto_cast"),
    _flag("amp.enabled"),
    # Gradients, communication, optimizer
    # Features
    _flag("checkpoint.load_universal"),
    _flag("checkpoint.use_node_local_storage"),
    _flag("checkpoint.parallel_write.pipeline_stage"),
    Unimplemented(
        "checkpoint.writer.type",
        lambda cfg: cfg.checkpoint.writer is not None and cfg.checkpoint.writer.type != "PYTHON",
        lambda cfg: f"checkpoint.writer.type={show(cfg.checkpoint.writer.type)} (DeepSpeed's "
        + ("DeepNVMe writer through pinned I/O buffers" if cfg.checkpoint.writer.type == "FAST" else "writer that writes nothing")
        + '; "PYTHON", decoupled or not, is built)',
    ),
    _set("checkpoint.writer.data_parallel"),
    _above("checkpoint.writer.io_multiplier", 1),
    Unimplemented("checkpoint.checkpoint_serialization", lambda cfg: cfg.checkpoint.checkpoint_serialization is False,
                  lambda cfg: "checkpoint.checkpoint_serialization=false (torch's legacy, non-zip file format)"),
    # the autotuner calibrates memory from a profiled step itself; DeepSpeed's model-info profile run is not built
    Unimplemented("autotuning.model_info", lambda cfg: cfg.autotuning.enabled and bool(
        (cfg.autotuning.model_info or {}).get("profile")),
        lambda cfg: "autotuning.model_info.profile=true (DeepSpeed's model-info profile run, which writes "
        "autotuning.model_info_path; lightspeed's autotuner calibrates from a profiled step instead)"),
    # the hybrid engine (lightspeed.hybrid) is built, its decode graphs included; gathering in chunks of layers
    # for generation split over tensor-parallel ranks (the whole model is gathered first) is not
    Unimplemented("hybrid_engine.tp_gather_partition_size",
                  lambda cfg: cfg.hybrid_engine.enabled and cfg.hybrid_engine.inference_tp_size > 1
                  and cfg.hybrid_engine.tp_gather_partition_size != 8,
                  lambda cfg: f"hybrid_engine.tp_gather_partition_size={cfg.hybrid_engine.tp_gather_partition_size} "
                  "(the layers gathered in chunks for inference_tp_size > 1; the whole model is gathered before it "
                  "is split, which the default 8 stands for)"),
    _flag("graph_harvesting"),
    _flag("use_data_before_expert_parallelism"),
    _flag("disable_python_gc"),
    # DeepSpeed pins its super-offload CPU Adam worker to this share of the cores; nothing here reads it
    Unimplemented("zero_optimization.offload_optimizer.cpuadam_cores_perc",
                  lambda cfg: cfg.zero_optimization.offload_optimizer is not None
                  and cfg.zero_optimization.offload_optimizer.cpuadam_cores_perc != 0.8),
    # Monitoring and profiling
    _flag("trackio.enabled"),
    # Training-efficiency research features
    Unimplemented(
        "compression_training",
        lambda cfg: bool(cfg.compression_training.enabled_techniques()),
        lambda cfg: "compression_training (" + ", ".join(cfg.compression_training.enabled_techniques()) + ")",
    ),
    _flag("data_efficiency.enabled"),
    _flag("curriculum_learning.enabled"),
    _flag("progressive_layer_drop.enabled"),
    _flag("eigenvalue.enabled"),
    # Sections kept as free dicts (compile is a modelled section: see config/compiler.py)
    Unimplemented(
        "compile.deepcompile",
        lambda cfg: bool(cfg.compile.deepcompile_settings()),
        lambda cfg: "compile.deepcompile (DeepCompile, DeepSpeed's compiler passes; engine.compile() is built; set: "
        + ", ".join(f"{k}={show(v)}" for k, v in cfg.compile.deepcompile_settings().items()) + ")",
    ),
    _flag("tensor_parallel.tp_overlap_comm"),
    _flag("tensor_parallel.vocab_parallel_lm_head"),
    Unimplemented("tensor_parallel.vocab_parallel_ce_backend",
                  lambda cfg: cfg.tensor_parallel.vocab_parallel_ce_backend != "torch"),
    _set("tensor_parallel.injection_policy_tuple"),
    _flag("tensor_parallel.replace_with_kernel_inject"),
    _flag("nebula.enabled"),
    _flag("datastates.enabled"),
    _flag("quantize_training.enabled"),
    _set("weight_quantization"),
]


def unimplemented_features(cfg: LightspeedConfig) -> list[str]:
    """One message per feature the config turns on that lightspeed does not implement yet."""
    return [entry.message(cfg) for entry in UNIMPLEMENTED if entry.active(cfg)]


def check_supported(cfg: LightspeedConfig) -> None:
    """Raise NotImplementedError naming every enabled-but-unimplemented setting of `cfg` at once."""
    raise_unimplemented(unimplemented_features(cfg))


def raise_unimplemented(messages: list[str]) -> None:
    """Raise NotImplementedError naming every message at once (nothing when there is none)."""
    if len(messages) == 1:
        raise NotImplementedError(messages[0])
    if messages:
        raise NotImplementedError(
            f"{len(messages)} config settings are not implemented yet:\n" + "\n".join(f"  {m}" for m in messages)
        )
