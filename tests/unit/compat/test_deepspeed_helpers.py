"""DeepSpeed 0.19.8's small public helpers, with DeepSpeed's answers: `deepspeed.runtime.utils`'s
container and norm helpers, `deepspeed.utils`' re-exported groups functions and logging / attribute
helpers, the top-level names (`set_optimizer_flags`, `PipelineEngine`, the callable type aliases, the
refused kernels), and the accelerator's typed constructors and CUDA-graph refusal on CPU. The compat
modules are imported by their lightspeed names."""

import logging
import math

import pytest
import torch

from lightspeed.compat import deepspeed as ds
from lightspeed.compat.deepspeed.runtime import utils as rutils
from lightspeed.compat.deepspeed import utils as dutils


def test_runtime_utils_helpers(tmp_path):
    a, b = torch.ones(2), torch.zeros(1, dtype=torch.float16)
    moved = rutils.move_to_device({"x": [a, (b,)], "y": a}, "meta")
    assert isinstance(moved["x"][1], tuple) and moved["x"][1][0].device.type == "meta"
    assert moved["y"].device.type == "meta" and a.device.type == "cpu"
    p = torch.nn.Parameter(torch.ones(3))
    same = rutils.move_to_device([p], torch.device("cpu"), criterion_func=torch.is_tensor)[0]
    assert same is p  # accepted items are moved in place
    copied = rutils.copy_to_device({"t": a, "n": 3}, "meta", torch.is_tensor)
    assert copied["t"].device.type == "meta" and copied["n"] == 3
    assert rutils.get_global_norm([3.0, torch.tensor(4.0)]) == 5.0
    assert rutils.get_global_norm([1.0, float("nan")]) == float("inf") and rutils.is_invalid_grad_norm(-1.0)
    assert rutils.is_invalid_grad_norm(torch.tensor([1.0, math.inf])) and not rutils.is_invalid_grad_norm(2)
    padded = rutils.align_dense_tensors([torch.ones(3), torch.ones(2)], 4)
    assert [t.numel() for t in padded] == [3, 2, 3] and padded[-1].sum() == 0
    assert len(rutils.align_dense_tensors([torch.ones(4)], 4)) == 1
    assert rutils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12] and rutils.get_only_unique_item([2, 2]) == 2
    with pytest.raises(RuntimeError, match="only one unique element"):
        rutils.get_only_unique_item([1, 2])
    rutils.ensure_directory_exists(str(tmp_path / "a" / "b" / "file.pt"))
    assert (tmp_path / "a" / "b").is_dir()
    rutils.empty_cache()
    with rutils.noop_context():
        pass
    assert rutils.noop_decorator(len) is len


def test_utils_groups_logging_and_attributes(ls_caplog):
    from lightspeed.compat.deepspeed.utils import groups

    assert dutils.get_tensor_model_parallel_world_size() == 1 and dutils.get_model_parallel_rank() == 0
    assert dutils.get_data_parallel_group is groups.get_data_parallel_group
    with pytest.raises(dutils.DeprecatedException, match="pass ep_size"):
        dutils.initialize(ep_size=2)
    for _ in range(3):
        dutils.log_dist_once("said once", ranks=[0], level=logging.WARNING)
    assert ls_caplog.text.count("said once") == 1
    log = logging.getLogger("lightspeed.test_helpers")
    log.addHandler(logging.NullHandler())
    dutils.set_log_level_from_string("Warning", custom_logger=log)
    assert log.level == logging.WARNING and log.handlers[0].level == logging.WARNING
    with pytest.raises(ValueError, match="must be one of debug, info"):
        dutils.set_log_level_from_string("loud", custom_logger=log)
    net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert dutils.recursive_getattr(net, "0.0.weight") is net[0][0].weight
    dutils.recursive_setattr(net, "0.0", torch.nn.Identity())
    assert isinstance(net[0][0], torch.nn.Identity)
    dutils.set_z3_leaf_module(net[0], True)
    assert dutils.get_z3_leaf_modules(net) == [net[0]] and dutils.z3_leaf_module(model=net[0])
    dutils.set_z3_leaf_module(net[0], False)
    assert dutils.get_z3_leaf_modules(net) == []


def test_top_level_names():
    from lightspeed.runtime.pipe_engine import PipelineEngine

    assert ds.dist is None  # as in DeepSpeed
    assert ds.PipelineEngine is PipelineEngine and ds.MUON_OPTIMIZER == "muon" and ds.git_hash == "[none]"
    assert ds.DeepSpeedOptimizerCallable is ds.runtime.engine.DeepSpeedOptimizerCallable
    for name, feature in (("DeepSpeedTransformerLayer", "fused transformer layer kernels"),
                          ("DualPipeVEngine", "DualPipeV"), ("DeepSpeedDataLoader", "deepspeed_io builds"),
                          ("InferenceEngine", "init_inference prepares")):
        assert getattr(ds, name) is getattr(ds, name)
        with pytest.raises(NotImplementedError, match=feature):
            getattr(ds, name)()
    with pytest.raises(NotImplementedError, match="kernel injection"):
        ds.replace_transformer_layer(None, None)


def test_set_optimizer_flags_tags_muon_parameters():
    class Cfg:
        optimizer_name, optimizer_params = "muon", {"lr": 0.01}

    net = torch.nn.ModuleDict({"embed": torch.nn.Embedding(4, 2), "proj": torch.nn.Linear(2, 2)})
    ds.set_optimizer_flags(Cfg(), net)
    assert [p.use_muon for p in net.parameters()] == [False, True, False]
    assert all(p.muon_num_heads is None for p in net.parameters())
    Cfg.optimizer_params = {"per_head_muon": True}
    with pytest.raises(NotImplementedError, match="per_head_muon"):
        ds.set_optimizer_flags(Cfg(), net)
    Cfg.optimizer_name = "adamw"
    other = torch.nn.Linear(2, 2)
    ds.set_optimizer_flags(Cfg(), other)
    assert not hasattr(other.weight, "use_muon")


def test_accelerator_typed_constructors_and_graphs():
    from lightspeed._utils.accelerator import CpuAccelerator

    acc, env = CpuAccelerator(), {}
    assert acc.FloatTensor is torch.FloatTensor and acc.LongTensor([1]).dtype == torch.int64
    assert acc.BFloat16Tensor([1.0]).dtype == torch.bfloat16 and acc.is_fp64_supported()
    assert acc.export_envs() == [] and not acc.is_current_stream_capturing()
    acc.set_visible_devices_envs(env, [0, 1])
    assert env == {}  # the CPU accelerator names no visible-devices variable
    for call in (acc.create_graph, lambda: acc.capture_to_graph(None), lambda: acc.replay_graph(None)):
        with pytest.raises(NotImplementedError, match="CUDA graphs"):
            call()


def test_zero_param_names():
    from lightspeed.compat.deepspeed.runtime.zero import partition_parameters as pp
    from lightspeed.compat.deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    assert ds.runtime.zero.ZeroParamStatus is pp.ZeroParamStatus and ds.zero.ZeroParamType is pp.ZeroParamType
    assert [t.value for t in pp.ZeroParamType] == [1, 2, 3] and ds.runtime.zero.DeepSpeedZeRoOffload is DeepSpeedZeRoOffload
    plain = torch.nn.Parameter(torch.ones(1))
    assert not pp.is_zero_param(plain)
    plain.ds_id = 0
    assert pp.is_zero_param(plain)


def test_accelerator_host_buffers_deepspeed_0_19():
    from lightspeed._utils.accelerator import CpuAccelerator

    acc, t = CpuAccelerator(), torch.arange(6.0).reshape(2, 3)
    assert acc.pin_memory(t) is t and acc.pin_memory(t, align_bytes=64) is t
    fresh = acc.pin_memory(t, make_copy=False)
    assert fresh is not t and fresh.shape == (2, 3) and fresh.dtype == t.dtype
    assert acc.pin_memory(t, make_copy=False, match_shape=False).shape == (6,)
    assert acc.pin_empty(2, 4, dtype=torch.bfloat16).shape == (2, 4)
    assert acc.pin_empty((5,), dtype=torch.int32).dtype == torch.int32
    assert acc.pin_empty_like(t, dtype=torch.float16).shape == (2, 3) and acc.pin_memory_alignment() == 1
    with pytest.raises(ValueError, match="device must be cpu"):
        acc.pin_empty(2, dtype=torch.float32, device="meta")
    acc.range_push("step", category=1)
    acc.range_pop()
    assert acc.supports_nvtx_domain() is False
    with pytest.raises(NotImplementedError, match="NVTX domains"):
        acc.range_push("step", domain="zero")
