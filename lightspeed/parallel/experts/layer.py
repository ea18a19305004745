"""DeepSpeed's mixture-of-experts layer for training: `MoE` (the user's layer: gate, experts, optional
residual MLP), `MOELayer` (gate -> dispatch -> experts -> combine) and `Experts` (this rank's copies
of the expert module), with DeepSpeed's module and parameter names, so state dicts match.

Owns: the dispatch of tokens into per-expert capacity buffers and back, the all-to-all over the
expert-parallel group, the expert parameters' marks (`allreduce = False`, `group_name`), and the
binding of that group (`bind_expert_group`, from the run's `Topology`). Must not: decide routes
(gating.py does), build groups (comm/topology.py does), or place parameters (transform.py does).

Note: [dispatch] As DeepSpeed 0.19.8 does: each route's token is copied into slot `expert x capacity +
location` of an [experts, capacity, hidden] buffer (unfilled slots hold zeros), the buffer goes through
an all-to-all over the "ep" group (block j of experts to ep rank j), each local expert runs on its
[ep, 1, capacity, hidden] share, the results come back through the same all-to-all, and each token's
output is the gate-weighted sum of its kept routes' results (summed in float32, then cast to the
expert output's dtype). A dropped route contributes nothing; a token that lost every route outputs
zeros. Global expert g lives on ep rank g // num_local_experts as local expert g % num_local_experts.

Note: [batched experts] `Experts.forward` runs every local expert at once when each is a recognised MLP
(`nn.Sequential(nn.Linear, activation, nn.Linear)` or batched.py's `GatedMLP`, biases on or off, no
hooks, no autocast: batched.py's Note on recognised experts): the [ep, local, capacity, m] buffer is
read as [local, ep x capacity, m] and each projection is one batched matmul over the experts' stacked
weights, whose gradients reach each expert's own parameters. Anything else (other expert modules,
hooks, ZeRO-3's per-expert gathering, experts sliced over tp) runs the loop (`forward_loop`), the
general path; `Experts.batched = False` forces it. Both give the same result up to the matmuls'
rounding.

Note: [the expert gradient's average] An expert's gradient on its rank already sums the contributions
of every ep rank's tokens (the all-to-all's backward brings them home), so it is ep times the sum the
dense parameters' gradients hold over one rank's data. The strategies average each gradient over its
placement's `reduced_over` ranks (experts: dp_replicate x edp_shard x sp, not ep); the layer divides
the gradient reaching the experts by `ep_size` in the second all-to-all's backward and multiplies it
back in the first's, so the expert gradient is the average over all data-parallel ranks (DeepSpeed
divides the expert-data-parallel sum by the data-parallel world size) and the gradient of the tokens
is untouched.

Note: [tensor parallelism] Beside tensor parallelism on the dense layers (DeepSpeed's default
`enable_expert_tensor_parallelism=False`), the experts stay whole and every tp rank of a group holds
the same ones and the same tokens (the dense layers' outputs are summed over tp before they reach the
layer), so the gates agree and the [experts, capacity, m] buffer is the same on every tp rank. As
DeepSpeed does, each tp rank keeps only its 1/tp of the capacity slots (`drop_tokens` along dim 1)
before the all-to-all and the experts, and the results are gathered over the tp group along dim 1
after the return all-to-all: no tp rank computes a slot twice. The capacity must divide by tp
(DeepSpeed asserts it; here a `MoEArgumentError` names it); with `drop_tokens=False` the gate pads the
agreed capacity up to a multiple of tp, as DeepSpeed's does. An expert's gradient on a tp rank then
holds only its slots' share, so the experts are also reduced over tp (transform.py's placements put
"tp" in `reduced_over`), and, since the strategies average, the gather's backward multiplies the
gradient reaching the experts by tp and the drop's backward divides it back for the tokens. The
routes must agree across the tp ranks: with `use_rts`, noisy gating or top-2 sampling, every rank of
a tp group needs the same generator state (DeepSpeed's requirement too).

Note: [expert tensor parallelism] With `enable_expert_tensor_parallelism=True` the experts are sliced
over the tp group instead (`split_expert`, when the layer is bound to a tp group of more than one rank):
in each expert every nn.Linear but the last becomes column-parallel (its rows of W and of the bias;
these layers must all read the expert's input) and the last one row-parallel (its columns of W, the
partial outputs summed over tp, the whole bias added once), tensor_parallel.py's layers; any other
parameter in an expert is refused. As DeepSpeed does, each tp rank still sends only its 1/tp of the
capacity slots through the all-to-all (`drop_tokens`), but the slots are gathered back over tp before
the experts, which then see every slot on every tp rank; the (identical) results are dropped to 1/tp
again before the return all-to-all and gathered after it. No gradient scale is needed: the column
layers sum the input gradient over tp, so the gradient at each drop/gather is whole and equal on every
tp rank, and each tp rank's expert gradient is the whole gradient of its slice, so the experts are
sharded over ("ep", "tp") and reduced over the expert-data-parallel dims only (transform.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from lightspeed._utils.logging import get_logger
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.differentiable import drop_tokens, expert_all_to_all, gather_tokens
from lightspeed.comm.sequence_groups import as_group
from lightspeed.comm.topology import Topology
from lightspeed.parallel.experts.aux_loss import attach_aux_loss
from lightspeed.parallel.experts.batched import batched_experts
from lightspeed.parallel.experts.errors import MoEArgumentError
from lightspeed.parallel.experts.gating import NOISY_GATE_POLICIES, Routes, TopKGate
from lightspeed.parallel.tensor_parallel import split_linear, split_tp_size
from lightspeed.parallel.tp_plan import COLWISE, ROWWISE

logger = get_logger(__name__)


def route_slots(routes: Routes) -> torch.Tensor:
    """[k, s] flat slots `expert x capacity + location` of the [experts x capacity] buffer; dropped
    routes point at one spare slot past the end (`experts x capacity`), which nothing reads."""
    flat = routes.indices.long() * routes.capacity + routes.locations.long()
    spare = torch.full_like(flat, routes.num_experts * routes.capacity)
    return torch.where(routes.indices >= 0, flat, spare)


def dispatch(tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[s, m] tokens -> [experts, capacity, m] buffer (one gather: each slot reads its token's row, an
    empty slot a zero row)."""
    num_tokens, hidden = tokens.shape
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=slots.device)
    rows = torch.arange(num_tokens, device=slots.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), rows.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, hidden)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, hidden)


def combine(expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[experts x capacity, m] results -> [s, m]: each token's routes' results, gate-weighted, summed."""
    hidden = expert_output.size(-1)
    padded = torch.cat([expert_output, expert_output.new_zeros(1, hidden)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.size(0), num_tokens, hidden)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


class Experts(nn.Module):
    """`num_local_experts` deep copies of `expert` (`deepspeed_experts`), their parameters marked as
    DeepSpeed marks expert parameters. forward([ep, local experts, capacity, m]) runs local expert i on
    [:, i] (a tuple output: its first element) and stacks the results the same way: all at once when
    the experts are recognised MLPs (the Note on batched experts), else in a loop (`forward_loop`)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    batched = True  # False: always the per-expert loop (the reference; batched.py's Note on recognised experts)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        run = batched_experts(self.deepspeed_experts, inputs) if self.batched else None
        if run is None:
            return self.forward_loop(inputs)
        ep, local, capacity, hidden = inputs.shape
        out = run(inputs.transpose(0, 1).reshape(local, ep * capacity, hidden))
        return out.view(local, ep, capacity, -1).transpose(0, 1)

    def forward_loop(self, inputs: torch.Tensor) -> torch.Tensor:
        """Each local expert module called on its [ep, 1, capacity, m] share, one after another."""
        outputs = []
        for chunk, module in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = module(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


def split_expert(expert: nn.Module, comm: Communicator, where: str = "expert") -> None:
    """Slice `expert` in place over `comm`'s tp group (the Note on expert tensor parallelism): every
    nn.Linear but the last column-parallel, the last row-parallel."""
    linears = [(name, m) for name, m in expert.named_modules() if type(m) is nn.Linear]
    in_linear = {f"{name}.{p}" if name else p for name, m in linears for p, _ in m.named_parameters()}
    other = [name for name, _ in expert.named_parameters() if name not in in_linear]
    if len(linears) < 2 or other:
        extra = f" and the parameters {other[:3]}" if other else ""
        raise MoEArgumentError(f"MoE(enable_expert_tensor_parallelism=True): {where} must be made of nn.Linear "
                               "layers only, at least two (the first column-parallel, the last row-parallel); it has "
                               f"{len(linears)} nn.Linear layers{extra}")
    tp = comm.world_size
    for i, (name, module) in enumerate(linears):
        last = i == len(linears) - 1
        size = module.in_features if last else module.out_features
        if size % tp:
            raise MoEArgumentError(f"MoE(enable_expert_tensor_parallelism=True): {where}.{name} has {size} "
                                   f"{'input features' if last else 'output features'}, which do not divide by the "
                                   f"tensor-parallel size {tp}")
    for i, (name, module) in enumerate(linears):
        new = split_linear(module, ROWWISE if i == len(linears) - 1 else COLWISE, comm)
        parent, _, child = name.rpartition(".")
        setattr(expert.get_submodule(parent) if parent else expert, child, new)


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (the Note on dispatch). forward(hidden [..., m], used_token=None)
    -> output of hidden's shape; the gate's `l_aux` and `exp_counts` stay on the layer."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False, expert_tensor_parallel: bool = False) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError("MoE(use_tutel=True): Tutel's dispatch kernels are not implemented in lightspeed; "
                                      "pass use_tutel=False (the same routes, dispatched by index)")
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.tp_group, self.tp_size = None, 1
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        self.expert_tensor_parallel = expert_tensor_parallel
        self._ep_bound = ep_size == 1
        self.l_aux = self.exp_counts = None

    def _set_ep_group(self, ep_group) -> None:
        """Bind the expert-parallel process group (None only when ep_size is 1: no expert parallelism)."""
        if ep_group is None and self.ep_size > 1:
            raise MoEArgumentError(f"MoE(ep_size={self.ep_size}): the expert-parallel group cannot be None")
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)
        self._ep_bound = True

    def _set_tp_group(self, tp_group, tp_size: int) -> None:
        """Bind the dense layers' tensor-parallel group (the Note on tensor parallelism); size 1: none.
        With expert tensor parallelism the experts are sliced over it here, once."""
        if self.expert_tensor_parallel:
            split = split_tp_size(self.experts)
            if split == 1 and tp_size > 1:
                comm = Communicator(tp_group, tp_size)
                for i, expert in enumerate(self.experts.deepspeed_experts):
                    split_expert(expert, comm, f"deepspeed_experts.{i}")
            elif split not in (1, tp_size):
                raise MoEArgumentError(f"MoE(enable_expert_tensor_parallelism=True): the experts are sliced for tp "
                                       f"size {split}, the run's tensor-parallel size is {tp_size}")
        self.tp_group, self.tp_size = tp_group, tp_size
        self.gate.tp_size = tp_size

    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        if not self._ep_bound:
            raise RuntimeError(f"MoE(ep_size={self.ep_size}): no expert-parallel group is bound; pass the model "
                               "through lightspeed.initialize() (or deepspeed.initialize), which binds the run's "
                               "'ep' group")
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        routes = self.gate.routes(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        num_experts, capacity = routes.num_experts, routes.capacity
        slots = route_slots(routes)
        dispatched = dispatch(tokens, slots, num_experts, capacity)
        tp, sliced = self.tp_size, self.expert_tensor_parallel  # sliced: the Note on expert tensor parallelism
        if tp > 1:  # the Note on tensor parallelism
            if capacity % tp:
                raise MoEArgumentError(f"MoE with tensor parallelism: the expert capacity {capacity} does not divide "
                                       f"by the tensor-parallel size {tp} (each tp rank takes capacity / tp slots); "
                                       "choose capacity_factor and min_capacity (or the batch) so that it does")
            dispatched = drop_tokens(dispatched, self.tp_group, 1, grad_scale=1.0 if sliced else 1.0 / tp)
        if self.ep_size > 1:  # the Note on the expert gradient's average
            dispatched = expert_all_to_all(dispatched, self.ep_group, grad_scale=float(self.ep_size))
        if tp > 1 and sliced:
            dispatched = gather_tokens(dispatched, self.tp_group, 1)
        expert_output = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model))
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        if tp > 1 and sliced:
            expert_output = drop_tokens(expert_output, self.tp_group, 1)
        if self.ep_size > 1:
            expert_output = expert_all_to_all(expert_output, self.ep_group, grad_scale=1.0 / self.ep_size)
        if tp > 1:
            expert_output = gather_tokens(expert_output, self.tp_group, 1, grad_scale=1.0 if sliced else float(tp))
        out = combine(expert_output.reshape(num_experts * capacity, d_model), slots, routes.gates, tokens.shape[0])
        return out.reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's `deepspeed.moe.layer.MoE`: forward(hidden_states, used_token=None) -> (output, l_aux,
    exp_counts). `num_experts` experts, `num_experts // ep_size` of them (deep copies of `expert`) on each
    rank of an expert-parallel group of `ep_size` ranks; top-`k` gating (gating.py). With `use_residual`
    (Residual MoE), `expert` itself is a dense MLP beside the experts and a linear `coefficient` layer
    mixes the two outputs by a softmax per token. Beside tensor-parallel dense layers the experts stay
    whole (the Note on tensor parallelism), or, with `enable_expert_tensor_parallelism=True`, are sliced
    over tp (the Note on expert tensor parallelism); `use_tutel=True` is refused (not built).
    lightspeed's keyword `aux_loss_coeff` (default None: the caller adds `l_aux` to the loss, as with
    DeepSpeed) is for a layer inside a pipeline stage: the layer adds `aux_loss_coeff x l_aux` to its
    micro-batch's loss itself (aux_loss.py's Note on aux loss in a pipeline); `l_aux` is still returned,
    for logging only."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, aux_loss_coeff: float | None = None) -> None:
        super().__init__()
        if not isinstance(expert, nn.Module):
            raise MoEArgumentError(f"MoE: expert must be a torch.nn.Module (got {type(expert).__name__})")
        for name, value in (("num_experts", num_experts), ("ep_size", ep_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MoEArgumentError(f"MoE: {name} must be a positive integer (got {value!r})")
        if num_experts % ep_size:
            raise MoEArgumentError(f"MoE: num_experts={num_experts} is not divisible by ep_size={ep_size}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise MoEArgumentError(f"MoE: unsupported noisy_gate_policy {noisy_gate_policy!r} (use None, 'Jitter' or "
                                   "'RSample')")
        bad_coeff = isinstance(aux_loss_coeff, bool) or not isinstance(aux_loss_coeff, (int, float, type(None)))
        if bad_coeff or (aux_loss_coeff is not None and not aux_loss_coeff >= 0):
            raise MoEArgumentError(f"MoE: aux_loss_coeff must be None or a number >= 0 (got {aux_loss_coeff!r})")
        self.aux_loss_coeff = aux_loss_coeff
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        logger.info("MoE layer: %d experts, %d per rank, expert-parallel size %d", num_experts,
                    self.num_local_experts, ep_size)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel,
                                      expert_tensor_parallel=bool(enable_expert_tensor_parallelism))
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Bind the expert-parallel group of the topology the last `initialize()` built (initialize()
        binds it itself)."""
        from lightspeed.comm.topology import current_topology

        if use_data_before_expert_parallel_:
            raise NotImplementedError("use_data_before_expert_parallelism: expert groups laid out data-parallel first "
                                      "are not implemented in lightspeed")
        bind_expert_group(self.deepspeed_moe, current_topology())

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        if self.aux_loss_coeff is not None and self.training and torch.is_grad_enabled():
            output = attach_aux_loss(output, self.deepspeed_moe.l_aux, self.aux_loss_coeff, "MoE")
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def bind_expert_group(layer: MOELayer, topology: Topology | None) -> None:
    """Give `layer` the "ep" group of `topology`, whose ep size must be the layer's, and its "tp" group
    (the Note on tensor parallelism)."""
    tp = 1 if topology is None else topology.size("tp")
    layer._set_tp_group(as_group(topology.group("tp")) if tp > 1 else None, tp)
    size = 1 if topology is None else topology.size("ep")
    if size != layer.ep_size:
        raise MoEArgumentError(f"MoE(ep_size={layer.ep_size}): the run's expert-parallel size is {size}")
    if layer.ep_size == 1:
        layer._set_ep_group(None)
        return
    # the topology's None is the whole world; a gate's None means no expert parallelism
    layer._set_ep_group(as_group(topology.group("ep")))
