"""`initialize()`: DeepSpeed's entry point. Builds, in order: the topology (process groups, with the
sequence-parallel ones when `sequence_parallel_size` > 1), the validated config, the precision policy,
the model transforms (model_transforms.py: tensor and sequence parallelism, expert parallelism, activation
checkpointing),
float8 conversion, the fused kernels (kernel_patch.py, the ``kernels`` section), the module on its device and dtype, the optimizer, the sharding strategy, the loss
scaler, the LR scheduler, the monitors and the flops profiler's schedule, and the data loader, and
hands them to the engine."""

from __future__ import annotations

import torch

from lightspeed._utils.device import default_device
from lightspeed._utils.logging import get_logger, set_log_level
from lightspeed.comm import api as comm_api
from lightspeed.comm import comms_logger, heartbeat
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.groups import ParallelGroups
from lightspeed.comm.init import apply_config_timeout, init_distributed
from lightspeed.comm.sequence_groups import build_topology, record_sp_gradient_mean
from lightspeed.comm.topology import Topology, TopologyError, mesh_sizes, record_topology
from lightspeed.config import LightspeedConfig
from lightspeed.config.errors import ConfigError
from lightspeed.config.parse import read_source
from lightspeed.monitor import MonitorMaster
from lightspeed.offload.policy import OffloadPolicy
from lightspeed.ops.adagrad import CPUAdagrad
from lightspeed.ops.adam import CPUAdam
from lightspeed.ops.lion import CPULion
from lightspeed.optim import build_optimizer, build_scheduler
from lightspeed.optim.muon import Muon, muon_updates_before_clip, tag_muon_params
from lightspeed.optim.validation import validate_training_config
from lightspeed.parallel.experts import MoEArgumentError, expert_parallel_size, moe_layers
from lightspeed.parallel.experts.autoep import autoep_mesh_size
from lightspeed.parallel.pipeline import PipelineModule, PipelineParallelGrid, schedule_kind
from lightspeed.parallel.tensor_parallel import split_tp_size
from lightspeed.precision.float8 import convert_to_float8
from lightspeed.precision.loss_scaler import build_loss_scaler
from lightspeed.precision.module_dtypes import cast_module
from lightspeed.precision.policy import policy_from_config
from lightspeed.profiling.step_profiler import StepProfiler
from lightspeed.runtime.engine import LightspeedEngine
from lightspeed.runtime.pipe_engine import PipelineEngine, prepare_tied
from lightspeed.runtime.errors import ArgumentAssertionError
from lightspeed.runtime.kernel_patch import apply_kernels
from lightspeed.runtime.model_transforms import apply_model_transforms
from lightspeed.runtime.param_names import params_by_name, params_from_names
from lightspeed.runtime.strategy import select_strategy, strategy_places_params
from lightspeed.zero.reduce import sp_summed

logger = get_logger(__name__)


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ConfigError("initialize(): pass the config as `config` or `config_params`, not both")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "lightspeed_config", None)
        deepscale = getattr(args, "deepscale_config", None)
        if deepscale is not None:  # DeepSpeed's deprecated spelling of --deepspeed_config
            if from_args is not None:
                raise ConfigError("initialize(): both args.deepspeed_config and the deprecated args.deepscale_config "
                                  "are set; pass one")
            logger.warning("--deepscale_config is deprecated: use --deepspeed_config")
            from_args = deepscale
    if config is not None and from_args is not None:
        raise ConfigError("initialize(): the config is given both as `config` and as `args.deepspeed_config`; "
                          "pass one")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("initialize(): no config given (pass `config=` a dict or a path, or "
                          "`args.deepspeed_config`)")
    return config


def _build_optimizer(optimizer, cfg, module, model_parameters, comm: Communicator, cpu_offload: bool = False):
    params = list(model_parameters) if model_parameters is not None else list(module.parameters())
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer: given both in the config and to initialize(); pass one")
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(params)
    if cfg.optimizer is not None:
        return build_optimizer(cfg.optimizer, params, cpu_offload=cpu_offload, comm=comm)
    return None


def _check_offload_optimizer(optimizer, cfg) -> None:
    """DeepSpeed's rule: with the optimizer offloaded, a client optimizer must be a CPU one (it steps
    the host shards) unless `zero_force_ds_cpu_optimizer` is false."""
    if isinstance(optimizer, (CPUAdam, CPUAdagrad, CPULion)) or not cfg.zero_force_ds_cpu_optimizer:
        return
    raise ConfigError(f"zero_force_ds_cpu_optimizer: the optimizer is offloaded but the client optimizer is "
                      f"{type(optimizer).__name__}, not a CPU optimizer (lightspeed.ops.adam.CPUAdam / "
                      "DeepSpeedCPUAdam, CPUAdagrad, CPULion); pass one of those, name the optimizer in the config, "
                      'or set "zero_force_ds_cpu_optimizer": false to step it on the host shards anyway')


def _build_scheduler(lr_scheduler, cfg, optimizer):
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler: given both in the config and to initialize(); pass one")
    if lr_scheduler is not None:
        is_instance = hasattr(lr_scheduler, "step") and not isinstance(lr_scheduler, type)
        return lr_scheduler if is_instance else lr_scheduler(optimizer)  # a class or factory: build it
    if cfg.scheduler is not None:
        if optimizer is None:
            raise ConfigError("scheduler: needs an optimizer (none in the config and none passed to initialize())")
        return build_scheduler(cfg.scheduler, optimizer)
    return None


def _mesh_sizes(source) -> dict[str, int]:
    """The mesh dims the config asks for, read before it is validated (validation needs the dp size)."""
    raw = source.raw if isinstance(source, LightspeedConfig) else read_source(source)[0]
    try:
        return mesh_sizes(raw)
    except TopologyError as error:
        raise ConfigError(str(error)) from None


def _build_topology(source, mpu, pp: int = 1, ep: int = 1) -> Topology:
    sizes = _mesh_sizes(source)
    raw = source.raw if isinstance(source, LightspeedConfig) else read_source(source)[0]
    autoep = autoep_mesh_size(raw) is not None
    try:
        # the sequence-parallel groups are this process's record (register_with_transformers or the user
        # may have built them before initialize): build_topology keeps the record and the mesh in agreement
        return build_topology(mpu, sp_size=sizes["sp"], tp_size=sizes["tp"], pp_size=pp, ep_size=ep)
    except (TopologyError, ValueError) as error:
        where = f"expert_parallel.autoep_size={ep}: " if autoep and ep > 1 else ""
        raise ConfigError(f"{where}{error}") from None


def _batch_world_size(groups: ParallelGroups, topology: Topology, mpu, pipeline: bool) -> int:
    """The world size of the batch triad (`train_batch_size = micro * accumulation * world`), as
    DeepSpeed 0.19.8's `DeepSpeedConfig` counts it: the data-parallel size when a model-parallel unit
    says it (an `mpu`, or a PipelineModule's grid), else every rank but the sequence-parallel ones, so
    tensor-parallel ranks from `tensor_parallel.autotp_size` count as if they took batches of their own
    (transformers' Trainer fills "auto" as micro x accumulation x every process). The samples a step
    takes are still micro x accumulation x the data-parallel size."""
    if pipeline or mpu is not None:
        return groups.dp_world_size
    return groups.dp_world_size * topology.size("tp")


def _expert_parallel_size(source, model: torch.nn.Module) -> int:
    """The mesh's ep dim: `expert_parallel.autoep_size` with AutoEP on (parallel/experts/autoep.py), else
    the ep_size of the model's MoE layers (parallel/experts/transform.py)."""
    raw = source.raw if isinstance(source, LightspeedConfig) else read_source(source)[0]
    size = autoep_mesh_size(raw)
    if size is None:
        return _stages_agreed_ep_size(model) if isinstance(model, PipelineModule) else expert_parallel_size(model)
    if expert_parallel_size(model) != 1:
        raise ConfigError("expert_parallel.enabled: the model holds DeepSpeed MoE layers with ep_size > 1; AutoEP is "
                          "for Hugging Face MoE models, turn one off")
    return size


def _stages_agreed_ep_size(model: PipelineModule) -> int:
    """The ep size of a PipelineModule's MoE layers, agreed over the world (a collective): each rank
    built only its stage's layers, and a stage without MoE layers still needs the mesh the others do."""
    if not comm_api.is_initialized() or comm_api.get_world_size() == 1:
        return expert_parallel_size(model)
    local = sorted({layer.ep_size for _, layer in moe_layers(model)})  # a disagreement is raised on every rank
    sizes = [None] * comm_api.get_world_size()
    comm_api.all_gather_object(sizes, local)
    asked = sorted({size for ranks in sizes for size in ranks})
    if len(asked) > 1:
        raise MoEArgumentError(f"MoE layers with different ep_size over the pipeline stages ({asked}): lightspeed "
                               "builds one expert-parallel group per run, so every MoE layer needs the same ep_size")
    return asked[0] if asked else 1


def _pipeline_stages(model: PipelineModule, cfg, topology: Topology, optimizer, model_parameters):
    """The pipeline config applied to the module: the activation checkpoint interval (DeepSpeed's engine
    overrides the module's when the config sets one) and the stages per rank of the schedule; returns
    `model_parameters` followed through a repartition by name."""
    if cfg.pipeline.activation_checkpoint_interval > 0:
        model.set_checkpoint_interval(cfg.pipeline.activation_checkpoint_interval)
    try:
        virtual = cfg.pipeline.stages_per_rank()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if virtual == 1:
        return model_parameters
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"pipeline.schedule: {cfg.pipeline.schedule} repartitions the PipelineModule into "
                          f"{virtual} stages per rank, so an optimizer built from its parameters would hold stale "
                          "ones; let the config (or a callable) build the optimizer")
    named = params_by_name(model, model_parameters) if model_parameters is not None else None
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if named is not None and (not named or isinstance(named[0], dict) or set(named) != trainable):
        raise ConfigError(f"pipeline.schedule: {cfg.pipeline.schedule} repartitions the PipelineModule into "
                          f"{virtual} stages per rank; model_parameters other than all its trainable parameters "
                          "cannot follow the repartition (pass none, or every trainable parameter)")
    model.set_virtual_stages(topology.rank("pp"), topology.size("pp"), virtual,
                             schedule_kind(cfg.pipeline.schedule).order)
    return None if named is None else [p for p in model.parameters() if p.requires_grad]


def _place(model: torch.nn.Module, device: torch.device, policy, cast_params: bool = True) -> None:
    """The model on its device, its parameters (unless a stage-3 strategy holds them) and buffers in their
    dtypes for training: precision/module_dtypes.py's rules (buffers keep theirs unless data_types.buffer_dtype;
    data_types.keep_in_fp32_modules keeps the model's listed buffers in fp32)."""
    model.to(device=device)
    cast_module(model, policy.param_dtype, policy.buffer_dtype, policy.keep_in_fp32, cast_params=cast_params)


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, config_params=None,
               mesh_param=None, hybrid_engine_class: type[LightspeedEngine] | None = None):
    """Returns `(engine, optimizer, training_dataloader, lr_scheduler)`, as `deepspeed.initialize`.

    `config` (or `config_params`, or `args.deepspeed_config`) is a dict, a JSON/HJSON file path or a
    JSON string; `optimizer` and `lr_scheduler` may be instances, callables, or come from the config.
    `hybrid_engine_class`: the engine built when `hybrid_engine.enabled` is true (lightspeed.hybrid's
    `HybridEngine`, which `lightspeed.initialize` passes; this layer cannot import it).
    """
    if model is None:
        raise ArgumentAssertionError("initialize(): `model` is required")
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=...) (sequence/tensor-parallel meshes) is not implemented")
    source = _config_source(args, config, config_params)
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    pipeline = isinstance(model, PipelineModule)
    if pipeline and isinstance(mpu, PipelineParallelGrid):  # the module's own grid (`model.mpu()`): the mesh's groups
        mpu = None
    topology = _build_topology(source, mpu, pp=model.num_stages if pipeline else 1, ep=_expert_parallel_size(source,
                                                                                                         model))
    record_topology(topology)  # for deepspeed.utils.groups' argument-less functions
    groups = ParallelGroups.from_topology(topology)
    cfg = validate_training_config(source, _batch_world_size(groups, topology, mpu, pipeline)).raise_for_errors()
    if cfg.hybrid_engine.enabled:
        if pipeline:
            raise ConfigError("hybrid_engine.enabled: the hybrid engine generates with a whole model; a PipelineModule "
                              "is not supported (DeepSpeed builds its pipeline engine instead)")
        if hybrid_engine_class is None:
            raise ConfigError("hybrid_engine.enabled: lightspeed.runtime.initialize builds training engines only; "
                              "call lightspeed.initialize (or deepspeed.initialize), which builds the hybrid engine")
    if cfg.log_level is not None:  # DeepSpeed sets its logger's level from the config at engine start
        set_log_level(cfg.log_level)
    apply_config_timeout(cfg.comm.timeout_seconds)
    heartbeat.set_stall_seconds(cfg.comm.stall_seconds)
    policy = policy_from_config(cfg)
    splits_model = cfg.tensor_parallel.tp_size > 1 and split_tp_size(model) == 1
    if splits_model and isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("tensor_parallel.autotp_size: initialize() splits the model, so an optimizer built from "
                          "the whole model would hold stale parameters; let the config (or a callable) build the "
                          "optimizer, pass model_parameters, or split the model first with tp_model_init()")
    # DeepSpeed reads model_parameters after its split: follow the model's parameters through it by name
    named_parameters = params_by_name(model, model_parameters) if splits_model and model_parameters is not None \
        else None
    if pipeline:
        model_parameters = _pipeline_stages(model, cfg, topology, optimizer, model_parameters)
    model, placements = apply_model_transforms(model, cfg, topology)
    if pipeline:
        placements = model.placements(placements, topology.size("pp"))
    if named_parameters is not None:
        model_parameters = params_from_names(model, named_parameters)
    convert_to_float8(model, cfg.float8)  # after the split layers exist, before anything is placed or sharded
    apply_kernels(model, cfg.kernels)  # fused kernels: classes swapped in place, before placing or sharding
    offload = OffloadPolicy.from_config(cfg, groups.local_rank)
    device = default_device(groups.local_rank)
    places_params = strategy_places_params(cfg)  # stage 3 shards the params onto the device itself
    if not places_params:
        if any(p.is_meta or getattr(p, "ds_shape", None) is not None for p in model.parameters()):
            raise ConfigError(f"zero_optimization.stage: a model built under lightspeed.zero.Init (partitioned or meta "
                              f"parameters) needs stage 3 (got {cfg.zero_optimization.stage})")
        _place(model, device, policy)
    client_optimizer = optimizer is not None
    # engine.optimizer_name(), as DeepSpeed's: the class of what the caller passed ("function" for a callable)
    client_optimizer_name = type(optimizer).__name__ if client_optimizer else None
    # ZeRO partitions and reduces over dp x sp (the dp group while sp is 1): comm/topology.py's Note
    comm = Communicator(topology.grad_reduce_group, topology.size("dp_sp"))
    comms_logger.configure(cfg.comms_logger)
    if cfg.optimizer is not None and cfg.optimizer.name == "muon":
        tag_muon_params(model)  # DeepSpeed's set_optimizer_flags: which parameters Muon steps
    optimizer = _build_optimizer(optimizer, cfg, model, model_parameters, comm, cpu_offload=offload.offloads_optimizer)
    if client_optimizer and offload.offloads_optimizer:
        _check_offload_optimizer(optimizer, cfg)
    if pipeline:
        prepare_tied(model, topology, device, cfg.zero_optimization.stage)
    strategy = select_strategy(cfg, model, optimizer, policy, comm, device=device, offload=offload,
                               placements=placements, topology=topology)
    if topology.size("sp") > 1:  # sequence/loss.py weights each rank's share by it
        record_sp_gradient_mean(cfg.gradient_allreduce_op == "mean"
                                and sp_summed(cfg.zero_optimization.stage, topology.size("sp")) == 1)
    if optimizer is not None:
        strategy.use_placements(placements, topology)  # the gradient norm over the mesh (zero/norm.py)
    if isinstance(optimizer, Muon) and cfg.checkpoint.format == "deepspeed":
        raise ConfigError("checkpoint.format: DeepSpeed's layout of the Muon optimizer's state is not written by "
                          "lightspeed; save in lightspeed's format (it resumes at any world size and stage)")
    if isinstance(optimizer, Muon):  # whole matrices from the pieces the strategy holds (optim/muon.py)
        optimizer.attach(strategy.fragments(), comm, update_before_clip=muon_updates_before_clip(cfg, policy))
    if places_params:
        _place(model, device, policy, cast_params=False)  # the buffers: the parameters are the strategy's
    strategy.broadcast_from_rank0(model)
    loss_scaler = build_loss_scaler(cfg.fp16, stage0=cfg.zero_optimization.stage == 0) if cfg.fp16.enabled else None
    lr_scheduler = _build_scheduler(lr_scheduler, cfg, optimizer)
    monitor = MonitorMaster(cfg, rank=groups.world_rank)
    samples = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * groups.dp_world_size
    step_profiler = StepProfiler(cfg.flops_profiler, model, rank=groups.world_rank, run={
        "world size": groups.world_size, "data parallel size": groups.dp_world_size,
        "batch size per GPU": cfg.train_micro_batch_size_per_gpu,
        "gradient accumulation steps": cfg.gradient_accumulation_steps, "samples per step": samples})
    engine_class = PipelineEngine if pipeline else hybrid_engine_class if cfg.hybrid_engine.enabled \
        else LightspeedEngine
    engine = engine_class(module=model, config=cfg, groups=groups, comm=comm, device=device, policy=policy,
                              strategy=strategy, optimizer=optimizer, lr_scheduler=lr_scheduler,
                              loss_scaler=loss_scaler, monitor=monitor, step_profiler=step_profiler,
                              placements=placements)
    engine._client_optimizer_name = client_optimizer_name
    if cfg.compile.enabled:  # DeepSpeed's first compile section: compile at initialize()
        engine.compile(backend=cfg.compile.backend, compile_kwargs=cfg.compile.kwargs)
    dataloader = None
    if training_data is not None:
        sampler = None
        if pipeline and not isinstance(training_data, torch.utils.data.IterableDataset):
            # DeepSpeed's PipelineEngine reads its training data in order (DistributedSampler, shuffle=False)
            sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=groups.dp_world_size,
                                                          rank=groups.dp_rank, shuffle=False)
        dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn, data_sampler=sampler)
        engine.training_dataloader = dataloader
        if hasattr(dataloader, "__len__"):  # ZenFlow's "epoch" selection (in steps)
            engine.strategy.set_steps_per_epoch(max(1, len(dataloader) // cfg.gradient_accumulation_steps))
    logger.info("engine ready: ZeRO stage %d, %s params, dp_world_size %d, sp %d, micro batch %d x %d accumulation "
                "steps = %d global, device %s", cfg.zero_optimization.stage, policy.param_dtype,
                groups.dp_world_size, groups.sp_world_size, cfg.train_micro_batch_size_per_gpu,
                cfg.gradient_accumulation_steps, samples, device)
    return engine, optimizer, dataloader, lr_scheduler
