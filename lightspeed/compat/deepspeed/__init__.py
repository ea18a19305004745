"""`deepspeed`, as lightspeed provides it after `lightspeed.register_as_deepspeed()`.

Thin re-exports and adapters of lightspeed's own objects under DeepSpeed's names and signatures; no
logic of its own. Submodules (`comm`, `zero`, `accelerator`, `runtime`, `ops`, `utils`, `checkpoint`,
`checkpointing`, `compression`, `elasticity`, `launcher`, `moe`, `pipe`, `sequence`) load on first use, so
`import deepspeed` stays light. A DeepSpeed name whose feature lightspeed has not built exists and
raises NotImplementedError naming that feature when called (`_missing.py`).
"""

from __future__ import annotations

import importlib

from lightspeed.compat.registration import DEEPSPEED_VERSION
from lightspeed.config.arguments import add_config_arguments

__version__ = DEEPSPEED_VERSION
version = DEEPSPEED_VERSION
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in DEEPSPEED_VERSION.split("."))
__git_hash__ = None
__git_branch__ = None
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
dist = None  # DeepSpeed's top-level placeholder, None in DeepSpeed too (its modules import deepspeed.comm)

_SUBMODULES = ("accelerator", "checkpoint", "checkpointing", "comm", "compression", "elasticity", "launcher", "moe",
               "ops", "pipe", "runtime", "sequence", "utils", "zero")
# name -> (module, attribute), imported on first access
_LAZY = {
    "DeepSpeedEngine": ("lightspeed.compat.deepspeed.runtime.engine", "DeepSpeedEngine"),
    "DeepSpeedHybridEngine": ("lightspeed.compat.deepspeed.runtime.hybrid_engine", "DeepSpeedHybridEngine"),
    "DeepSpeedConfig": ("lightspeed.compat.deepspeed.runtime.config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": ("lightspeed.compat.deepspeed.runtime.config", "DeepSpeedConfigError"),
    "get_accelerator": ("lightspeed.compat.deepspeed.accelerator", "get_accelerator"),
    "OnDevice": ("lightspeed._utils.init_on_device", "OnDevice"),
    "logger": ("lightspeed.compat.deepspeed.utils", "logger"),
    "log_dist": ("lightspeed.compat.deepspeed.utils", "log_dist"),
    "PipelineModule": ("lightspeed.compat.deepspeed.pipe", "PipelineModule"),
    "PipelineEngine": ("lightspeed.runtime.pipe_engine", "PipelineEngine"),
    "DeepSpeedOptimizerCallable": ("lightspeed.compat.deepspeed.runtime.engine", "DeepSpeedOptimizerCallable"),
    "DeepSpeedSchedulerCallable": ("lightspeed.compat.deepspeed.runtime.engine", "DeepSpeedSchedulerCallable"),
    "MUON_OPTIMIZER": ("lightspeed.compat.deepspeed.runtime.config", "MUON_OPTIMIZER"),
    "git_hash": ("lightspeed.compat.deepspeed.git_version_info", "git_hash"),
    "git_branch": ("lightspeed.compat.deepspeed.git_version_info", "git_branch"),
}
# DeepSpeed names whose feature lightspeed has not built: name -> the feature, named in the error
_NOT_BUILT_CLASSES = {
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer layer kernels (deepspeed.ops.transformer)",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer layer kernels (deepspeed.ops.transformer)",
    "DualPipeVEngine": "the DualPipeV pipeline schedule",
    "DualPipeVModule": "the DualPipeV pipeline schedule",
    "DeepSpeedDataLoader": "constructing DeepSpeed's data loader class directly (engine.deepspeed_io builds the "
                           "loader)",
    "InferenceEngine": "constructing DeepSpeed's InferenceEngine directly (deepspeed.init_inference prepares the "
                       "model and returns it)",
}
_NOT_BUILT_FUNCTIONS = {
    "replace_transformer_layer": "kernel injection (module_inject.replace_transformer_layer)",
    "set_autotp_mode": "AutoTP's module-injection mode switch (tp_model_init and tensor_parallel.autotp_size "
                       "shard for training)",
}


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """`deepspeed.initialize`: returns `(engine, optimizer, training_dataloader, lr_scheduler)`;
    see `lightspeed.initialize` (the same call, in DeepSpeed's argument order). The optimizer is an
    `EngineOptimizer` view of `engine.optimizer` with DeepSpeed's `overflow` flag; with ZeRO, fp16 or bf16
    (where DeepSpeed's `engine.optimizer` is its wrapper) `engine.optimizer` becomes that view too, its
    `.optimizer` the base optimizer. At ZeRO stage 3,
    `engine.optimizer.parameter_offload` is DeepSpeed's owner of the module hooks, as a view over the
    engine (runtime/zero/parameter_offload.py)."""
    from lightspeed.hybrid import initialize as _initialize
    from lightspeed.runtime.engine_optimizer import EngineOptimizer

    engine, optimizer, loader, scheduler = _initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
        lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
        collate_fn=collate_fn, config=config, config_params=config_params, mesh_param=mesh_param)
    from lightspeed.compat.deepspeed.runtime.zero.parameter_offload import attach

    # DeepSpeed returns its wrapped optimizer, whose `overflow` says whether the last step was skipped
    view = EngineOptimizer.of(engine) if optimizer is not None else None
    if view is not None and (engine.zero_optimization_stage() > 0 or engine.fp16_enabled() or engine.bfloat16_enabled()):
        # where DeepSpeed wraps the optimizer (ZeRO, fp16, bf16), its `engine.optimizer` is that wrapper, whose
        # `.optimizer` is the base optimizer: the view is both (it steps nothing itself)
        engine.optimizer = view
    attach(engine)  # stage 3: engine.optimizer.parameter_offload, as DeepSpeed's stage-3 optimizer has
    return engine, view, loader, scheduler


def init_distributed(dist_backend=None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout=None, init_method=None, dist_init_required=None, config=None,
                     rank: int = -1, world_size: int = -1):
    """`deepspeed.init_distributed`; see `lightspeed.comm.init.init_distributed`."""
    from lightspeed.comm import init_distributed as _init_distributed

    return _init_distributed(dist_backend=dist_backend, auto_mpi_discovery=auto_mpi_discovery,
                             distributed_port=distributed_port, verbose=verbose, timeout=timeout,
                             init_method=init_method, dist_init_required=dist_init_required, config=config,
                             rank=rank, world_size=world_size)


def init_inference(model, config=None, **kwargs):
    """`deepspeed.init_inference`; see `lightspeed.init_inference`."""
    from lightspeed.inference import init_inference as _init_inference

    return _init_inference(model, config, **kwargs)


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """`deepspeed.tp_model_init`; see `lightspeed.tp_model_init`."""
    import lightspeed

    return lightspeed.tp_model_init(model, tp_size, dtype, config=config, **kwargs)


def set_optimizer_flags(config_class, model) -> None:
    """`deepspeed.set_optimizer_flags`: with the Muon optimizer configured (`config_class.optimizer_name`
    "muon"), tags each parameter `use_muon` (matrices not named embed / lm_head, as `initialize` does) and
    `muon_num_heads = None`; otherwise nothing. Per-head Muon is refused."""
    if getattr(config_class, "optimizer_name", None) != "muon":
        return
    if (getattr(config_class, "optimizer_params", None) or {}).get("per_head_muon", False):
        raise NotImplementedError("deepspeed.set_optimizer_flags: per-head Muon (optimizer.params.per_head_muon) is "
                                  "not implemented in lightspeed yet")
    from lightspeed.optim.muon import tag_muon_params

    tag_muon_params(model)
    for p in model.parameters():
        p.muon_num_heads = None


def __getattr__(name: str):
    if name in _NOT_BUILT_CLASSES or name in _NOT_BUILT_FUNCTIONS:
        from lightspeed.compat.deepspeed._missing import missing_class, missing_function

        if name in _NOT_BUILT_CLASSES:
            value = missing_class(f"deepspeed.{name}", _NOT_BUILT_CLASSES[name])
        else:
            value = missing_function(f"deepspeed.{name}", _NOT_BUILT_FUNCTIONS[name])
        globals()[name] = value  # one object per name: `deepspeed.X is deepspeed.X`
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'deepspeed' (lightspeed {__name__}) has no attribute {name!r}")


__all__ = ["DeepSpeedConfig", "DeepSpeedEngine", "DeepSpeedHybridEngine", "OnDevice", "add_config_arguments",
           "get_accelerator", "init_distributed", "init_inference", "initialize", "logger", "set_optimizer_flags",
           "tp_model_init",
           "__version__", *_SUBMODULES]
