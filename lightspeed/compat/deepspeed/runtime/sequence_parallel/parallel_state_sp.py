"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: DeepSpeed's module-level sp group accessors,
over this process's record in `lightspeed.comm.sequence_groups`."""

from lightspeed.comm.sequence_groups import SequenceParallelMPU, current_sequence_groups
from lightspeed.comm.sequence_groups import destroy_sequence_parallel as _destroy
from lightspeed.comm.sequence_groups import initialize_sequence_parallel as _initialize


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    _initialize(sequence_parallel_size)


def destroy_sequence_parallel() -> None:
    _destroy()


def _mpu() -> SequenceParallelMPU:
    groups = current_sequence_groups()
    if groups is None:
        raise RuntimeError("parallel_state_sp: the sequence parallel groups are not initialized "
                           "(initialize_sequence_parallel(size) first)")
    return SequenceParallelMPU(groups)


def get_sequence_parallel_group():
    return _mpu().get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return _mpu().get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return _mpu().get_sequence_parallel_rank()


def get_sequence_data_parallel_group():
    return _mpu().get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    return _mpu().get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    return _mpu().get_sequence_data_parallel_rank()
