"""Ulysses pieces that need no processes: argument checks and their messages, world size 1."""

import pytest
import torch

from lightspeed.comm.differentiable import all_gather_autograd, seq_all_to_all
from lightspeed.comm.sequence_groups import (SequenceParallelMPU, build_sequence_groups, check_sequence_parallel_size,
                                             sequence_parallel_mpu)
from lightspeed.sequence import DistributedAttention, UlyssesSPAttentionHF
from lightspeed.sequence.ulysses_hf import check_heads


def test_sizes_are_checked_naming_the_key():
    check_sequence_parallel_size(2, 4)
    with pytest.raises(ValueError, match="sequence_parallel_size=3 does not divide the world size 4"):
        check_sequence_parallel_size(3, 4)
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive integer"):
        check_sequence_parallel_size(0, 4)
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        check_heads(6, 6, 4)
    with pytest.raises(ValueError, match="does not divide the model's 2 key/value heads"):
        check_heads(8, 2, 4)


def test_one_process():
    assert build_sequence_groups(1).sp_world_size == 1
    with pytest.raises(RuntimeError, match="sequence_parallel_size=2 needs torch.distributed"):
        build_sequence_groups(2)
    x = torch.randn(2, 4, 3, requires_grad=True)
    assert torch.equal(seq_all_to_all(x, None, 1, 0), x)  # nothing to exchange
    gathered = all_gather_autograd(x, None)
    assert gathered.shape == (1, 2, 4, 3)
    gathered.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_mpu_choice():
    assert sequence_parallel_mpu(None, 1) is None

    class SP:
        def get_sequence_parallel_world_size(self):
            return 2

    mpu = SP()
    assert sequence_parallel_mpu(mpu, 1) is mpu and sequence_parallel_mpu(mpu, 2) is mpu
    with pytest.raises(ValueError, match="sequence_parallel_size=4 in the config, but the mpu"):
        sequence_parallel_mpu(mpu, 4)
    assert hasattr(SequenceParallelMPU, "get_sequence_data_parallel_group")


def test_distributed_attention_arguments():
    with pytest.raises(NotImplementedError, match="sp_stream"):
        DistributedAttention(lambda q, k, v: q, None, sp_stream=object())
    attn = DistributedAttention(lambda q, k, v: q + k + v, None)
    q = torch.ones(4, 1, 2, 3)
    torch.testing.assert_close(attn(q, q, q), 3 * q)  # world size 1: the local attention alone
    with pytest.raises(ValueError, match="batch_dim_idx must be 0"):
        attn(q, q, q, 2)
    with pytest.raises(NotImplementedError, match="rotary_pos_emb"):
        attn(q, q, q, 1, (q, q))


def test_register_with_transformers_arguments():
    assert UlyssesSPAttentionHF.register_with_transformers("unused", "sdpa", 1, 1) is None  # sp 1: nothing to do
    with pytest.raises(ValueError, match="pass seq_length"):
        UlyssesSPAttentionHF.register_with_transformers("unused", "sdpa", 2, 1, seq_length_is_variable=False)
    with pytest.raises(ValueError, match="core_attn_implementation='eager' is not supported"):
        UlyssesSPAttentionHF.register_with_transformers("unused", "eager", 2, 1)
