"""ZeRO++'s quantized collectives: the int8 weight all-gather (qwZ), the stored int8 shard of frozen
weights, and the hierarchical int4 gradient reduce-scatter (qgZ).

Owns: their wire formats (`lightspeed.ops.quantize`: rows cut into blocks, one fp32 scale per block,
symmetric codes) and byte counts. Must not: decide when they run, or keep anything between calls
(a parameter group's hpZ secondary shard lives in its `ParamGather`).

Note (qwZ, after DeepSpeed's `CUDAQuantizer`): each rank quantizes its shard to int8 with one scale
per `WEIGHT_BLOCK` elements, the codes and scales are all-gathered, and every rank dequantizes the
gathered rows into the compute dtype. *Changed*: DeepSpeed picks per tensor a number of groups so
that each holds close to 8000 elements and divides the tensor; here the blocks are a fixed 4096
elements (the size DeepSpeed's comment calls optimal) of each rank's shard, the last one partial, so
a shard of any length quantizes in one call and the scales cost 1/1024 of the codes' bytes. Codes
are clamped to +-127 (DeepSpeed: -128..127), so zero stays exact and the range symmetric.

Note (qgZ, after DeepSpeed's `all_to_all_quant_reduce`): the padded gradient buffer of W = N nodes x
L ranks is W chunks, chunk k belonging to rank k. Stage 1, within the node: the chunks are regrouped
by the local index of their owner and quantized (int4, one scale per `GRAD_BLOCK` elements of a
chunk); an all-to-all over the node gives local rank l every node rank's copy of the chunks owned by
ranks m * L + l (m = 0..N-1); they are dequantized and summed in fp32. Stage 2, across nodes: the N
partial sums are quantized again and an all-to-all among the ranks with local index l gives each rank
every node's partial sum of its own chunk, dequantized and summed in fp32. Only 1/L of the buffer
crosses nodes, at half a byte per element. *Changed*: fixed 512-element blocks (DeepSpeed: about one
group per row of the weight matrix) so one flat buffer of many parameters is one quantization call;
1-D parameters are quantized too (DeepSpeed reduce-scatters them exactly), because a group's
parameters share one buffer. Error feedback (`zeropp_loco_param`) is not built.
"""

from __future__ import annotations

import torch

from lightspeed.comm.codecs import AllGather
from lightspeed.comm.collectives import DONE, CommStats, Communicator
from lightspeed.comm.node_groups import NodeComms
from lightspeed.ops.quantize import code_bytes, dequantize, num_blocks, quantize

WEIGHT_BITS, WEIGHT_BLOCK = 8, 4096
GRAD_BITS, GRAD_BLOCK = 4, 512


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class QuantizedShard:
    """A shard kept as int8 codes [1, code bytes] and fp32 scales [1, blocks] (ZeRO++'s
    `zero_quantized_nontrainable_weights`), with `numel` values of `dtype`. Reading a range gives a
    dequantized copy; writing one (`shard[a:b] = values`, `copy_`) re-quantizes the whole shard."""

    def __init__(self, values: torch.Tensor, block: int = WEIGHT_BLOCK):
        self.block, self.dtype, self.device = block, values.dtype, values.device
        self._numel = values.numel()
        self.codes, self.scales = quantize(values.reshape(1, -1), WEIGHT_BITS, block)

    def numel(self) -> int:
        return self._numel

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.scales)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self._numel, WEIGHT_BITS, self.block, self.dtype).view(-1)

    def __getitem__(self, index: slice) -> torch.Tensor:
        return self.dequantize()[index]

    def copy_(self, values: torch.Tensor) -> "QuantizedShard":
        self.codes, self.scales = quantize(values.reshape(1, -1).to(self.dtype), WEIGHT_BITS, self.block)
        return self

    def __setitem__(self, index: slice, values: torch.Tensor) -> None:
        full = self.dequantize()
        full[index] = values
        self.copy_(full)


class QuantizedAllGather(AllGather):
    """qwZ: all-gather of int8 codes and block scales, dequantized on arrival into `output`'s dtype.
    `input` is a shard tensor (quantized here) or a `QuantizedShard` (sent as stored)."""

    name = "quantized_all_gather"

    def __init__(self, comm: Communicator, stats: CommStats | None = None, *, name: str | None = None,
                 inter_node_fraction: float | None = None, block: int = WEIGHT_BLOCK):
        super().__init__(comm, stats, name=name, inter_node_fraction=inter_node_fraction)
        self.block = block

    def __call__(self, output: torch.Tensor, input, async_op: bool = False):
        handle, _ = self.gather_payload(output, self.encode(input), async_op=async_op)
        return handle

    def encode(self, shard) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(shard, QuantizedShard):
            if shard.block != self.block:
                raise ValueError(f"QuantizedAllGather: shard quantized in blocks of {shard.block}, "
                                 f"expected {self.block}")
            return shard.codes, shard.scales
        return quantize(shard.reshape(1, -1), WEIGHT_BITS, self.block)

    def gather_payload(self, output: torch.Tensor, payload: tuple[torch.Tensor, ...], async_op: bool = False):
        codes, scales = payload
        world = self.comm.world_size
        rows = codes.shape[0] * world
        n = output.numel() // rows
        if rows * n != output.numel() or codes.shape[1] != code_bytes(n, WEIGHT_BITS) \
                or scales.shape[1] != num_blocks(n, self.block):
            raise ValueError(f"QuantizedAllGather: payload [{codes.shape[0]}, {codes.shape[1]}] per rank does not "
                             f"fill an output of {output.numel()} elements over {world} ranks")
        if world == 1:
            gathered = (codes, scales)
            dequantize(codes, scales, n, WEIGHT_BITS, self.block, out=output)
            return DONE, gathered
        all_codes = codes.new_empty(rows, codes.shape[1])
        all_scales = scales.new_empty(rows, scales.shape[1])
        self._count(_nbytes(all_codes, all_scales))
        h1 = self.comm.all_gather(all_codes, codes.contiguous(), async_op=async_op)
        h2 = self.comm.all_gather(all_scales, scales.contiguous(), async_op=async_op)

        def finish():
            h1.wait()
            h2.wait()
            if all_codes.is_cuda:  # allocated on the gather's (side) stream, read on the current one
                stream = torch.cuda.current_stream(all_codes.device)
                all_codes.record_stream(stream)
                all_scales.record_stream(stream)
            dequantize(all_codes, all_scales, n, WEIGHT_BITS, self.block, out=output)

        if not async_op:
            finish()
            return DONE, (all_codes, all_scales)
        return _Finish(finish), (all_codes, all_scales)


class _Finish:
    def __init__(self, finish):
        self._finish = finish

    def wait(self) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


class QuantizedReduceScatter:
    """qgZ: the sum over ranks of `input` (flat, W x chunk elements), rank r's chunk into `output`, by
    two quantized all-to-alls (within the node, then across nodes; see the module Note). `op` must be
    "sum". Runs to completion (the returned handle is done)."""

    name = "quantized_reduce_scatter"

    def __init__(self, comm: Communicator, nodes: NodeComms, stats: CommStats | None = None, *,
                 bits: int = GRAD_BITS, block: int = GRAD_BLOCK):
        if comm.world_size % nodes.node_size:
            raise ValueError("QuantizedReduceScatter: the node size must divide the world size")
        self.comm, self.nodes, self.bits, self.block = comm, nodes, bits, block
        self.stats = stats if stats is not None else comm.stats

    def wire_bytes(self, numel: int) -> tuple[int, int]:
        """(bytes this rank sends, of which across nodes) for a buffer of `numel` elements."""
        world, local = self.comm.world_size, self.nodes.node_size
        if world == 1:
            return 0, 0
        nodes, chunk = world // local, numel // world
        row = code_bytes(chunk, self.bits) + 4 * num_blocks(chunk, self.block)
        stage1 = world * row if local > 1 else 0
        stage2 = nodes * row if nodes > 1 else 0
        return stage1 + stage2, stage2 * (nodes - 1) // nodes

    def __call__(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False):
        if op != "sum":
            raise ValueError(f"zero_quantized_gradients: the quantized reduce-scatter sums (got op {op!r})")
        world = self.comm.world_size
        if world == 1:
            output.copy_(input)
            return DONE
        local = self.nodes.node_size
        nodes, chunk = world // local, input.numel() // world
        if chunk * world != input.numel() or output.numel() != chunk:
            raise ValueError(f"QuantizedReduceScatter: {input.numel()} elements over {world} ranks into "
                             f"{output.numel()}")
        # [node m, local l, chunk] -> [local l, node m, chunk]: row (l, m) is the chunk of rank m * L + l
        rows = input.reshape(nodes, local, chunk).transpose(0, 1).reshape(local * nodes, chunk)
        if local > 1:
            partial = self._exchange(self.nodes.intra, rows, inter=False).view(local, nodes, chunk).sum(dim=0)
        else:
            partial = rows.float()
        if nodes > 1:
            total = self._exchange(self.nodes.inter, partial, inter=True).sum(dim=0)
        else:
            total = partial[0]
        output.copy_(total.view(-1))
        return DONE

    def _exchange(self, comm: Communicator, rows: torch.Tensor, inter: bool) -> torch.Tensor:
        """All-to-all of `rows` (comm.world_size equal parts, quantized): the fp32 rows received."""
        n = rows.shape[1]
        codes, scales = quantize(rows, self.bits, self.block)
        recv_codes, recv_scales = torch.empty_like(codes), torch.empty_like(scales)
        sent = _nbytes(codes, scales)
        self.stats.add(self.name, sent, sent * (comm.world_size - 1) // comm.world_size if inter else 0)
        comm.all_to_all(recv_codes, codes)
        comm.all_to_all(recv_scales, scales)
        return dequantize(recv_codes, recv_scales, n, self.bits, self.block, torch.float32)
