"""The load-balancing loss of MoE layers inside a pipeline stage: how it reaches the training loss
without being shipped to the last stage.

Owns: the micro-batch's aux-loss gradient scale (`aux_loss_scale`, a context the pipeline engine
enters around one batch), and `attach_aux_loss`, the autograd function that carries a layer's aux
loss along its activations. Must not: compute the aux loss (gating.py does) or know the pipeline
schedule (the engine sets the scale).

Note: [aux loss in a pipeline] Outside a pipeline, DeepSpeed's `MoE` returns `l_aux` and the user adds
`coefficient x l_aux` to the loss. Inside a pipeline stage the loss exists only on the last stage,
and neither DeepSpeed's pipeline engine nor Megatron-DeepSpeed's pipeline model carries `l_aux` there
(Megatron-DeepSpeed's pipeline layers drop it). lightspeed follows Megatron-Core's auto-scaler
instead: an MoE layer with `aux_loss_coeff` set passes its output through `AuxLossAttach`, which
returns the output unchanged in forward; in backward it passes the output's gradient through and also
gives `l_aux` the gradient `aux_loss_coeff x scale`, where `scale` is the gradient the micro-batch's
loss itself starts its backward with (1 / gradient_accumulation_steps, times the fp16 loss scale). So
every stage's layers add `aux_loss_coeff x l_aux` to their micro-batch's loss, exactly as a one-process
model adding it to the loss, and nothing crosses the stages but the activations' gradients. The scale
is read when the layer runs forward (the pipeline engine's `aux_loss_scale` context spans the whole
batch, recomputation under activation checkpointing included); a layer with `aux_loss_coeff` set that
trains with gradients outside that context raises, since its aux loss would otherwise be lost silently
(outside a pipeline, leave `aux_loss_coeff` None and add the term to the loss).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SCALE: list[float] = []  # the innermost active scale last


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Within this context an MoE layer with `aux_loss_coeff` set gives its aux loss the gradient
    `aux_loss_coeff x scale` (the Note on aux loss in a pipeline); `scale` is the gradient each
    micro-batch's loss starts its backward with."""
    _SCALE.append(float(scale))
    try:
        yield
    finally:
        _SCALE.pop()


def active_aux_loss_scale() -> float | None:
    """The innermost `aux_loss_scale`, or None outside every one."""
    return _SCALE[-1] if _SCALE else None


class AuxLossAttach(torch.autograd.Function):
    """forward(activations, aux_loss, grad) -> activations, unchanged; backward: the activations'
    gradient passed through, and `grad` (a float) for every element of `aux_loss`."""

    @staticmethod
    def forward(ctx, activations: torch.Tensor, aux_loss: torch.Tensor, grad: float) -> torch.Tensor:
        ctx.grad = grad
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return activations.view_as(activations)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.grad, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, aux_grad, None


def attach_aux_loss(activations: torch.Tensor, aux_loss: torch.Tensor, coeff: float, where: str) -> torch.Tensor:
    """`activations` carrying `coeff x aux_loss` into the backward of the active `aux_loss_scale`;
    `where` names the layer in the error raised outside that context."""
    scale = active_aux_loss_scale()
    if scale is None:
        raise RuntimeError(f"{where}: aux_loss_coeff={coeff} adds the aux loss only inside a PipelineEngine's "
                           "train_batch(); outside a pipeline leave aux_loss_coeff None and add "
                           "coefficient x l_aux to the loss yourself, as with DeepSpeed's MoE")
    if not aux_loss.requires_grad:
        return activations
    return AuxLossAttach.apply(activations, aux_loss, float(coeff) * scale)
