"""QuantizedShard: a frozen group's shard kept as int8 codes and block scales (no processes)."""

import torch

from lightspeed.comm.quantized import QuantizedShard


def test_reads_dequantize_and_writes_requantize():
    v = torch.randn(100, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    shard = QuantizedShard(v, block=16)
    assert shard.numel() == 100 and shard.nbytes == 100 + 4 * 7  # codes + one fp32 scale per 16
    back = shard.dequantize()
    assert back.dtype == torch.bfloat16
    step = v.float().abs().max() / 127
    assert (back.float() - v.float()).abs().max() <= step
    assert torch.equal(shard[3:9], back[3:9])
    shard[16:32] = torch.zeros(16)  # one whole block: the others re-quantize to what they held
    after = shard.dequantize()
    assert torch.all(after[16:32] == 0)
    torch.testing.assert_close(after[:16], back[:16], rtol=2**-7, atol=0)
    torch.testing.assert_close(after[32:], back[32:], rtol=2**-7, atol=0)
    shard.copy_(torch.ones(100))
    assert torch.equal(shard.dequantize(), torch.ones(100, dtype=torch.bfloat16))
