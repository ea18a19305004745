"""`UlyssesSPDataLoaderAdapter` (DeepSpeed's): turns a data loader of whole sequences into one of
sequence shards for Ulysses sequence parallelism.

Owns: gathering the sp group's batches, making `position_ids` and the pre-shifted `shift_labels`, padding
to a multiple of the sp size, and cutting each batch into the sp ranks' slices. Must not: know the
model or compute a loss.

Each rank's loader yields its own batches (dicts of [b, s, ...] tensors with `input_ids` and `labels`).
One `refill` gathers the batch of every rank of the sp group; then, for each of them in sp-rank order,
every rank yields its slice of that batch. So the sp group works on one rank's batch at a time, and a
pass over the adapter is sp times as many micro-steps as over the loader, each of 1/sp of a batch:
DeepSpeed's arrangement ("sequence parallelism over data parallelism").

Labels are shifted before slicing (`shift_labels[:, i] = labels[:, i + 1]`, the last -100), because the
token that a slice's last position predicts lives on the next rank; `labels` is removed so the model
does not shift again. Tensors whose first two dimensions are the batch's [b, s] are sliced along the
sequence; other tensors and non-tensors are given to every rank whole. Queued slices are kept on the CPU
(long sequences would hold device memory for sp micro-steps); the training loop moves them.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from lightspeed.comm.differentiable import all_gather_objects, all_gather_tensors

IGNORE_INDEX = -100


class UlyssesSPDataLoaderAdapter:
    """`UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device, pad_to_sp_multiple=True,
    pad_token_id=0)`: an iterator over this rank's slices of the sp group's batches."""

    def __init__(self, dl, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any,
                 pad_to_sp_multiple: bool = True, pad_token_id: int = 0) -> None:
        if not 0 <= sp_rank < sp_world_size:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: sp_rank {sp_rank} is outside [0, {sp_world_size})")
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = device
        self.pad_to_sp_multiple = pad_to_sp_multiple
        self.pad_token_id = pad_token_id
        self.iter = iter(dl)
        self.micro_batches: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts afresh, as DeepSpeed's adapter does
            raise
        batch = _checked(batch)
        _ensure_position_ids(batch)
        gathered: list[dict] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                values = all_gather_tensors(value.to(self.device), self.sp_group)
            else:
                values = all_gather_objects(value, self.sp_group)
            for rank, v in enumerate(values):
                gathered[rank][key] = v
        for whole in gathered:
            self.micro_batches.append(self._slice(whole))

    def _slice(self, batch: dict) -> dict:
        shape = tuple(batch["input_ids"].shape)
        sequence_keys = {k for k, v in batch.items() if torch.is_tensor(v) and tuple(v.shape[:2]) == shape}
        seq_len = batch["input_ids"].shape[1]
        if seq_len % self.sp_world_size != 0:
            if not self.pad_to_sp_multiple:
                raise ValueError(f"UlyssesSPDataLoaderAdapter: sequence length {seq_len} is not divisible by "
                                 f"sequence_parallel_size={self.sp_world_size} (pad_to_sp_multiple=False)")
            padded = math.ceil(seq_len / self.sp_world_size) * self.sp_world_size
            for key in sequence_keys:
                batch[key] = self._pad(key, batch[key], padded)
            seq_len = padded
        labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=IGNORE_INDEX)
        batch["shift_labels"] = labels[:, 1:].contiguous()
        chunk = seq_len // self.sp_world_size
        start = chunk * self.sp_rank
        out = {}
        for key, value in batch.items():
            if torch.is_tensor(value):
                if key in sequence_keys or key == "shift_labels":
                    value = value[:, start:start + chunk]
                value = value.contiguous().cpu()
            out[key] = value
        return out

    def _pad(self, key: str, tensor: torch.Tensor, length: int) -> torch.Tensor:
        extra = length - tensor.shape[1]
        if key == "position_ids":  # positions keep counting, so the pad tokens stay causal and last
            step = torch.arange(1, extra + 1, dtype=tensor.dtype, device=tensor.device)
            return torch.cat([tensor, tensor[:, -1:] + step], dim=1)
        fill = IGNORE_INDEX if key in ("labels", "shift_labels") else self.pad_token_id if key == "input_ids" else 0
        pad = torch.full((tensor.shape[0], extra, *tensor.shape[2:]), fill, dtype=tensor.dtype, device=tensor.device)
        return torch.cat([tensor, pad], dim=1)


def _checked(batch) -> dict:
    if not isinstance(batch, dict) or not torch.is_tensor(batch.get("input_ids")):
        raise ValueError("UlyssesSPDataLoaderAdapter: batches must be dicts holding an `input_ids` tensor")
    batch = dict(batch)  # the loader's object stays as it was
    if batch["input_ids"].dim() != 2:
        raise ValueError(f"UlyssesSPDataLoaderAdapter: input_ids must be [batch, sequence], got "
                         f"{tuple(batch['input_ids'].shape)}")
    if not torch.is_tensor(batch.get("labels")) or batch["labels"].shape[:2] != batch["input_ids"].shape:
        raise ValueError("UlyssesSPDataLoaderAdapter: batches need `labels` of input_ids' [batch, sequence] shape "
                         "(the loss of a sequence split over ranks is computed from pre-shifted labels)")
    return batch


def _ensure_position_ids(batch: dict) -> None:
    """Global positions for each token: each rank's model sees only its slice, so it cannot number them."""
    ids = batch["input_ids"]
    if "position_ids" in batch:
        if tuple(batch["position_ids"].shape) != tuple(ids.shape):
            raise ValueError(f"UlyssesSPDataLoaderAdapter: position_ids {tuple(batch['position_ids'].shape)} must "
                             f"have input_ids' shape {tuple(ids.shape)}")
        return
    batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids).clone()
