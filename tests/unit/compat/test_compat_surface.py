"""The DeepSpeed surface lightspeed provides, without processes: the accelerator object on CPU,
add_config_arguments, DeepSpeedConfig, "auto" refused by config.load, RepeatingLoader,
clone_tensors_for_torch_save, and the modules transformers and accelerate import (each name real, or
NotImplementedError naming the missing feature). Nothing here registers `deepspeed`: the compat modules
are imported by their lightspeed names."""

import argparse
import importlib
import time

import pytest
import torch

import lightspeed
from lightspeed._utils.accelerator import CpuAccelerator, get_accelerator
from lightspeed.config.errors import ConfigError


def test_accelerator_on_cpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    acc = CpuAccelerator()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert get_accelerator().device_name() == expected and get_accelerator() is get_accelerator()
    assert acc.device_name() == acc.device_name(3) == acc.current_device_name() == "cpu"
    assert acc.current_device() == 1 and acc.device_count() == 2 and acc.is_available()
    assert acc.communication_backend_name() == "gloo"
    assert acc.supported_dtypes() == [torch.float32, torch.float16, torch.bfloat16]
    assert acc.is_bf16_supported() and acc.is_fp16_supported() and acc.is_synchronized_device()
    assert acc.on_accelerator(torch.zeros(1)) and not acc.on_accelerator(torch.zeros(1, device="meta"))
    t = torch.ones(3)
    assert acc.pin_memory(t) is t and acc.is_pinned(t) is False
    acc.set_device(0)
    acc.synchronize()

    # random numbers
    acc.manual_seed(5)
    state = acc.get_rng_state()
    a = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    assert acc.default_generator(0) is torch.default_generator and acc.random() is torch.random

    # streams and events: immediate, events time on the host clock
    stream = acc.Stream()
    with acc.stream(stream):
        start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
        start.record()
        time.sleep(0.02)
        end.record()
    stream.synchronize()
    stream.wait_stream(acc.current_stream())
    assert 15 <= start.elapsed_time(end) < 2000 and end.query()
    with pytest.raises(RuntimeError, match="recorded"):
        acc.Event().elapsed_time(end)
    assert acc.current_stream() is acc.default_stream()

    # memory: this process's resident set, and the machine's
    acc.reset_peak_memory_stats()
    base = acc.memory_allocated()
    import mmap

    big = mmap.mmap(-1, 64 * 2**20)  # 64 MiB of fresh pages (an allocator could reuse resident ones), touched
    big.write(b"\x01" * (64 * 2**20))
    assert acc.memory_allocated() > base + 32 * 2**20
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    big.close()
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < base + 48 * 2**20
    assert acc.memory_stats()["allocated_bytes.all.current"] > 0
    assert acc.total_memory() >= acc.available_memory() > 0
    with pytest.raises(NotImplementedError, match="no C\\+\\+/CUDA"):
        acc.create_op_builder("CPUAdamBuilder")


def test_add_config_arguments_and_deepscale_config(ls_caplog):
    parser = lightspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "ds.json", False,
                                                                                             None)
    from lightspeed.compat.deepspeed import add_config_arguments

    args = add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepscale_config", "old.json"])
    from lightspeed.runtime.initialize import _config_source

    assert _config_source(args, None, None) == "old.json"
    assert "--deepscale_config is deprecated" in ls_caplog.text
    args.deepspeed_config = "new.json"
    with pytest.raises(ConfigError, match="both args.deepspeed_config and the deprecated args.deepscale_config"):
        _config_source(args, None, None)


def test_config_load_refuses_hugging_face_auto_values():
    with pytest.raises(ConfigError) as err:
        lightspeed.config.load({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, world_size=1)
    text = str(err.value)
    assert '"auto" is a Hugging Face placeholder' in text
    for path in ("train_micro_batch_size_per_gpu", "gradient_clipping", "optimizer.params.lr"):
        assert f'{path}: must be a concrete value (got "auto")' in text


def test_steps_per_print_infinity_means_never():
    for value in (float("inf"), None):  # accelerate's setting, and DeepSpeed's null
        cfg = lightspeed.config.load({"train_micro_batch_size_per_gpu": 1, "steps_per_print": value}, world_size=1)
        assert cfg.steps_per_print is None
    with pytest.raises(ConfigError, match="steps_per_print: must be a positive integer"):
        lightspeed.config.load({"train_micro_batch_size_per_gpu": 1, "steps_per_print": -float("inf")}, world_size=1)


def test_deepspeed_config_reads_lightspeeds_config(tmp_path):
    from lightspeed.compat.deepspeed import DeepSpeedConfig

    class Mpu:
        def get_data_parallel_world_size(self):
            return 4

    cfg = DeepSpeedConfig({"train_batch_size": 32, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                           "fp16": {"enabled": True, "initial_scale_power": 12},
                           "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
                           "zero_optimization": {"stage": 2}}, mpu=Mpu())
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 4, 2)
    assert cfg.world_size == 4 and cfg.zero_optimization_stage == 2 and cfg.zero_enabled
    assert cfg.fp16_enabled and not cfg.bfloat16_enabled and cfg.initial_dynamic_scale == 2**12
    assert cfg.dynamic_loss_scale_args["init_scale"] == 2**12
    assert (cfg.optimizer_name, cfg.optimizer_params) == ("adamw", {"lr": 0.001})
    assert (cfg.scheduler_name, cfg.scheduler_params) == ("WarmupLR", {"warmup_num_steps": 10})
    assert cfg.gradient_clipping == 1.0 and cfg._param_dict["gradient_clipping"] == 1.0
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true}}')
    cfg = DeepSpeedConfig(str(path))
    assert cfg.bfloat16_enabled and cfg.train_batch_size == 2 and cfg.zero_optimization_stage == 0
    with pytest.raises(ConfigError, match="Hugging Face placeholder"):
        DeepSpeedConfig({"train_batch_size": "auto"})


def test_repeating_loader_and_clone_tensors():
    from lightspeed.compat.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from lightspeed.compat.deepspeed.utils import RepeatingLoader

    loader = RepeatingLoader(torch.utils.data.DataLoader(torch.arange(5), batch_size=2))
    assert [next(loader).tolist() for _ in range(5)] == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    flat = torch.arange(6.0, requires_grad=True)
    state = {"a": flat[:2], "nested": [flat[2:4], (flat[4:], 7)]}
    cloned = clone_tensors_for_torch_save(state)
    a = cloned["a"]
    assert a.untyped_storage().nbytes() == 2 * 4 and not a.requires_grad and torch.equal(a, flat[:2].detach())
    assert isinstance(cloned["nested"][1], tuple) and cloned["nested"][1][1] == 7
    assert clone_tensors_for_torch_save(torch.ones(2), device="meta").device.type == "meta"


# modules transformers and accelerate import, by their DeepSpeed names
MODULES = ["", ".comm", ".zero", ".accelerator", ".runtime", ".runtime.engine", ".runtime.config",
           ".runtime.lr_schedules", ".runtime.dataloader", ".runtime.utils", ".runtime.zero",
           ".runtime.precision_config", ".runtime.zero.config", ".runtime.zero.offload_config", ".runtime.zero.stage3",
           ".runtime.zero.partition_parameters", ".runtime.sequence_parallel.ulysses_sp", ".ops", ".ops.adam",
           ".ops.adagrad", ".ops.lion", ".utils", ".utils.groups", ".checkpoint", ".checkpoint.utils",
           ".launcher.runner", ".checkpointing", ".pipe", ".utils.zero_to_fp32", ".accelerator.real_accelerator",
           ".comm.comm", ".runtime.activation_checkpointing.checkpointing", ".git_version_info",
           ".utils.torch", ".ops.op_builder",
           ".runtime.sequence_parallel.parallel_state_sp", ".sequence", ".sequence.layer", ".moe", ".moe.layer",
           ".moe.utils", ".moe.sharded_moe", ".moe.experts", ".compression", ".compression.compress", ".compression.helper", ".compression.scheduler",
           ".runtime.config_utils", ".runtime.zero.stage_1_and_2", ".runtime.fp16.fused_optimizer",
           ".runtime.fp16.unfused_optimizer", ".runtime.fp16.loss_scaler", ".runtime.swap_tensor", ".ops.aio"]


@pytest.mark.parametrize("suffix", MODULES)
def test_compat_modules_import(suffix):
    importlib.import_module("lightspeed.compat.deepspeed" + suffix)


def test_names_transformers_and_accelerate_use():
    ds = importlib.import_module("lightspeed.compat.deepspeed")
    from lightspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from lightspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from lightspeed.ops.lion import DeepSpeedCPULion
    from lightspeed.runtime.engine import LightspeedEngine

    assert ds.__version__ == "0.19.8" and (ds.__version_major__, ds.__version_minor__) == (0, 19)
    assert ds.DeepSpeedEngine is LightspeedEngine and ds.runtime.engine.DeepSpeedEngine is LightspeedEngine
    assert ds.zero.Init is lightspeed.zero.Init and ds.zero.GatheredParameters is lightspeed.zero.GatheredParameters
    assert ds.runtime.zero.partition_parameters.Init is lightspeed.zero.Init
    assert ds.ops.adam.FusedAdam is FusedAdam and ds.ops.adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam
    assert ds.ops.adagrad.DeepSpeedCPUAdagrad is DeepSpeedCPUAdagrad and ds.ops.lion.DeepSpeedCPULion is DeepSpeedCPULion
    assert ds.runtime.lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                                                          "WarmupCosineLR"]
    assert ds.get_accelerator() is get_accelerator() and ds.utils.is_initialized() is False
    assert ds.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert ds.runtime.utils.see_memory_usage("not forced") is None
    from lightspeed.sequence import DistributedAttention, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    ulysses = ds.runtime.sequence_parallel.ulysses_sp
    assert ulysses.UlyssesSPAttentionHF is UlyssesSPAttentionHF
    assert ulysses.UlyssesSPDataLoaderAdapter is UlyssesSPDataLoaderAdapter
    assert ds.sequence.layer.DistributedAttention is DistributedAttention
    # no sequence parallelism in this process: DeepSpeed's answers
    groups = ds.utils.groups
    assert groups._get_sequence_parallel_group() is None and groups._get_sequence_parallel_world_size() == 1
    assert groups._get_sequence_parallel_rank() == 0


@pytest.mark.parametrize("call, feature", [
    (lambda ds: ds.zero.MiCS_Init(), "MiCS"),
    (lambda ds: ds.zero.TiledLinear(2, 2), "tiled linear"),
    (lambda ds: ds.checkpoint.DeepSpeedCheckpoint("dir"), "universal checkpoints"),
    (lambda ds: ds.runtime.sequence_parallel.ulysses_sp.TiledMLP(), "ALST tiled compute"),
    (lambda ds: ds.runtime.sequence_parallel.ulysses_sp.sequence_tiled_compute(None), "ALST tiled compute"),
    (lambda ds: ds.accelerator.set_accelerator(None), "custom accelerators"),
    (lambda ds: ds.compression.init_compression(torch.nn.Linear(2, 2), "ds.json"),
     "deepspeed.compression.compress.init_compression: model compression"),
    (lambda ds: ds.compression.compress.redundancy_clean(torch.nn.Linear(2, 2), "ds.json"), "model compression"),
    (lambda ds: ds.compression.compression_scheduler(None, {}), "model compression"),
])
def test_missing_features_raise_naming_them(call, feature):
    ds = importlib.import_module("lightspeed.compat.deepspeed")
    with pytest.raises(NotImplementedError, match=feature):
        call(ds)
    assert hasattr(ds.utils, "set_z3_leaf_modules") and hasattr(ds, "PipelineModule")  # names exist, as DeepSpeed's


def test_checkpointing_is_lightspeeds():
    ds = importlib.import_module("lightspeed.compat.deepspeed")
    import lightspeed.checkpointing as ls

    for name in ("checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker", "CudaRNGStatesTracker",
                 "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint", "CheckpointFunction"):
        assert getattr(ds.checkpointing, name) is getattr(ls, name)
        assert getattr(ds.runtime.activation_checkpointing.checkpointing, name) is getattr(ls, name)


def test_zero_to_fp32_is_lightspeeds_consolidation():
    ds = importlib.import_module("lightspeed.compat.deepspeed")
    from lightspeed.checkpoint import zero_to_fp32

    assert ds.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint is \
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint


@pytest.mark.no_real_deepspeed
def test_transformers_arange_guard_works_around_zero_init():
    """transformers' prevent_arange_dtype_change swaps partition_parameters' constructor hook around
    `from_pretrained`'s zero.Init; the names it reads exist, and the swap is undone. (In a subprocess:
    transformers reads is_deepspeed_available() when its DeepSpeed module is first imported.)"""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent("""
        import torch
        import lightspeed
        lightspeed.register_as_deepspeed()
        from deepspeed.runtime.zero import partition_parameters as pp
        from transformers.integrations.deepspeed import prevent_arange_dtype_change

        original = pp.zero_wrapper_for_fp_tensor_constructor
        with prevent_arange_dtype_change():
            assert pp.zero_wrapper_for_fp_tensor_constructor is not original
            with lightspeed.zero.Init():
                layer = torch.nn.Linear(2, 3)
                steps = torch.arange(4, dtype=torch.float64)
        assert pp.zero_wrapper_for_fp_tensor_constructor is original
        assert layer.weight.numel() == 0 and layer.weight.ds_shape == (3, 2) and steps.dtype == torch.float64
        made = original(torch.ones, torch.float16, "cpu")(2)
        assert made.dtype == torch.float16 and made.device.type == "cpu"
        assert original(torch.arange, torch.float16)(3).dtype == torch.int64
        print("OK")
    """)
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


@pytest.mark.no_real_deepspeed
def test_report_shows_the_deepspeed_version_presented():
    from lightspeed.launcher.report import format_report, gather

    machine = gather()
    assert machine.deepspeed_api == "0.19.8" and machine.deepspeed_installed is None
    assert "DeepSpeed API          0.19.8" in format_report(machine)


def test_initialize_accepts_the_autos_deepspeed_accepts():
    """TRL builds its ZeRO-3 reference model from the HF template with the batch resolved and the
    zero_optimization "auto"s left: DeepSpeed takes its defaults for those, and so does lightspeed."""
    from lightspeed.testing.models import TinyMLP

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto",
                                    "stage3_gather_16bit_weights_on_model_save": True}}
    engine, optimizer, _, _ = lightspeed.initialize(model=TinyMLP(), config=config, dist_init_required=False)
    default = lightspeed.config.load({"train_micro_batch_size_per_gpu": 2}, world_size=1)
    assert optimizer is None and engine.zero_optimization_stage() == 3
    assert engine.config.zero_optimization.stage3_prefetch_bucket_size == \
        default.zero_optimization.stage3_prefetch_bucket_size
    with pytest.raises(ConfigError, match='gradient_clipping: must be a concrete value'):
        lightspeed.initialize(model=TinyMLP(), config={**config, "gradient_clipping": "auto"}, dist_init_required=False)


@pytest.mark.parametrize("client", ["instance", "callable"])
def test_initialize_returns_a_view_equal_to_and_an_instance_of_the_optimizer(client):
    """DeepSpeed returns the client's optimizer itself where it does not wrap it: its users compare it
    (`opt == client_optimizer`) and test its class; the view also carries `overflow` and refuses `step`."""
    from lightspeed.compat.deepspeed import initialize

    model = torch.nn.Linear(4, 4)
    given = torch.optim.Adam(model.parameters()) if client == "instance" else (lambda p: torch.optim.AdamW(p))
    engine, opt, _, _ = initialize(model=model, optimizer=given, model_parameters=list(model.parameters()),
                                   config={"train_batch_size": 1}, dist_init_required=False)
    assert opt == engine.optimizer and opt.param_groups is engine.optimizer.param_groups
    assert isinstance(opt, torch.optim.Adam if client == "instance" else torch.optim.AdamW)
    assert opt.overflow is False and len({opt, engine.optimizer}) == 2  # hashable, by identity
    if client == "instance":
        assert opt == given
    with pytest.raises(RuntimeError, match="stepped by engine.step"):
        opt.step()


def test_stage0_fp16_optimizer_view_reads_deepspeeds_loss_scale_and_steps_an_assigned_grad():
    """DeepSpeed's stage-0 fp16 optimizers: every overflow halves the scale (no hysteresis), the returned
    optimizer carries `cur_scale` / `cur_iter` / `scale_window` / `dynamic_loss_scale`, and `step()` reads a
    `.grad` the user assigned (an inf there is an overflow)."""
    from lightspeed.compat.deepspeed import initialize

    model = torch.nn.Linear(3, 1)
    cfg = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}}  # hysteresis 2 by default
    engine, opt, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                   dist_init_required=False)
    assert opt.dynamic_loss_scale is True and (opt.cur_scale, opt.scale_window, opt.cur_iter) == (16, 2, 0)
    before = [p.detach().clone() for p in engine.module.parameters()]
    for value, scale in ((float("inf"), 8), (float("nan"), 4)):
        for p in engine.module.parameters():
            p.grad = torch.full_like(p, value)
        engine.step()
        assert opt.overflow and opt.cur_scale == scale
    assert opt.cur_iter == 2 and all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    for p in engine.module.parameters():
        p.grad = torch.full_like(p, 0.5)
    engine.step()
    assert not opt.overflow and not torch.equal(before[0], engine.module.weight)
    plain, plain_opt, _, _ = initialize(model=torch.nn.Linear(3, 1), config={"train_batch_size": 1},
                                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), dist_init_required=False)
    with pytest.raises(AttributeError, match="fp16 is not enabled"):
        plain_opt.cur_scale


def test_deepspeed_0_19_8_names_present_or_recorded_absent():
    """Every public name of DeepSpeed 0.19.8's engine, pipeline engine, `deepspeed`, `deepspeed.comm`,
    `deepspeed.utils` and accelerator (recorded in deepspeed_0_19_8_surface.json) exists here, except the
    recorded absences, each with its reason; an absence that is built since must leave the record."""
    import json
    from pathlib import Path

    from lightspeed.runtime.engine import LightspeedEngine
    from lightspeed.runtime.pipe_engine import PipelineEngine

    record = json.loads((Path(__file__).parent / "deepspeed_0_19_8_surface.json").read_text())
    ds = importlib.import_module("lightspeed.compat.deepspeed")
    importlib.import_module("lightspeed.compat.deepspeed.comm.comm")  # a submodule, as DeepSpeed's deepspeed.comm.comm
    owners = {"DeepSpeedEngine": LightspeedEngine, "PipelineEngine (beyond DeepSpeedEngine)": PipelineEngine,
              "deepspeed": ds, "deepspeed.comm": ds.comm, "deepspeed.utils": ds.utils,
              "get_accelerator()": get_accelerator()}
    for surface, names in record["names"].items():
        absent = {n for group in record["absent"].get(surface, {}).values() for n in group}
        missing = [n for n in names if n not in absent and not hasattr(owners[surface], n)]
        built = sorted(n for n in absent if hasattr(owners[surface], n))
        assert not missing, f"{surface}: DeepSpeed 0.19.8 names missing here: {missing}"
        assert not built, f"{surface}: recorded absent but present now (drop them from the record): {built}"
