"""The one-bit compressed all-reduce with error feedback (1-bit Adam, 0/1 Adam, 1-bit LAMB).

Owns: the wire format (sign bits packed 8 per byte, `lightspeed.ops.onebit`, plus one fp32 scale per
block of `block` elements), the two-phase exchange and its byte count. Must not: keep the error
buffers (the optimizer owns them, so they are saved with it) or know an optimizer.

Note (the exchange, after DeepSpeed's runtime/comm/nccl.py `compressed_allreduce`): the flat buffer
(padded to a multiple of world * block) is cut into one chunk per rank. Worker phase: every rank adds
its worker error, compresses (sign times the block's RMS), keeps what compression lost as the new
worker error, and sends chunk j to rank j (all-to-all of bits and scales). Server phase: rank j
averages the compressed chunks it received, adds its server error, compresses again (keeping the new
server error), and every rank gathers every rank's compressed chunk (all-gather). The result, the same
on every rank, is the mean of the inputs up to what the two error buffers carry to the next call.

*Changed* from DeepSpeed: a scale per block of `block` elements instead of one per tensor, so one flat
buffer can hold many parameters of different magnitudes (DeepSpeed compresses 1-bit Adam tensor by
tensor, and rescales LAMB's momenta before fusing them); and the error at padding positions is kept at
zero, so the error buffers hold one value per real element. Bytes per rank and call, for n elements:
n/8 + 4n/block (all-to-all) plus (n/8 + 4n/block)/world (all-gather), against 4n for an fp32
all-reduce.
"""

from __future__ import annotations

import torch

from lightspeed.comm.collectives import CommStats, Communicator
from lightspeed.ops.onebit import pack_signs, unpack_signs

DEFAULT_BLOCK = 256  # elements per scale: 1/64 byte of scale per element next to 1/8 of sign


class OneBitAllReduce:
    """Mean over the ranks of `comm` of a flat fp32 buffer, compressed to signs and block scales, with
    worker and server error feedback (see the module docstring). World size 1 returns the input."""

    name = "onebit_all_reduce"

    def __init__(self, comm: Communicator, stats: CommStats | None = None, block: int = DEFAULT_BLOCK):
        if block <= 0 or block % 8:
            raise ValueError(f"OneBitAllReduce: block must be a positive multiple of 8, got {block}")
        self.comm = comm
        self.stats = stats if stats is not None else comm.stats
        self.block = block

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def padded_numel(self, numel: int) -> int:
        unit = self.world_size * self.block
        return max(-(-numel // unit), 1) * unit

    def error_buffers(self, numel: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (worker error, server error) for a buffer of `numel` elements."""
        padded = self.padded_numel(numel)
        return (torch.zeros(padded, dtype=torch.float32, device=device),
                torch.zeros(padded // self.world_size, dtype=torch.float32, device=device))

    def wire_bytes(self, numel: int) -> int:
        """Bytes one rank sends for one call on `numel` elements."""
        if self.world_size == 1:
            return 0
        padded = self.padded_numel(numel)
        per_elem = padded // 8 + 4 * (padded // self.block)
        return per_elem + per_elem // self.world_size

    def _compress(self, x: torch.Tensor, error: torch.Tensor, real: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Signs and block scales of `x` (modified: the error is added); the new error goes to `error`."""
        blocks = x.view(-1, self.block)
        scales = torch.linalg.vector_norm(blocks, dim=1).div_(self.block ** 0.5)
        signs = torch.where(blocks >= 0, 1.0, -1.0)
        error.copy_((blocks - signs * scales[:, None]).view(-1))
        error[real:].zero_()
        return pack_signs(x), scales

    def __call__(self, buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
        """Replace `buffer` (1-D fp32) by the compressed mean over ranks; update both error buffers."""
        world = self.world_size
        if world == 1:
            return
        numel, padded = buffer.numel(), worker_error.numel()
        if buffer.dim() != 1 or padded != self.padded_numel(numel) or server_error.numel() != padded // world:
            raise ValueError(f"OneBitAllReduce: a 1-D buffer of {numel} elements needs a worker error of "
                             f"{self.padded_numel(numel)} and a server error of {self.padded_numel(numel) // world} "
                             f"elements, got {tuple(buffer.shape)}, {worker_error.numel()}, {server_error.numel()}")
        chunk, rank = padded // world, self.comm.rank
        x = torch.zeros(padded, dtype=torch.float32, device=buffer.device)
        x[:numel].copy_(buffer)
        x.add_(worker_error)
        bits, scales = self._compress(x, worker_error, numel)
        recv_bits, recv_scales = torch.empty_like(bits), torch.empty_like(scales)
        self.comm.all_to_all(recv_bits, bits)
        self.comm.all_to_all(recv_scales, scales)
        # server: the mean of the workers' compressed copies of this rank's chunk, plus its own error
        server = unpack_signs(recv_bits, padded, recv_scales, self.block).view(world, chunk).mean(dim=0)
        server.add_(server_error)
        real = min(max(numel - rank * chunk, 0), chunk)
        server_bits, server_scales = self._compress(server, server_error, real)
        all_bits = torch.empty(padded // 8, dtype=torch.uint8, device=buffer.device)
        all_scales = torch.empty(padded // self.block, dtype=torch.float32, device=buffer.device)
        self.comm.all_gather(all_bits, server_bits)
        self.comm.all_gather(all_scales, server_scales)
        buffer.copy_(unpack_signs(all_bits, numel, all_scales, self.block))
        self.stats.add(self.name, self.wire_bytes(numel))
