"""The training data loader `initialize()` returns: each data-parallel rank reads its own part of the
dataset, `train_micro_batch_size_per_gpu` samples per batch, as DeepSpeed's loader does; and
`RepeatingLoader`, which restarts a loader when it runs out."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


def build_dataloader(dataset, *, batch_size: int, dp_rank: int, dp_world_size: int, collate_fn=None,
                     data_sampler=None, num_workers: int = 0, drop_last: bool = False,
                     pin_memory: bool = False) -> DataLoader:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers,
                          drop_last=drop_last, pin_memory=pin_memory)
    sampler = data_sampler or DistributedSampler(dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, drop_last=drop_last, pin_memory=pin_memory)


class RepeatingLoader:
    """Iterate over `loader` forever: when it is exhausted, start a new pass (DeepSpeed's RepeatingLoader).
    As DeepSpeed's, it does not call the sampler's `set_epoch`: a DistributedSampler repeats its order
    unless the caller sets the epoch."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
