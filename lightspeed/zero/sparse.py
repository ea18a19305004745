"""Sparse gradient reduction at ZeRO stage 0: an embedding's gradient reduced by all-gathering the
rows each rank touched instead of all-reducing the whole matrix (DeepSpeed's sparse_allreduce).

Owns: which parameters take this path (`sparse_parameters`) and the reduction itself
(`all_gather_rows`). Must not: hold buffers across steps or know the bucket schedule (stage0.py
launches it in place of a bucket's all-reduce).

Note: [which gradients, and DeepSpeed's rule]
    DeepSpeed reduces sparsely the gradients that are sparse tensors, i.e. those of
    ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``, with no config key (0.19
    refuses the old ``sparse_gradients`` key); before that, ``sparse_gradients: true`` also turned the
    dense gradients of every ``nn.Embedding`` / ``nn.EmbeddingBag`` weight into (row indices, rows)
    first. Both are built: the weights of sparse embeddings always, every embedding weight with
    ``sparse_gradients: true``. Gradients accumulate densely in the flat buffer either way; at the
    boundary the rows with a nonzero element are the ones sent. Each rank's rows are scaled before
    the gather as DeepSpeed scales them (mean: by predivide / world without prescale_gradients, by
    1 / world with it, world being the data-parallel ranks with the sp ranks summed, reduce.py's
    Note; sum: not at all), gathered padded to the largest row count, and added into the
    dense gradient, which equals the dense all-reduce's (for two ranks exactly: the same sum).
"""

from __future__ import annotations

import torch

from lightspeed.comm.codecs import Collectives
from lightspeed.zero.reduce import ReduceOptions

__all__ = ["all_gather_rows", "sparse_parameters"]


def sparse_parameters(module: torch.nn.Module, sparse_gradients: bool) -> set[int]:
    """ids of the embedding weights whose gradients are reduced sparsely (see the Note)."""
    out = set()
    for m in module.modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.weight.requires_grad:
            if sparse_gradients or m.sparse:
                out.add(id(m.weight))
    return out


def all_gather_rows(grad: torch.Tensor, collectives: Collectives, reduce: ReduceOptions) -> None:
    """Replace the 2-d gradient `grad` (in place) by its reduction over `collectives`' ranks, sending only
    the rows that are nonzero on each rank."""
    world = collectives.world_size
    rows = grad.ne(0).any(dim=1).nonzero().flatten()
    dtype = reduce.reduce_dtype or grad.dtype
    values = grad.index_select(0, rows).to(dtype)
    if reduce.average:
        ranks = reduce.mean_ranks(world)  # dp x sp summed over sp: zero/reduce.py's Note on sequence parallelism
        values.mul_(reduce.gradient_predivide_factor / ranks if not reduce.prescale_gradients else 1.0 / ranks)
    count = torch.tensor([rows.numel()], dtype=torch.int64, device=grad.device)
    counts = torch.empty(world, dtype=torch.int64, device=grad.device)
    collectives.comm.all_gather(counts, count)
    most = int(counts.max())
    sent_rows = torch.zeros(most, dtype=torch.int64, device=grad.device)
    sent_rows[:rows.numel()] = rows
    sent = values.new_zeros(most, grad.shape[1])
    sent[:rows.numel()] = values
    all_rows = torch.empty(world * most, dtype=torch.int64, device=grad.device)
    all_values = values.new_empty(world * most, grad.shape[1])
    collectives.comm.all_gather(all_rows, sent_rows)
    collectives.comm.all_gather(all_values, sent)
    grad.zero_()
    for r in range(world):
        n = int(counts[r])
        grad.index_add_(0, all_rows[r * most:r * most + n], all_values[r * most:r * most + n].to(grad.dtype))
