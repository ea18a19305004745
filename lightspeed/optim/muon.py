"""Muon with an auxiliary AdamW (DeepSpeed's MuonWithAuxAdam), stepping whole parameters or ZeRO shards.

Owns: the two kinds of param group (`use_muon` True: Muon; False: Adam) with DeepSpeed's defaults,
the Muon step over whatever tensors the optimizer holds (whole parameters, or the flat master shards /
shard pieces of a ZeRO stage, described by their fragments), the plan that hands each whole matrix to
one data-parallel rank for its Newton-Schulz iteration and brings the result back to the ranks that
hold its pieces, and the inline Adam step of the other groups. Must not: reduce or clip gradients,
know a ZeRO stage, or write low-precision parameters (the shared step does: zero/sharded_step.py).

Note [step]: per Muon group, with beta = `momentum`: momentum <- lerp(momentum, grad, 1 - beta); the
Nesterov blend u = lerp(grad, momentum, beta); U = NS(u) * sqrt(max(1, rows / cols)) per matrix
(lightspeed.ops.muon); p <- p * (1 - lr * weight_decay) - lr * U. Adam groups: bias-corrected Adam
with betas/eps, decoupled weight decay (`adam_w_mode`, default) or L2 into the gradient. These are
DeepSpeed's formulas; the momentum and Adam moments are elementwise, so they live and are stepped in
the shards like Adam's (each rank its own elements), and only the orthogonalisation needs whole matrices.

Note [whole matrices]: `attach(fragments, comm)` tells the optimizer which pieces of which parameter
each of its tensors holds, on every rank of `comm` (an all_gather_object of the tables, once). Every
matrix gets one rank (greedy by Newton-Schulz cost, largest first, a rank's load counted lower by the
share of the matrix it holds, so that matrices mostly stay where they are): that rank
receives the other ranks' pieces of the blend (one all_to_all), iterates, and sends each holder its
piece of the result (a second all_to_all). No rank gathers every matrix; with every matrix whole on
every rank (stage 0) nothing is gathered and each result goes to the other ranks; at one rank nothing
moves. Each piece must be held by exactly one rank, or the whole matrix by every rank (else an error
at `attach`). Unattached (plain PyTorch use) each tensor is a whole parameter.

Note [clipping]: as DeepSpeed. At ZeRO 0, and at ZeRO 1 with bf16 parameters accumulating gradients in
fp32 (DeepSpeed's BF16_Optimizer), the gradients are clipped, then Muon runs on them. Otherwise at
ZeRO 1-3 Muon runs first, between the overflow check and the
norm (`before_norm`, called by the shared step: `attach(..., update_before_clip=True)`): the global
norm is taken over the orthogonalised updates of the Muon matrices and the gradients of the Adam
ones, and `gradient_clipping` scales both.

Note [differences from DeepSpeed]: DeepSpeed keeps a matrix's momentum when its gradient holds
inf/nan; here the loss-scaled step is skipped before the optimizer runs (as for Adam), and without
loss scaling a non-finite gradient reaches the momentum. Under fp16 the momentum takes the unscaled
gradient (DeepSpeed's ZeRO 1-3 fold the loss-scaled one in, which differs once the scale changes).
Not built, and refused: `per_head_muon`, the optimizer offloaded and checkpoints in DeepSpeed's layout
(`checkpoint.format: "deepspeed"`), each naming its key; expert (MoE) parameters, at `attach`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightspeed.comm.collectives import Communicator
from lightspeed.config.errors import ConfigError
from lightspeed.ops.muon import NS_METHODS, NS_STEPS, orthogonalize

__all__ = ["Muon", "MUON_DEFAULTS", "ADAM_DEFAULTS", "muon_param_groups", "muon_updates_before_clip",
           "tag_muon_params"]

MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


_MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def muon_updates_before_clip(cfg, policy) -> bool:
    """DeepSpeed's order for this config (Note [clipping]): the ZeRO optimizers of stages 1-3 orthogonalise
    before the norm; its engine (stage 0) and its BF16_Optimizer (stage 1 with bf16 parameters and
    `data_types.grad_accum_dtype` fp32, which DeepSpeed routes there) clip first."""
    stage = cfg.zero_optimization.stage
    bf16_optimizer = (stage == 1 and policy.param_dtype == torch.bfloat16
                      and policy.grad_accum_dtype == torch.float32)
    return stage > 0 and not bf16_optimizer


def tag_muon_params(module: torch.nn.Module) -> None:
    """DeepSpeed's rule: `use_muon` on every parameter of 2+ dims (its layer shape: `ds_shape` under
    zero.Init) whose name holds neither "embed" nor "lm_head"; False on the others."""
    for name, p in module.named_parameters():
        shape = getattr(p, "ds_shape", None)
        shape = tuple(p.shape) if shape is None else tuple(shape)
        p.use_muon = len(shape) >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def muon_param_groups(model_parameters, hyper: dict) -> list[dict]:
    """Each incoming group (or the loose tensors) split into its Muon and Adam halves, as DeepSpeed's
    engine does: the config's shared keys, then `muon_lr` / `adam_lr`, then the group's own keys; groups
    named `muon-params` / `adam-params` (`<name or groupN>-...` with several incoming groups)."""
    groups, loose = [], []
    for item in model_parameters:
        (groups if isinstance(item, dict) else loose).append(item)
    if loose or not groups:
        groups.append({"params": loose})
    missing = [p for g in groups for p in g["params"] if not hasattr(p, "use_muon")]
    if missing:
        raise ConfigError(f"optimizer.type: Muon needs every parameter tagged with use_muon, and {len(missing)} are "
                         "not (initialize() tags the model's; set `param.use_muon = True / False` on others)")
    halves = []
    for use_muon, label, keys, override in ((True, "muon", _MUON_KEYS, "muon_lr"),
                                            (False, "adam", _ADAM_KEYS, "adam_lr")):
        defaults = {k: hyper[k] for k in keys if hyper.get(k) is not None}
        if hyper.get(override) is not None:
            defaults["lr"] = hyper[override]
        halves.append((use_muon, label, keys, defaults))
    out = []
    for index, group in enumerate(groups):
        overrides = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, defaults in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            settings = {**defaults, **{k: v for k, v in overrides.items() if k in keys}}
            prefix = overrides.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append(dict(params=half, use_muon=use_muon, name=name, **settings))
    return out


@dataclass
class _Matrix:
    name: str
    shape: tuple[int, ...]
    group: int  # optimizer param group index
    ns_rank: int  # the rank that orthogonalises it
    pieces: list[tuple[int, int, int]]  # (rank, start, end) of the flattened matrix, every holder
    local: list[tuple[int, int, torch.Tensor, int]] = field(default_factory=list)  # (start, end, owner, offset) here

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class Muon(torch.optim.Optimizer):
    """DeepSpeed's MuonWithAuxAdam: groups with `use_muon` True step Muon, the others Adam.
    `reference`: the plain PyTorch Newton-Schulz (else the fast path; lightspeed.ops.muon)."""

    def __init__(self, param_groups, adam_w_mode: bool = True, reference: bool = False, ns_steps: int = NS_STEPS):
        groups = []
        for group in param_groups:
            if not isinstance(group, dict) or "use_muon" not in group:
                raise ValueError("Muon: every param group needs a `use_muon` key (True: Muon, False: Adam)")
            defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
            group = {**defaults, **group}
            if group["use_muon"] and group["ns_method"] not in NS_METHODS:
                raise ValueError(f"Muon: ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
            groups.append(group)
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode
        self.reference = reference
        self.ns_steps = ns_steps
        self._plan: _Plan | None = None
        self._update_before_clip = False
        self._updates_in_grads = False
        self._attached = False  # a ZeRO stage's tensors: their gradients are the stage's buffers

    # ------------------------------------------------------------------------------------------
    def attach(self, fragments, comm: Communicator, update_before_clip: bool = False) -> None:
        """Step the pieces `fragments` describe (objects with name, shape, start, end, owner, offset:
        lightspeed.zero.fragments.Fragment) over `comm`'s ranks (see Note [whole matrices]).
        `update_before_clip`: orthogonalise in `before_norm` (see Note [clipping])."""
        self._plan = _Plan.build(self, fragments, comm)
        self._update_before_clip = update_before_clip
        self._attached = True

    @torch.no_grad()
    def before_norm(self, grads: dict, loss_scale: float | None) -> None:
        """The shared step's hook between the overflow check and the norm (zero/sharded_step.py): with
        `update_before_clip`, each Muon tensor's gradient in `grads` (tensor -> gradient, still carrying
        `loss_scale`) becomes its orthogonalised update times `loss_scale`."""
        if not self._update_before_clip:
            return
        scale = loss_scale or 1.0
        mine = [grads[p] for g in self.param_groups if g["use_muon"] for p in g["params"] if p in grads]
        if scale != 1.0:
            torch._foreach_div_(mine, scale)
        # in place: the blend, then the update, take the gradient's memory (no shard-sized temporaries)
        blends = self._blends({id(p): grads[p] for g in self.param_groups if g["use_muon"] for p in g["params"]
                               if p in grads}, in_place=True)
        self._plan.orthogonalize(blends, out=blends)
        if scale != 1.0:
            torch._foreach_mul_(mine, scale)
        self._updates_in_grads = True

    def _own_plan(self) -> "_Plan":
        if self._plan is None:  # plain use: every tensor a whole parameter, on this rank alone
            frags = [_Whole(f"{gi}.{i}", tuple(p.shape), p) for gi, g in enumerate(self.param_groups)
                     if g["use_muon"] for i, p in enumerate(g["params"])]
            self._plan = _Plan.build(self, frags, Communicator(None, 1))
        return self._plan

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(g["use_muon"] for g in self.param_groups):
            self._muon_step()
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adam_group(group)
        return loss

    def _blends(self, grads: dict[int, torch.Tensor], in_place: bool = False) -> dict[int, torch.Tensor]:
        """Advance each Muon tensor's momentum by its gradient (`grads`: id -> gradient; zeros where
        absent) and return the Nesterov blends (written into the gradients with `in_place`)."""
        blends: dict[int, torch.Tensor] = {}
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            beta = group["momentum"]
            for p in group["params"]:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                momentum = state["momentum_buffer"]
                grad = grads.get(id(p))
                grad = torch.zeros_like(momentum) if grad is None else grad.to(momentum.dtype)
                momentum.lerp_(grad, 1 - beta)
                blends[id(p)] = grad.lerp_(momentum, beta) if in_place else grad.lerp(momentum, beta)
        return blends

    def _muon_step(self) -> None:
        if self._updates_in_grads:  # before_norm left the (clipped) updates in the gradients
            self._updates_in_grads = False
            updates = {id(p): p.grad for g in self.param_groups if g["use_muon"] for p in g["params"]}
        else:
            grads = {id(p): p.grad for g in self.param_groups if g["use_muon"] for p in g["params"]
                     if p.grad is not None}
            if self._attached:  # the stage's gradient buffers take the blends, then the updates, in place
                blends = self._blends(grads, in_place=True)
                updates = self._plan.orthogonalize(blends, out=blends)
            else:  # plain use: the caller's .grad stays the gradient
                updates = self._own_plan().orthogonalize(self._blends(grads))
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                update = updates.get(id(p))
                if update is None:  # a tensor the step handed no gradient (frozen)
                    continue
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.view(p.shape), alpha=-group["lr"])

    def _adam_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if not self.adam_w_mode:
                grad = grad.add(p, alpha=group["weight_decay"])
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] = 0
            state["step"] += 1
            step = state["step"]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.lerp_(grad.square(), 1 - beta2)
            update = (exp_avg / (1 - beta1 ** step)) / ((exp_avg_sq / (1 - beta2 ** step)).sqrt() + group["eps"])
            if self.adam_w_mode:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-group["lr"])

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch casts "step" to a tensor only for its own optimizers
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = int(state["step"])


@dataclass
class _Whole:
    name: str
    shape: tuple[int, ...]
    owner: torch.Tensor
    start: int = 0
    offset: int = 0

    @property
    def end(self) -> int:
        return self.owner.numel()


class _Plan:
    """Which rank orthogonalises each matrix, and what each rank sends and receives (Note [whole matrices])."""

    def __init__(self, optimizer: Muon, comm: Communicator, matrices: list[_Matrix], owners: list[torch.Tensor]):
        self.opt, self.comm, self.matrices, self.owners = optimizer, comm, matrices, owners
        rank, world = comm.rank, comm.world_size
        # gather: pieces I hold of matrices another rank orthogonalises (when that rank lacks them)
        self.send = [[] for _ in range(world)]  # dst -> [(owner, offset, numel)]
        self.recv = [[] for _ in range(world)]  # src -> [(matrix, start, end)]
        # scatter: results of matrices I orthogonalise, to the other holders of their pieces
        self.back_send = [[] for _ in range(world)]  # dst -> [(matrix, start, end)]
        self.back_recv = [[] for _ in range(world)]  # src -> [(owner, offset, numel)]
        counts = [[0] * world for _ in range(world)]
        back_counts = [[0] * world for _ in range(world)]
        for m in matrices:
            whole_at_ns = _covers(m.pieces, m.ns_rank, m.numel)
            for r, start, end in m.pieces:
                if r == m.ns_rank:
                    continue
                if not whole_at_ns:
                    counts[r][m.ns_rank] += end - start
                    if r == rank:
                        self.send[m.ns_rank].append(self._local(m, start, end))
                    if m.ns_rank == rank:
                        self.recv[r].append((m, start, end))
                back_counts[m.ns_rank][r] += end - start
                if m.ns_rank == rank:
                    self.back_send[r].append((m, start, end))
                if r == rank:
                    self.back_recv[m.ns_rank].append(self._local(m, start, end))
        self.chunk = max(max(row) for row in counts) if world > 1 else 0
        self.back_chunk = max(max(row) for row in back_counts) if world > 1 else 0

    @staticmethod
    def _local(m: _Matrix, start: int, end: int):
        for s, e, owner, offset in m.local:
            if s == start and e == end:
                return owner, offset, end - start
        raise AssertionError(f"{m.name}: piece [{start}, {end}) is not on this rank")

    @classmethod
    def build(cls, optimizer: Muon, fragments, comm: Communicator) -> "_Plan":
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) if g["use_muon"] for p in g["params"]}
        mine = [f for f in fragments if id(f.owner) in group_of]
        table = [(f.name, tuple(f.shape), f.start, f.end, group_of[id(f.owner)]) for f in mine]
        tables = comm.all_gather_object(table)
        by_name: dict[str, _Matrix] = {}
        for r, rows in enumerate(tables):
            for name, shape, start, end, gi in rows:
                m = by_name.setdefault(name, _Matrix(name, shape, gi, -1, []))
                if m.shape != shape or m.group != gi:
                    raise ValueError(f"Muon: parameter {name} has shape {shape} / group {gi} on rank {r} but "
                                     f"{m.shape} / {m.group} on another")
                m.pieces.append((r, start, end))
        for f in mine:
            by_name[f.name].local.append((f.start, f.end, f.owner, f.offset))
        matrices = sorted(by_name.values(), key=lambda m: m.name)
        for m in matrices:
            if len(m.shape) < 2:
                raise ValueError(f"Muon: parameter {m.name} of shape {m.shape} is in a use_muon group, but Muon "
                                 "orthogonalises matrices only (tag it use_muon = False)")
            _check_tiling(m, comm.world_size)
        load = [0] * comm.world_size
        for m in sorted(matrices, key=lambda m: (-m.numel * min(m.shape[-2:]), m.name)):
            held = [0] * comm.world_size
            for r, s, e in m.pieces:
                held[r] += e - s
            cost = m.numel * min(m.shape[-2:])
            # the least loaded rank, a rank's load counted lower by the part of the matrix it holds already
            m.ns_rank = min(range(comm.world_size), key=lambda r: (load[r] + cost * (1 - held[r] / m.numel), r))
            load[m.ns_rank] += cost
        owners = list({id(f.owner): f.owner for f in mine}.values())
        return cls(optimizer, comm, matrices, owners)

    def orthogonalize(self, blends: dict[int, torch.Tensor], out: dict[int, torch.Tensor] | None = None
                      ) -> dict[int, torch.Tensor]:
        """The orthogonalised update of every owner tensor, from the Nesterov blends (same layout), written
        into `out` (id -> tensor of the owner's layout; may be the blends themselves: each matrix's elements
        are read, sent or copied before its result is written) or new zeroed tensors."""
        rank, world = self.comm.rank, self.comm.world_size
        opt = self.opt
        any_tensor = next(p for g in opt.param_groups for p in g["params"])
        some = next(iter(blends.values()), torch.empty(0, device=any_tensor.device))  # dtype and device
        if out is None:
            out = {id(o): torch.zeros_like(blends[id(o)]) for o in self.owners}
        received = {}
        if world > 1 and self.chunk:
            send = torch.zeros(world * self.chunk, dtype=some.dtype, device=some.device)
            for dst, items in enumerate(self.send):
                pos = dst * self.chunk
                for owner, offset, n in items:
                    send[pos:pos + n] = blends[id(owner)].view(-1)[offset:offset + n]
                    pos += n
            recv = torch.empty_like(send)
            self.comm.all_to_all(recv, send)
            for src, items in enumerate(self.recv):
                pos = src * self.chunk
                for m, start, end in items:
                    received[(m.name, start)] = recv[pos:pos + end - start]
                    pos += end - start
        results: dict[str, torch.Tensor] = {}
        for m in self.matrices:
            if m.ns_rank != rank:
                continue
            whole = None
            if len(m.local) == 1 and m.local[0][1] - m.local[0][0] == m.numel:
                _, _, owner, offset = m.local[0]
                whole = blends[id(owner)].view(-1)[offset:offset + m.numel]
            else:
                whole = torch.empty(m.numel, dtype=some.dtype, device=some.device)
                for start, end, owner, offset in m.local:
                    whole[start:end] = blends[id(owner)].view(-1)[offset:offset + end - start]
                for r, start, end in m.pieces:
                    if r != rank and (m.name, start) in received:
                        whole[start:end] = received[(m.name, start)]
            group = opt.param_groups[m.group]
            u = orthogonalize(whole.view(m.shape), opt.ns_steps, group["ns_method"], reference=opt.reference)
            u = u.reshape(-1)
            if any(r != rank for r, _, _ in m.pieces):  # other holders receive pieces of it below
                results[m.name] = u
            for start, end, owner, offset in m.local:
                out[id(owner)].view(-1)[offset:offset + end - start].copy_(u[start:end])
        if world > 1 and self.back_chunk:
            send = torch.zeros(world * self.back_chunk, dtype=some.dtype, device=some.device)
            for dst, items in enumerate(self.back_send):
                pos = dst * self.back_chunk
                for m, start, end in items:
                    send[pos:pos + end - start].copy_(results[m.name][start:end])
                    pos += end - start
            recv = torch.empty_like(send)
            self.comm.all_to_all(recv, send)
            for src, items in enumerate(self.back_recv):
                pos = src * self.back_chunk
                for owner, offset, n in items:
                    out[id(owner)].view(-1)[offset:offset + n] = recv[pos:pos + n]
                    pos += n
        return out


def _covers(pieces, rank: int, numel: int) -> bool:
    """Whether `rank`'s pieces make the whole matrix."""
    return sum(e - s for r, s, e in pieces if r == rank) == numel


def _check_tiling(m: _Matrix, world: int) -> None:
    """Each element held by exactly one rank, or the whole matrix by every rank."""
    if world > 1 and all(_covers(m.pieces, r, m.numel) for r in range(world)):
        return
    spans = sorted((s, e) for _, s, e in m.pieces)
    pos = 0
    for s, e in spans:
        if s != pos:
            raise ValueError(f"Muon: the pieces of {m.name} over the data-parallel ranks neither tile it nor are "
                             f"each whole (elements {pos}..{s}); Muon steps ZeRO 0-3 over one data-parallel group "
                             "(expert-parallel parameters are not built for it)")
        pos = e
    if pos != m.numel:
        raise ValueError(f"Muon: the pieces of {m.name} cover {pos} of its {m.numel} elements")
