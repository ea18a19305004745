"""What the three one-bit optimizers share: the compressed channel, its error buffers and their
checkpointing, DeepSpeed's backend keys, and the flat view of the communicated state.

Owns: `OneBitOptimizer`, the base class. It holds a `OneBitAllReduce` (given, never built from an
engine), one pair of error buffers for the flat buffer of every parameter that has a gradient (one
compressed collective per step, not one per tensor), and answers `owns_gradient_reduction()` for the
strategy. Must not: know the engine or a strategy, or issue collectives other than through its codec.

Note (checkpoints): the error buffers differ from rank to rank and are not one value per element of a
parameter (the server error is this rank's chunk of the flat buffer), so they cannot be sliced like
exp_avg. `gather_error_feedback()` (called by the strategy, on every rank, while it builds its state
dict) puts every rank's buffers into the first param group under `ERROR_FEEDBACK_KEY`, which the
checkpoint saves with the group's hyperparameters; `load_state_dict` takes this rank's row back out.
The same goes for state that differs between ranks for a while (0/1 Adam's local steps: parameters,
momentum and the summed local moves), for which the saved fragments hold rank 0's values. At the same
world size the resumed run continues bit for bit; at another world size the buffers cannot be re-cut
(the chunks are per rank) and start from zero, as DeepSpeed always does on load (its own note: an
occasional reset does not hurt convergence), and every rank continues from rank 0's state, with a
warning.

Note (DeepSpeed's keys): `comm_backend_name` left unset (or "nccl" on an NCCL group, "hccl" on an HCCL
group, "compressed", whose meaning is the same exchange over the group's backend) compresses over the
data-parallel group's own backend; "mpi" (DeepSpeed's mpi4py path) is refused. `cuda_aware` only
concerns that MPI path. `bias_correction` is accepted and, as in DeepSpeed, not applied.
"""

from __future__ import annotations

from typing import Iterable

import torch

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.comm.onebit import OneBitAllReduce

logger = get_logger(__name__)

ERROR_FEEDBACK_KEY = "onebit_error_feedback"
BACKEND_NAMES = ("nccl", "mpi", "hccl", "compressed")


def check_backend(name: str | None, group_backend: str | None, optimizer: str) -> None:
    """Refuse a `comm_backend_name` that does not mean "over the group's own backend"."""
    if name is None or name == "compressed":
        return
    if name not in BACKEND_NAMES:
        raise ValueError(f"optimizer.params.comm_backend_name: {optimizer} takes one of {', '.join(BACKEND_NAMES)} "
                         f"(or leave it unset for the process group's backend), got {name!r}")
    if name == "mpi":
        raise NotImplementedError(f"optimizer.params.comm_backend_name: {optimizer} over MPI (mpi4py) is not "
                                  "implemented; leave it unset to compress over the process group's own backend")
    if group_backend is not None and name != group_backend:
        raise ValueError(f"optimizer.params.comm_backend_name: {name!r} but the data-parallel group runs "
                         f"{group_backend!r}; leave it unset to compress over the group's own backend")


class OneBitOptimizer(torch.optim.Optimizer):
    """Base of OneBitAdam, ZeroOneAdam and OneBitLamb; see the module docstring."""

    display_name = "one-bit optimizer"

    def __init__(self, params: Iterable, defaults: dict, *, codec: OneBitAllReduce, cuda_aware: bool = False,
                 comm_backend_name: str | None = None, bias_correction: bool | None = None,
                 group_backend: str | None = None):
        if not isinstance(codec, OneBitAllReduce):
            raise TypeError(f"{type(self).__name__}: codec must be a lightspeed.comm.onebit.OneBitAllReduce, "
                            f"got {type(codec).__name__}")
        check_backend(comm_backend_name, group_backend, type(self).__name__)
        if cuda_aware and comm_backend_name != "mpi":
            warn_once("optimizer.params.cuda_aware: concerns DeepSpeed's MPI backend only; no effect here", logger)
        if bias_correction is not None:
            warn_once(f"optimizer.params.bias_correction: {type(self).__name__} does not apply bias correction "
                      "(neither does DeepSpeed's); the key has no effect", logger)
        super().__init__(params, defaults)
        self.codec = codec
        self.cuda_aware, self.comm_backend_name = bool(cuda_aware), comm_backend_name
        self._errors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._errors_numel = 0

    # ------------------------------------------------------------------ the strategy's question
    @property
    def world_size(self) -> int:
        return self.codec.world_size

    def steps_done(self) -> int:
        """Steps taken so far (the same in every parameter's state)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    return int(st["step"])
        return 0

    def owns_gradient_reduction(self) -> bool:
        raise NotImplementedError

    @staticmethod
    def _closure_loss(closure):
        """torch.optim's closure convention: re-evaluate the loss with gradients enabled."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    # ------------------------------------------------------------------ flat communication
    def _stepped(self) -> list[tuple[dict, torch.Tensor]]:
        """(group, param) of every parameter with a gradient, in group order."""
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]

    def error_buffers(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._errors is None or self._errors_numel != numel:
            if self._errors is not None:
                raise RuntimeError(f"{type(self).__name__}: the parameters with gradients changed from "
                                   f"{self._errors_numel} to {numel} elements; the compressed state cannot follow")
            self._errors = self.codec.error_buffers(numel, device)
            self._errors_numel = numel
        return self._errors

    def reset_error_feedback(self) -> None:
        if self._errors is not None:
            for e in self._errors:
                e.zero_()

    def compressed_mean(self, tensors: list[torch.Tensor]) -> None:
        """Replace `tensors` (fp32) by their compressed mean over ranks, as one flat buffer."""
        if self.world_size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        worker, server = self.error_buffers(flat.numel(), flat.device)
        self.codec(flat, worker, server)
        pos = 0
        for t in tensors:
            t.view(-1).copy_(flat[pos:pos + t.numel()])
            pos += t.numel()

    # ------------------------------------------------------------------ checkpoints
    #: optimizer-state keys whose values differ from rank to rank (0/1 Adam's local steps), and whether
    #: the parameters themselves do
    per_rank_state: tuple[str, ...] = ()
    per_rank_params = False

    def _with_state(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if "exp_avg" in self.state.get(p, {})]

    def _rank_rows(self) -> dict[str, torch.Tensor]:
        """This rank's tensors that differ from other ranks', each flat."""
        rows: dict[str, torch.Tensor] = {}
        if self._errors is not None:
            rows["worker"], rows["server"] = self._errors
        params = self._with_state()
        if params:
            for key in self.per_rank_state:
                rows[key] = torch.cat([self.state[p][key].reshape(-1).float() for p in params])
            if self.per_rank_params:
                rows["param"] = torch.cat([p.detach().reshape(-1).float() for p in params])
        return rows

    def gather_error_feedback(self) -> None:
        """Collective: every rank's error buffers (and other per-rank state) into
        param_groups[0][ERROR_FEEDBACK_KEY], one row per rank."""
        self.drop_gathered_error_feedback()
        if self.world_size == 1:
            return
        comm, world = self.codec.comm, self.world_size
        gathered = {}
        for key, row in self._rank_rows().items():
            out = torch.empty(world * row.numel(), dtype=row.dtype, device=row.device)
            comm.all_gather(out, row.clone())
            gathered[key] = out.view(world, -1).cpu()
        if gathered:
            self.param_groups[0][ERROR_FEEDBACK_KEY] = {"world_size": world, "numel": self._errors_numel,
                                                        "block": self.codec.block, "rows": gathered}

    def drop_gathered_error_feedback(self) -> None:
        for g in self.param_groups:
            g.pop(ERROR_FEEDBACK_KEY, None)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        saved = None
        for g in state_dict.get("param_groups", []):
            saved = g.pop(ERROR_FEEDBACK_KEY, None) or saved
        super().load_state_dict(state_dict)
        self.drop_gathered_error_feedback()
        self._errors, self._errors_numel = None, 0
        if saved is None:
            if self.world_size > 1 and self.steps_done() > 0:
                logger.warning("%s: the checkpoint holds no error-feedback buffers; they start from zero",
                               type(self).__name__)
            return
        if saved["world_size"] != self.world_size or saved["block"] != self.codec.block:
            logger.warning("%s: the checkpoint's error-feedback buffers belong to %d ranks (this run has %d); they "
                           "start from zero, and every rank continues from data-parallel rank 0's state",
                           type(self).__name__, saved["world_size"], self.world_size)
            return
        rank, rows = self.codec.comm.rank, saved["rows"]
        params = self._with_state()
        for key in [k for k in rows if k not in ("worker", "server")]:
            flat, pos = rows[key][rank], 0
            for p in params:
                target = p if key == "param" else self.state[p][key]
                target.view(-1).copy_(flat[pos:pos + p.numel()].to(target.dtype))
                pos += p.numel()
        if "worker" in rows:
            device = params[0].device if params else torch.device("cpu")
            worker, server = self.codec.error_buffers(int(saved["numel"]), device)
            worker.copy_(rows["worker"][rank])
            server.copy_(rows["server"][rank])
            self._errors, self._errors_numel = (worker, server), int(saved["numel"])
