"""`OffloadPolicy`: where ZeRO keeps the optimizer's fp32 state and the stage-3 parameter shards.

A frozen value built once from ``zero_optimization.offload_optimizer`` / ``offload_param`` and the
``aio`` section, and handed to the strategies (as FSDP2's ``CPUOffloadPolicy``): the strategies ask it
where a tensor goes and never read the config. Owns: DeepSpeed's rules across those keys, and host
allocation (pinned when the compute device is CUDA and ``pin_memory`` is set). Must not: move data or
know a ZeRO stage's layout.

DeepSpeed's keys and meaning:
    offload_optimizer.device      "cpu": the fp32 master shard and optimizer state live in host memory
                                  and a CPU optimizer steps them; "nvme": they live in swap files under
                                  `nvme_path` and are read into host memory one sub-group at a time
    offload_optimizer.ratio       fraction of the optimizer work offloaded (stage 3 only; the rest of
                                  the sub-groups stay on the device: DeepSpeed's Offload++)
    offload_param.device          stage 3: the low-precision parameter shards live in host memory
                                  ("cpu") or in swap files ("nvme") and are copied to the device when
                                  their group is gathered
    offload_param.max_in_cpu      with "nvme": parameter elements kept in host memory (not swapped)
    sub_group_size                elements of one optimizer sub-group (the unit of a CPU step, and of
                                  an NVMe swap)
    aio.*                         the swap IO: block_size (bytes per request, the O_DIRECT alignment
                                  unit), thread_count (IO threads), queue_depth (requests in flight)

``offload_optimizer.super_offload`` (DeepSpeed's SuperOffload, there for stage 3 on Grace Hopper,
honoured here on any host and at stages 1-3): the CPU step runs during backward speculatively and is
rolled back when the step clips or overflows (offload/speculative.py): by undoing the Adam step
algebraically (``offload_optimizer.super_offload_rollback: "inverse"``, lightspeed's own key, DeepSpeed's
way, the default for fp32 Adam/AdamW) or by restoring copies taken before each range stepped ("copy":
bitwise, the default for the other CPU optimizers).

Beyond DeepSpeed (off by default): ``offload_optimizer.overlap_step`` runs the CPU optimizer step in
the background while the next forward and backward run, so parameters lag one step behind the
gradients (the one-step-delayed parameter update of the ZeRO-Offload paper). DeepSpeed has no key for
this outside ZenFlow (whose ``zenflow.overlap_step`` comes with its top-k selective update); the key
keeps ZenFlow's word for the same idea.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightspeed._utils.logging import get_logger
from lightspeed._utils.pinned import page_locked_empty
from lightspeed.config.errors import ConfigError
from lightspeed.offload.zenflow_config import ZenFlowOptions

logger = get_logger(__name__)

DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class AioOptions:
    """The swap IO of NVMe offload (DeepSpeed's ``aio`` section)."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the optimizer state and (stage 3) the parameter shards live. The default offloads nothing."""

    optimizer: str = "none"  # "none" | "cpu" | "nvme"
    param: str = "none"
    optimizer_nvme_path: str | None = None
    param_nvme_path: str | None = None
    optimizer_pin_memory: bool = False
    param_pin_memory: bool = False
    optimizer_buffer_count: int = 4
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    ratio: float = 1.0
    sub_group_size: int = 1_000_000_000
    overlap_step: bool = False
    overlap_step_warmup: int = 0  # synchronous steps before the delayed update begins
    super_offload: bool = False  # the speculative CPU step during backward (offload/speculative.py)
    super_offload_rollback: str | None = None  # "inverse" | "copy" | None (inverse where the optimizer has one)
    zenflow: ZenFlowOptions | None = None  # ZenFlow's selective update (zero/zenflow.py)
    aio: AioOptions = field(default_factory=AioOptions)

    def __post_init__(self):
        for name in ("optimizer", "param"):
            if getattr(self, name) not in DEVICES:
                raise ConfigError(f"zero_optimization.offload_{name}.device: must be one of {DEVICES}")
        if self.optimizer == "nvme" and not self.optimizer_nvme_path:
            raise ConfigError('zero_optimization.offload_optimizer.nvme_path: is required when device is "nvme"')
        if self.param == "nvme" and not self.param_nvme_path:
            raise ConfigError('zero_optimization.offload_param.nvme_path: is required when device is "nvme"')
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError("zero_optimization.offload_optimizer.ratio: must be in [0, 1]")
        if self.overlap_step_warmup and not self.overlap_step:
            raise ConfigError("zero_optimization.offload_optimizer.overlap_step_warmup: needs overlap_step true")
        if self.super_offload and (self.optimizer != "cpu" or self.overlap_step):
            raise ConfigError("zero_optimization.offload_optimizer.super_offload: needs offload_optimizer.device "
                              f'"cpu" (got "{self.optimizer}") and no overlap_step (it steps during backward)')
        if self.super_offload_rollback not in (None, "inverse", "copy"):
            raise ConfigError('zero_optimization.offload_optimizer.super_offload_rollback: must be "inverse" or '
                              f'"copy" (got {self.super_offload_rollback!r})')
        if self.overlap_step and self.optimizer != "cpu":
            raise ConfigError("zero_optimization.offload_optimizer.overlap_step: needs offload_optimizer.device "
                              f'"cpu" (got "{self.optimizer}")')

    # ------------------------------------------------------------------ what is offloaded
    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer != "none"

    @property
    def offloads_params(self) -> bool:
        return self.param != "none"

    @property
    def enabled(self) -> bool:
        return self.offloads_optimizer or self.offloads_params

    # ------------------------------------------------------------------ host memory
    @staticmethod
    def host_device() -> torch.device:
        return torch.device("cpu")

    def host_empty(self, numel: int, dtype: torch.dtype, compute_device: torch.device, *, pin: bool) -> torch.Tensor:
        """An uninitialised host tensor; page-locked when `pin` and the compute device is CUDA (the
        copies to and from the device then run asynchronously), at its exact size (torch's pinned
        allocator would round it up to a power of two: `_utils/pinned.py`)."""
        if pin and compute_device.type == "cuda" and torch.cuda.is_available():
            return page_locked_empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device="cpu")

    def host_copy(self, src: torch.Tensor, dtype: torch.dtype, compute_device: torch.device, *, pin: bool) -> torch.Tensor:
        """A host copy of `src` (any device) in `dtype`, always a separate buffer."""
        out = self.host_empty(src.numel(), dtype, compute_device, pin=pin)
        out.copy_(src.reshape(-1))
        return out

    # ------------------------------------------------------------------ from the config
    @classmethod
    def from_config(cls, cfg, local_rank: int = 0) -> "OffloadPolicy":
        """The policy of a validated config; raises ConfigError where a stage cannot honour a block."""
        z = cfg.zero_optimization
        opt, par = z.offload_optimizer, z.offload_param
        opt_device = opt.device if opt is not None else "none"
        par_device = par.device if par is not None else "none"
        if opt_device != "none" and z.stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer: needs ZeRO stage 1, 2 or 3 (got stage 0)")
        if par_device != "none" and z.stage != 3:
            # DeepSpeed reads the block at stage 3 only; below it the parameters stay whole on the device
            logger.warning(f"zero_optimization.offload_param has no effect at ZeRO stage {z.stage} (parameter "
                           "offload needs stage 3): the parameters stay on the device; use offload_optimizer "
                           "for stages 1 and 2")
            par, par_device = None, "none"
        if opt is not None and opt.ratio < 1.0 and z.stage != 3:
            raise ConfigError("zero_optimization.offload_optimizer.ratio: partial offload (ratio < 1) needs ZeRO "
                              "stage 3")
        if opt is not None and opt_device != "none":
            if opt.pipeline_read or opt.pipeline_write:
                raise NotImplementedError("zero_optimization.offload_optimizer.pipeline_read/pipeline_write "
                                          "(DeepSpeed's pipelined optimizer swapping) is not implemented yet")
            if opt.fast_init:
                logger.info("zero_optimization.offload_optimizer.fast_init has no effect: swap files are written "
                            "once, at the first swap-out")
        zenflow = _zenflow(z, opt, opt_device, par_device)
        aio = cfg.aio
        threads = max(int(aio.thread_count), int(aio.intra_op_parallelism))
        if "nvme" in (opt_device, par_device):
            _nvme_notes(aio, opt if opt_device == "nvme" else None, par if par_device == "nvme" else None)
        return cls(
            optimizer=opt_device, param=par_device,
            optimizer_nvme_path=_nvme_path(opt, local_rank), param_nvme_path=_nvme_path(par, local_rank),
            optimizer_pin_memory=bool(opt.pin_memory) if opt is not None else False,
            param_pin_memory=bool(par.pin_memory) if par is not None else False,
            optimizer_buffer_count=int(opt.buffer_count) if opt is not None else 4,
            param_buffer_count=int(par.buffer_count) if par is not None else 5,
            param_buffer_size=int(par.buffer_size) if par is not None else 100_000_000,
            max_in_cpu=int(par.max_in_cpu) if par is not None else 1_000_000_000,
            ratio=float(opt.ratio) if opt is not None else 1.0,
            sub_group_size=int(z.sub_group_size),
            overlap_step=bool(getattr(opt, "overlap_step", False)) if opt is not None else False,
            overlap_step_warmup=int(getattr(opt, "overlap_step_warmup", 0)) if opt is not None else 0,
            super_offload=bool(opt.super_offload) if opt is not None and opt_device != "none" else False,
            super_offload_rollback=getattr(opt, "super_offload_rollback", None) if opt is not None else None,
            zenflow=zenflow,
            aio=AioOptions(block_size=int(aio.block_size), queue_depth=int(aio.queue_depth), thread_count=threads,
                           single_submit=bool(aio.single_submit), overlap_events=bool(aio.overlap_events)))


def _zenflow(z, opt, opt_device: str, par_device: str) -> ZenFlowOptions | None:
    """`zero_optimization.zenflow` validated, with the rules that tie it to the offload keys."""
    if z.zenflow is None:
        return None
    options = ZenFlowOptions.from_dict(dict(z.zenflow))
    if opt_device != "cpu":
        raise ConfigError('zero_optimization.zenflow: needs zero_optimization.offload_optimizer.device "cpu" '
                          f'(got "{opt_device}"); ZenFlow is a form of ZeRO-Offload')
    if par_device != "none":
        raise NotImplementedError("zero_optimization.zenflow with zero_optimization.offload_param is not implemented "
                                  "(the selected columns' step writes the device's low-precision parameters)")
    if opt.super_offload or opt.overlap_step:
        raise ConfigError("zero_optimization.zenflow: cannot be combined with offload_optimizer.super_offload or "
                          "offload_optimizer.overlap_step (use zenflow.overlap_step)")
    if options.pt_reserved_cores_perc != 0.5:
        logger.info("zero_optimization.zenflow.pt_reserved_cores_perc has no effect: the overlapped CPU update is "
                    "a thread of this process, on torch's thread pool")
    return options


def _nvme_notes(aio, opt, par) -> None:
    """NVMe keys with no effect here are said once; GPUDirect Storage is refused."""
    if aio.use_gds:
        raise NotImplementedError("aio.use_gds (GPUDirect Storage) is not implemented yet")
    quiet = []
    if aio.single_submit or not aio.overlap_events:
        quiet.append("aio.single_submit / aio.overlap_events (requests are plain pread/pwrite calls on the IO "
                     "threads)")
    if par is not None:
        quiet.append("offload_param.buffer_count / buffer_size (shards are read straight into their host tensors, "
                     "ahead of use by the stage-3 prefetch)")
    if any(block is not None and block.pin_memory and "pin_memory" in block.model_fields_set for block in (opt, par)):
        quiet.append("pin_memory for swapped tensors (their memory is freed and re-allocated, so never pinned)")
    for what in quiet:
        logger.info("NVMe offload: %s has no effect", what)


def _nvme_path(block, local_rank: int) -> str | None:
    if block is None or block.device != "nvme":
        return None
    if block.nvme_path_per_local_rank:
        paths = list(block.nvme_path_per_local_rank)
        return paths[local_rank % len(paths)]
    return block.nvme_path
