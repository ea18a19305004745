"""The torch.distributed.pipelining pieces the pipeline schedule driver (parallel/pipeline/schedule.py)
stands on: a `PipelineStage` whose gradient-writing backwards are bracketed for the ZeRO strategy,
torch's schedule classes by name (1F1B over gloo with its receives posted ahead), and the
point-to-point sends of the driver's shape probe.

Owns: those, and nothing of the schedule's policy. Must not: know ZeRO or the pipeline module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)


def _posted_recv_supported() -> bool:
    """Whether this torch's private schedule helpers have the signatures `PostedRecv1F1B` calls (they are
    torch 2.13's; another release keeps torch's own 1F1B, with the same numerics)."""
    import inspect

    try:
        base = torch_schedules.Schedule1F1B
        step = inspect.signature(base._step_microbatches).parameters
        loss = inspect.signature(base._maybe_compute_loss).parameters
        init = inspect.signature(base._initialize_stage).parameters
        helpers = all(hasattr(torch_schedules, n) for n in ("_batch_p2p", "_wait_batch_p2p"))
    except (AttributeError, TypeError, ValueError):
        return False
    return helpers and "return_outputs" in step and "loss_kwargs" in step and len(loss) == 6 and len(init) == 5


_POSTED_RECV = _posted_recv_supported()


def schedule_class(name: str, group=None):
    """torch.distributed.pipelining's schedule class `name` (e.g. "Schedule1F1B"); for 1F1B when
    `group` (the pipeline's process group) runs on gloo, `PostedRecv1F1B` (its Note) where this torch's
    private helpers are the ones it was written against."""
    if name == "Schedule1F1B" and dist.get_backend(group) == "gloo":
        if _POSTED_RECV:
            return PostedRecv1F1B
        logger.info("pipeline: torch %s's private schedule helpers differ from those PostedRecv1F1B calls; "
                    "1F1B over gloo runs torch's Schedule1F1B (the same numerics, receives posted late)",
                    torch.__version__)
    return getattr(torch_schedules, name)


class PostedRecv1F1B(torch_schedules.Schedule1F1B):
    """torch's 1F1B (one stage per rank, the same actions in the same order) with its point-to-point
    messages issued for gloo.

    Note: [receives posted ahead] torch's 1F1B posts each receive just before it needs the data,
    batched with the send it just produced, and waits for both. Over gloo a point-to-point message
    is a rendezvous: the payload moves (in gloo's own threads) only once both sides have posted, so
    each wait spans the peer's post, and on a loaded CPU every such hand-off costs a scheduler wake-up
    (up to a tick) on the critical path. Here every receive of the batch is posted at its start (each
    micro-batch has its own receive buffers), each send is posted as soon as its tensor exists and
    waited for two sends later (by then received: this only bounds the tensors kept alive for gloo),
    so a rank waits only for data not yet produced (on a shared 2-core CPU, 5-20% off
    benchmarks/pipeline.py's tiny-model step at pp=2). NCCL runs a pair's
    operations in order on one stream, where a receive posted early would hold up the sends behind
    it: there torch's own order stays."""

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        stage, n = self._stage, self._n_microbatches
        # every receive of the batch, in micro-batch order (the peer sends in that order)
        fwd_recvs = [torch_schedules._batch_p2p(stage.get_fwd_recv_ops(k)) for k in range(n)]
        bwd_recvs = [torch_schedules._batch_p2p(stage.get_bwd_recv_ops(k)) for k in range(n)]
        sends: list[list] = []  # the works of the sends in flight, oldest first

        def send(ops: list) -> None:
            if ops:
                sends.append(torch_schedules._batch_p2p(ops))
            if len(sends) > 2:  # long since received (the peer posted its receives): bounds what stays alive
                torch_schedules._wait_batch_p2p(sends.pop(0))

        def forward(k: int) -> None:
            torch_schedules._wait_batch_p2p(fwd_recvs[k])
            out = stage.forward_one_chunk(k, arg_mbs[k], kwarg_mbs[k], save_forward_output=return_outputs)
            send(stage.get_fwd_send_ops(k))
            self._maybe_compute_loss(stage, out, target_mbs, k, loss_kwargs)

        def backward(k: int) -> None:
            torch_schedules._wait_batch_p2p(bwd_recvs[k])
            stage.backward_one_chunk(k, loss=self._maybe_get_loss(stage, k), last_backward=k == n - 1)
            send(stage.get_bwd_send_ops(k))

        # torch's 1F1B order: as many forwards as stages from here to the last, then one backward and
        # one forward in turn, then the remaining backwards
        warmup = min(n, self._num_stages - stage.stage_index)
        for k in range(warmup):
            forward(k)
        for k in range(n):
            backward(k)
            if warmup + k < n:
                forward(warmup + k)
        for works in sends:
            torch_schedules._wait_batch_p2p(works)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(n if self.scale_grads else 1)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def example_of(t: torch.Tensor) -> torch.Tensor:
    """A detached example of `t` carrying whether the schedule sends a gradient back for it."""
    out = t.detach()
    return out.requires_grad_(out.is_floating_point())


def send_tensors(tensors: tuple, dst: int) -> None:
    dist.send(torch.tensor([len(tensors)], dtype=torch.int64, device=tensors[0].device), dst)
    for t in tensors:
        if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise TypeError(f"a pipeline stage output of dtype {t.dtype} and {t.dim()} dims cannot be sent")
        header = [_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_MAX_DIMS - t.dim())
        dist.send(torch.tensor(header, dtype=torch.int64, device=t.device), dst)
        dist.send(t.detach().contiguous(), dst)


def recv_tensors(src: int, device: torch.device) -> tuple:
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src)
    out = []
    for _ in range(int(count)):
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        dist.recv(header, src)
        h = header.tolist()
        buf = torch.empty(h[2:2 + h[1]], dtype=_DTYPES[h[0]], device=device)
        dist.recv(buf, src)
        out.append(buf)
    return tuple(out)


def _run_accumulate_hooks(module: torch.nn.Module) -> None:
    """Run each parameter's post-accumulate-grad hooks where it holds a gradient (the Note on brackets)."""
    for p in module.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if p.grad is not None and hooks:
            for hook in list(hooks.values()):
                hook(p)


class BracketedStage(PipelineStage):
    """A `PipelineStage` whose gradient-writing backwards are bracketed: `driver.backward_begin()` before
    and `driver.backward_done()` after each (parallel/pipeline/schedule.py's Note on brackets)."""

    def __init__(self, chunk, stage_index, num_stages, device, group, driver, example_in,
                 example_out):
        super().__init__(chunk, stage_index, num_stages, device, input_args=example_in, output_args=example_out,
                         group=group)
        self._driver = driver

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if not full_backward or not self.has_backward:
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)
        self._driver.backward_begin()
        try:
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True, last_backward=last_backward)
        finally:
            self._driver.backward_done()

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if not self.has_backward:
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._driver.backward_begin()
        try:
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if self.stage_index != 0 and self.dw_builder is None:  # param.grad assigned, not accumulated
                _run_accumulate_hooks(self.submod)
            return out
        finally:
            self._driver.backward_done()
