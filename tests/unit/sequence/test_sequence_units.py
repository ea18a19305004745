"""Ulysses pieces that need no processes: argument checks and their messages, world size 1."""

import pytest
import torch

from lightspeed.comm.differentiable import all_gather_autograd, seq_all_to_all
from lightspeed.comm.sequence_groups import (SequenceParallelMPU, build_sequence_groups, check_sequence_parallel_size,
                                             sequence_groups_from_topology, sequence_parallel_mpu)
from lightspeed.comm.topology import MeshShape, Topology
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


def test_heads_under_tensor_parallelism_are_the_tp_ranks_share():
    check_heads(8, 4, 2, tp_size=2)  # 4 and 2 heads per tp rank, 2 and 1 per rank after the all-to-all
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 does not divide the 1 key/value heads each "
                                         r"tensor-parallel rank holds \(the model's 2 / autotp_size=2\)"):
        check_heads(8, 2, 2, tp_size=2)
    with pytest.raises(ValueError, match="sequence_parallel_size=4 does not divide the 2 attention heads each"):
        check_heads(4, 4, 4, tp_size=2)


@pytest.mark.parametrize("world, rank, want", [
    # tp2 x sp2: sp strided by tp; the reduce group dp x sp is the sp group
    (4, 1, {"sp_ranks": (1, 3), "sp_rank": 0, "dp_world_size": 1, "seq_dp_world_size": 2, "seq_dp_rank": 0}),
    (4, 2, {"sp_ranks": (0, 2), "sp_rank": 1, "dp_world_size": 1, "seq_dp_world_size": 2, "seq_dp_rank": 1}),
    # tp2 x sp2 x dp2: rank 5 is tp 1, sp 0, dp 1
    (8, 5, {"sp_ranks": (5, 7), "sp_rank": 0, "dp_world_size": 2, "dp_rank": 1, "seq_dp_world_size": 4,
            "seq_dp_rank": 2}),
])
def test_record_is_the_meshs_sp_dim_under_tensor_parallelism(world, rank, want):
    groups = sequence_groups_from_topology(Topology(MeshShape.for_world(world, tp=2, sp=2), rank, 0, {}))
    assert groups.sp_world_size == 2
    assert {key: getattr(groups, key) for key in want} == want


def test_without_tensor_parallelism_the_mesh_is_deepspeeds_consecutive_layout():
    shape = MeshShape.for_world(8, sp=4)
    assert shape.all_groups("sp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # what build_sequence_groups creates
    assert shape.all_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]] and shape.size("dp_sp") == 8


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
