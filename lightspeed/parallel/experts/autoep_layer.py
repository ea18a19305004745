"""The expert-parallel replacement of a Hugging Face transformers 5 fused experts module
(`MixtralExperts`, `Qwen2MoeExperts`, `Qwen3MoeExperts`, `DeepseekV3Experts`, `GptOssExperts`, ...):
`EPExperts` holds this ep rank's `num_experts / ep` experts, sliced from the fused [E, ...] weights
(and biases), and computes `forward(hidden_states, top_k_index, top_k_weights)` exactly as the module
it replaces, with the tokens of the other ranks' experts sent there and back.

Owns: the dispatch (sort routes by expert, an all-to-all with per-rank sizes over the "ep" group,
regroup by local expert), the experts' MLP (grouped_mlp.py) and the combine (the results come home
by the inverse exchange, are weighted by the router and summed per token). Must not: route (the
model's own router module still runs, so routing is the model's to the bit), build groups, or place
parameters (autoep.py does).

Note: [what is exact] The replaced module computes, for each token t and each of its k routes (e, w):
`glu(x W_gu[e]^T + b_gu[e]) W_down[e]^T + b_down[e]` (grouped_mlp.py's Notes: the biases where the
model has them, `glu` the model's gated activation), times w (in the promoted dtype of the expert
output and the router weight), cast to the hidden dtype, summed over the routes into zeros. So does
`EPExperts`: every route is computed (no capacity, nothing dropped), in the same dtypes; only the order
in which a token's k results are summed may differ (k <= a few terms).

Note: [layouts] Weights are kept as the model stores them, under its names: nn.Linear's [E, 2I, H] /
[E, H, I] (Mixtral, Qwen, DeepSeek), or `transposed` [E, H, 2I] / [E, I, H] (GPT-OSS, `x @ W`), which
the MLP reads through `.transpose(1, 2)` views. Biases are [E, 2I] and [E, H]. Every parameter is
sliced along dim 0, the expert.

Note: [state dicts] `state_dict()` holds this rank's rows under the replaced module's names (the
placements say where they sit in the whole [E, ...] tensor). `load_state_dict` takes either this
rank's rows or the whole model's tensors (every expert, as a Hugging Face checkpoint holds them), from
which it keeps this rank's rows (sliced over tp: and this tp rank's units).

Note: [the expert gradient's average] As layer.py's Note of that name: an expert's gradient on its
rank sums the contributions of every ep rank's tokens, while the strategies average it over the
expert-data-parallel ranks only, so the return exchange's backward divides the gradient reaching the
experts by ep and the dispatch exchange's backward multiplies it back for the tokens.

Note: [tensor parallelism] Beside tensor-parallel dense layers the experts stay whole and every tp
rank of a group holds the same experts, tokens and routes (the router is whole; its input was summed
over tp). Rather than compute every token tp times, each tp rank takes a contiguous 1/tp of the
tokens (`drop_tokens` over the "tp" group: the first S mod tp ranks one token more), with their
routes and router weights, dispatches them over its own "ep" group (the ranks of its tp coordinate),
and the combined outputs are gathered over tp (`gather_tokens`), so every tp rank again holds all S
tokens' outputs. This is sound because these routers decide each token alone (top-k with no
capacity: nothing depends on which tokens share a rank), so a token's result is the same whichever
rank computes it. Each tp rank's expert gradient then holds only its tokens' share: the placements
reduce the experts over tp too (transform.py's `expert_reduced_over`), and as the strategies average,
the gather's backward multiplies the gradient reaching the experts by tp and the drop's backward
divides it back for the tokens and router weights.

Note: [experts sliced over tp] With `expert_parallel.expert_tensor_parallel_size` equal to the tp size
(`tp_comm` given), each tp rank holds 1/tp of every expert's intermediate units instead: units
[t x I/tp, (t + 1) x I/tp) of tp rank t, i.e. those gate columns and the up columns of the same units
(the halves layout: rows u and I + u; GPT-OSS's interleaved one: rows 2u and 2u + 1, a contiguous
range) of gate_up and its bias, and those columns of down; the down bias stays whole. Every tp rank
then runs all its tokens (no token split): the input to the MLP goes through `copy_to_group` (its
gradient summed over tp), the MLP's partial output (no down bias) through `reduce_from_group`, and the
down bias of each row's expert is added once after the sum. The gradients of the slices are whole,
so the placements shard them over ("ep", "tp") and reduce them over the expert-data-parallel dims only
(`tp_placement` gives each slice's boxes, joined along the 2I dim: `Placement.cat_dim`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightspeed.comm import api as comm_api
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.differentiable import drop_tokens, gather_tokens, ragged_all_to_all
from lightspeed.comm.tp_autograd import copy_to_group, reduce_from_group
from lightspeed.parallel.experts.grouped_mlp import GatedActivation, as_gated, grouped_mlp, grouped_mlp_reference
from lightspeed.parallel.placement import Placement


def tp_unit_dim(name: str, weight_names: tuple[str, str], bias_names: tuple[str, str], transposed: bool
                ) -> tuple[int, bool] | None:
    """(the dim of experts parameter `name` holding intermediate units, whether it is the fused 2I
    one); None for a parameter kept whole over tp (the down bias). The Note on experts sliced over tp."""
    w1, w2 = weight_names
    if name == w1:
        return (2 if transposed else 1), True
    if name == w2:
        return (1 if transposed else 2), False
    if bias_names[0] and name == bias_names[0]:
        return 1, True
    return None


def tp_unit_ranges(fused: bool, interleaved: bool, tp: int, tp_rank: int, units: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges along a unit dim (`tp_unit_dim`) holding tp rank `tp_rank`'s 1/tp of
    `units` intermediate units: one range of down's I, the gate and up ranges of a halves-layout 2I, one
    range of an `interleaved` 2I (the Note on experts sliced over tp)."""
    n = units // tp
    if not fused:
        return [(tp_rank * n, (tp_rank + 1) * n)]
    if interleaved:
        return [(2 * tp_rank * n, 2 * (tp_rank + 1) * n)]
    return [(tp_rank * n, (tp_rank + 1) * n), (units + tp_rank * n, units + (tp_rank + 1) * n)]


class EPExperts(nn.Module):
    """This ep rank's share of a fused experts module. `weight_names` (w1, w2) are the fused gate|up
    and down parameters' names, `bias_names` (b1, b2) their biases' ("" for none; kept, so the state
    dict keeps the model's names, holding this rank's rows); `activation` the experts' gated
    activation (grouped_mlp.py: a `GatedActivation`, or an elementwise `act_fn` of the gate half);
    `transposed` the Note on layouts; `ep_group` is bound by `bind` before the first forward when
    `ep_size` > 1. `local`, when given, holds this rank's rows of each parameter already (name ->
    [E/ep, ...], and only this tp rank's units with `tp_comm`: a source partitioned by zero.Init, whose
    own tensors are empty); else they are sliced from `source`'s whole tensors."""

    def __init__(self, source: nn.Module, weight_names: tuple[str, str], num_experts: int, ep_rank: int,
                 ep_size: int, activation: GatedActivation | Callable[[torch.Tensor], torch.Tensor],
                 use_grouped_mm: bool = True, bias_names: tuple[str, str] = ("", ""), transposed: bool = False,
                 local: dict[str, torch.Tensor] | None = None, tp_comm: Communicator | None = None) -> None:
        super().__init__()
        self.tp_comm = tp_comm if tp_comm is not None and tp_comm.world_size > 1 else None
        w1, w2 = weight_names
        self.weight_names, self.bias_names, self.transposed = weight_names, bias_names, transposed
        self.param_names = tuple(weight_names) + tuple(b for b in bias_names if b)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.activation = as_gated(activation)
        self.mlp = grouped_mlp if use_grouped_mm else grouped_mlp_reference
        self.ep_group = None
        self._bound = ep_size == 1
        self.tp_group, self.tp_size = None, 1
        first = ep_rank * self.num_local_experts
        for name in self.param_names:
            full = getattr(source, name)
            if local is None:
                rows = full.detach()[first:first + self.num_local_experts].clone()
            else:
                rows = local[name]
                if rows.shape[0] != self.num_local_experts:
                    raise ValueError(f"AutoEP: {name}'s local rows {tuple(rows.shape)} are not this rank's "
                                     f"{self.num_local_experts} experts")
            if self.tp_comm is not None and local is None:  # `local` holds this tp rank's units already
                rows = self._tp_cut(name, rows)
            self.register_parameter(name, nn.Parameter(rows, requires_grad=full.requires_grad))
        gate_up, down = self._weights()
        self.hidden_dim, self.intermediate_dim = down.shape[1], down.shape[2]
        if gate_up.shape[1:] != (2 * self.intermediate_dim, self.hidden_dim):
            stored = "[E, H, 2I] and [E, I, H]" if transposed else "[E, 2I, H] and [E, H, I]"
            raise ValueError(f"AutoEP: {w1} {tuple(getattr(self, w1).shape)} and {w2} {tuple(getattr(self, w2).shape)} "
                             f"are not a fused gate|up and down pair ({stored})")
        for name, width in zip(bias_names, (2 * self.intermediate_dim, self.hidden_dim)):
            if name and tuple(getattr(self, name).shape) != (self.num_local_experts, width):
                raise ValueError(f"AutoEP: {name} {tuple(getattr(self, name).shape)} is not a per-expert bias "
                                 f"[E, {width}]")

    def _tp_dim(self, name: str) -> tuple[int, bool] | None:
        return tp_unit_dim(name, self.weight_names, self.bias_names, self.transposed)

    def tp_ranges(self, name: str, tp_rank: int, units: int) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [(start, stop), ...]) of tp rank `tp_rank`'s slice of `name` along its unit dim, for
        `units` intermediate units in all (the Note on experts sliced over tp); None when kept whole."""
        where = self._tp_dim(name)
        if where is None:
            return None
        dim, fused = where
        return dim, tp_unit_ranges(fused, self.activation.interleaved, self.tp_comm.world_size, tp_rank, units)

    def _tp_cut(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        where = self._tp_dim(name)
        if where is None:
            return rows
        dim, fused = where
        units = rows.shape[dim] // (2 if fused else 1)
        if units % self.tp_comm.world_size:
            raise ValueError(f"AutoEP: expert_parallel.expert_tensor_parallel_size={self.tp_comm.world_size} does "
                             f"not divide the experts' {units} intermediate units ({name})")
        dim, ranges = self.tp_ranges(name, self.tp_comm.rank, units)
        return torch.cat([rows.narrow(dim, a, b - a) for a, b in ranges], dim=dim).clone()

    def tp_placement(self, name: str, tp_rank: int) -> Placement | None:
        """Where tp rank `tp_rank`'s slice of `name` sits in this ep rank's experts whole over tp
        ([E/ep, ...] with every unit); None when `name` is not sliced."""
        if self.tp_comm is None or self._tp_dim(name) is None:
            return None
        dim, fused = self._tp_dim(name)
        p = getattr(self, name)
        shape = list(getattr(p, "ds_shape", None) or p.shape)  # partitioned by zero.Init: its logical shape
        units = shape[dim] * self.tp_comm.world_size // (2 if fused else 1)
        shape[dim] *= self.tp_comm.world_size
        dim, ranges = self.tp_ranges(name, tp_rank, units)
        boxes = tuple(tuple((a, b) if d == dim else (0, n) for d, n in enumerate(shape)) for a, b in ranges)
        return Placement(name, tuple(shape), boxes, ("tp",), cat_dim=dim)

    def _mlp(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' MLP over rows sorted by (local) expert, `counts` per expert; sliced over tp:
        the partial outputs summed, then the down bias (the Note on experts sliced over tp)."""
        b1, b2 = self._biases()
        if self.tp_comm is None:
            return self.mlp(x, counts, *self._weights(), self.activation, b1, b2)
        y = self.mlp(copy_to_group(x, self.tp_comm), counts, *self._weights(), self.activation, b1, None)
        y = reduce_from_group(y, self.tp_comm)
        if b2 is None:
            return y
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=b2.device), counts.to(b2.device),
                                         output_size=x.shape[0])
        return y + b2.index_select(0, expert).to(y.dtype)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_gate_up [E, 2I, H], w_down [E, H, I]) as the MLP reads them (views when transposed)."""
        gate_up, down = (getattr(self, name) for name in self.weight_names)
        if self.transposed:
            return gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up, down

    def _biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        b1, b2 = self.bias_names
        return (getattr(self, b1) if b1 else None), (getattr(self, b2) if b2 else None)

    def bind(self, ep_group) -> None:
        """Give the module its expert-parallel process group."""
        self.ep_group = ep_group
        self._bound = True

    def bind_tp(self, tp_group, tp_size: int) -> None:
        """Give the module the dense layers' tensor-parallel group (the Note on tensor parallelism)."""
        self.tp_group, self.tp_size = tp_group, tp_size

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a whole model's state dict (every expert's rows) loads too: this rank takes its rows (the Note on
        # state dicts)
        first, local = self.ep_rank * self.num_local_experts, self.num_local_experts
        for name in self.param_names:
            value = state_dict.get(prefix + name)
            if value is not None and local != self.num_experts and value.dim() == getattr(self, name).dim() \
                    and value.shape[0] == self.num_experts:
                value = state_dict[prefix + name] = value[first:first + local]
            if value is not None and self.tp_comm is not None and self._tp_dim(name) is not None \
                    and value.dim() == getattr(self, name).dim() \
                    and value.shape[self._tp_dim(name)[0]] == self.tp_placement(name, 0).global_shape[
                        self._tp_dim(name)[0]]:  # whole over tp too: this tp rank's units
                state_dict[prefix + name] = self._tp_cut(name, value)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"experts {self.ep_rank * self.num_local_experts}..{(self.ep_rank + 1) * self.num_local_experts - 1} "
                f"of {self.num_experts}, ep {self.ep_rank}/{self.ep_size}, {self.activation!r}"
                f"{', biases' if any(self.bias_names) else ''}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        if not self._bound:
            raise RuntimeError("AutoEP experts: no expert-parallel group is bound; the model must pass through "
                               "lightspeed.initialize() with expert_parallel.enabled")
        tp = self.tp_size
        if tp == 1 or self.tp_comm is not None:  # sliced over tp: every tp rank runs every token
            return self._routed(hidden_states, top_k_index, top_k_weights)
        # the Note on tensor parallelism: this tp rank's contiguous share of the tokens
        num_tokens = hidden_states.shape[0]
        sizes = [num_tokens // tp + (r < num_tokens % tp) for r in range(tp)]
        rank = torch.distributed.get_rank(self.tp_group)
        start = sum(sizes[:rank])
        out = self._routed(drop_tokens(hidden_states, self.tp_group, 0, sizes, grad_scale=1.0 / tp),
                           top_k_index.narrow(0, start, sizes[rank]),
                           drop_tokens(top_k_weights, self.tp_group, 0, sizes, grad_scale=1.0 / tp))
        return gather_tokens(out, self.tp_group, 0, sizes, grad_scale=float(tp))

    def _routed(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        k = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # routes sorted by global expert (so by ep rank)
        token_of_route = order // k
        x_send = hidden_states.index_select(0, token_of_route)
        counts = torch.bincount(experts, minlength=self.num_experts)
        if self.ep_size == 1:
            out_sorted = self._mlp(x_send, counts)
        else:
            out_sorted = self._exchange(x_send, counts)
        weights = top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        routed = (out_sorted * weights).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token_of_route, routed)

    def _exchange(self, x_send: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep_size, self.num_local_experts
        recv_counts = torch.empty_like(counts)
        comm_api.all_to_all_single(recv_counts, counts.contiguous(), group=self.ep_group)  # [source rank, local expert]
        send_sizes = counts.view(ep, local).sum(1).tolist()
        by_source = recv_counts.view(ep, local)
        recv_sizes = by_source.sum(1).tolist()
        x_recv = ragged_all_to_all(x_send, self.ep_group, send_sizes, recv_sizes, grad_scale=float(ep))
        # each source's rows come grouped by local expert: regroup all of them by local expert
        label = torch.arange(local, device=counts.device).repeat(ep)
        expert_of_row = torch.repeat_interleave(label, by_source.reshape(-1), output_size=x_recv.shape[0])
        perm = torch.argsort(expert_of_row, stable=True).to(x_recv.device)
        y = self._mlp(x_recv.index_select(0, perm), by_source.sum(0))
        y = y.index_select(0, torch.argsort(perm))  # back to the received order
        return ragged_all_to_all(y, self.ep_group, recv_sizes, send_sizes, grad_scale=1.0 / ep)


__all__ = ["EPExperts"]
