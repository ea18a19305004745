"""`lightspeed report` and `lightspeed config check|show`, in process."""

import json
from pathlib import Path

import pytest

from lightspeed.launcher.report import KERNEL_FAMILIES, NOT_PRESENT, KernelFamily, Machine, family_status

SHARED = Path("/work/shared/configs")


def test_report_prints_every_section(cli):
    code, out, err = cli("report")
    assert code == 0, err
    for heading in ("versions", "GPUs", "launchers (for multi-node jobs)", "kernel families"):
        assert f"\n{heading}\n" in out
    for key in ("lightspeed", "torch", "triton", "CUDA (torch build)", "NCCL"):
        assert f"\n  {key} " in out
    for family in KERNEL_FAMILIES:
        assert f"\n  {family.title} " in out


def _machine(**kw):
    base = dict(lightspeed="0", lightspeed_path="", python="", torch="", torch_path="", cuda_build=None,
                cuda_available=False, nccl=None, triton=None, gpus=[], accelerator_env=None, programs={})
    return Machine(**{**base, **kw})


def test_kernel_family_status_says_why():
    missing = KernelFamily("x", "lightspeed.ops.no_such_family", ())
    assert family_status(missing, _machine()) == (NOT_PRESENT, "lightspeed.ops.no_such_family does not exist yet")
    no_names = KernelFamily("x", "lightspeed.launcher.errors", ("FusedThing",))
    assert family_status(no_names, _machine()) == (NOT_PRESENT, "lightspeed.launcher.errors has no FusedThing yet")
    gpu = KernelFamily("x", "lightspeed.launcher.errors", (), min_capability=(8, 0))
    assert family_status(gpu, _machine()) == ("no", "torch is a CPU-only build (no CUDA)")
    assert family_status(gpu, _machine(cuda_build="12.4")) == ("no", "no CUDA GPU seen")
    v100 = [("V100", (7, 0), 16 << 30)]
    assert family_status(gpu, _machine(cuda_build="12.4", gpus=v100)) == ("no", "triton is not installed")
    assert family_status(gpu, _machine(cuda_build="12.4", gpus=v100, triton="3.1")) == \
        ("no", "needs compute capability 8.0 or newer (V100 is older)")
    h100 = [("H100", (9, 0), 80 << 30)]
    assert family_status(gpu, _machine(cuda_build="12.4", gpus=h100, triton="3.1"))[0] == "yes"
    assert family_status(KernelFamily("x", "lightspeed.launcher.errors", (), needs="cpu"), _machine()) == ("yes", "runs on the CPU")
    # the fused optimizers run without their kernel (the reference step), and the report says so
    fused = next(f for f in KERNEL_FAMILIES if f.title == "fused Adam/AdamW")
    assert family_status(fused, _machine()) == (
        "yes (reference)", "torch is a CPU-only build (no CUDA): the optimizer steps with its plain-PyTorch reference "
                           "(no Triton kernel)")
    assert family_status(fused, _machine(cuda_build="12.4", gpus=h100, triton="3.1"))[0] == "yes"
    broken = KernelFamily("x", "lightspeed.launcher.no_such", (), without_kernel="y")
    assert family_status(broken, _machine())[0] == NOT_PRESENT


def test_every_listed_kernel_family_is_present():
    """The report lists what this version ships: a family whose module or names moved shows up here."""
    for family in KERNEL_FAMILIES:
        status, why = family_status(family, _machine())
        assert status != NOT_PRESENT, (family.title, why)


GOOD = '{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}'
BAD = '{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 7}, "fp16": {"enabledd": true}}'


def test_config_check_good_file(cli, tmp_path):
    (tmp_path / "good.json").write_text(GOOD)
    code, out, err = cli("config", "check", "good.json", "--world-size", "2")
    assert code == 0, out + err
    assert out.splitlines() == [
        "good.json: valid for world size 2: train_batch_size=32, train_micro_batch_size_per_gpu=4, "
        "gradient_accumulation_steps=4",
        "result: OK",
    ]


def test_config_check_lists_every_problem_with_its_path(cli, tmp_path):
    (tmp_path / "bad.json").write_text(BAD)
    code, out, err = cli("config", "check", "bad.json", "--world_size", "2")
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == "bad.json: problems:" and lines[-1] == "result: invalid"
    problems = lines[1:-1]
    assert any(p.startswith("  zero_optimization.stage:") for p in problems)
    assert any(p.startswith("  fp16.enabledd:") for p in problems)
    assert any("train_batch_size" in p for p in problems)  # 30 is not 4 x 2 x gas


def test_config_check_lists_unimplemented_settings_separately(cli, tmp_path):
    (tmp_path / "quantized.json").write_text(
        '{"train_batch_size": 8, "zero_optimization": {"stage": 2, "zero_quantized_gradients": true}}')
    code, out, err = cli("config", "check", "quantized.json")
    assert code == 1
    assert out.splitlines()[1:] == [
        "not implemented yet in lightspeed (1; lightspeed.initialize refuses them):",
        "  zero_optimization.zero_quantized_gradients=true is not implemented yet",
        "result: valid, but uses settings lightspeed does not implement yet",
    ]


def test_config_show_fills_defaults_and_resolves_the_triad(cli, tmp_path):
    (tmp_path / "good.json").write_text(GOOD)
    code, out, err = cli("config", "show", "good.json", "--world-size", "4")
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["train_batch_size"], shown["train_micro_batch_size_per_gpu"], shown["gradient_accumulation_steps"]) \
        == (32, 4, 2)
    assert shown["zero_optimization"]["stage"] == 0 and "fp16" in shown and "bf16" in shown
    (tmp_path / "bad.json").write_text(BAD)
    code, out, err = cli("config", "show", "bad.json")
    assert code == 1 and out == "" and err.startswith("bad.json: invalid config:\n  ")


def test_config_errors(cli, tmp_path):
    code, out, err = cli("config", "check", "missing.json")
    assert code == 1 and "missing.json: config file not found" in out
    code, out, err = cli("config", "check", "x.json", "--world-size", "0")
    assert (code, err) == (2, "lightspeed: error: --world-size must be at least 1 (got 0)\n")
    code, out, err = cli("config", "frobnicate", "x.json")
    assert code == 2 and err.startswith("lightspeed config: error: argument ACTION: invalid choice: 'frobnicate'")


@pytest.mark.skipif(not SHARED.is_dir(), reason="no shared ds_config collection on this machine")
@pytest.mark.parametrize("name, code, expected", [
    ("microsoft__DeepSpeedExamples__pipeline_parallelism_ds_config.json", 0, "result: OK"),
    ("microsoft__DeepSpeedExamples__bing_bert_onebitadam_nccl.json", 0, "result: OK"),
    ("microsoft__DeepSpeedExamples__zero_infinity_nvme.json", 1,
     '  zero_optimization.stage3_param_persitance_threshold: unknown key; did you mean "stage3_param_persistence_threshold"?'),
    ("huggingface__transformers__ds_config_zero2.json", 0, "result: OK"),  # a template: "auto"s are placeholders
    ("huggingface__accelerate__zero_stage2_offload_config.json", 0, "result: OK"),
])
def test_config_check_on_real_configs(cli, name, code, expected):
    path = SHARED / name
    if not path.is_file():
        pytest.skip(f"{name} is not in {SHARED}")
    got, out, err = cli("config", "check", path, "--world-size", "2")
    assert got == code and expected in out.splitlines(), out


def test_config_check_runs_initializes_validation_and_lists_unimplemented_settings_with_problems(cli, tmp_path):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 7}, "trackio": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": "fast", "weight_decy": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}}
    (tmp_path / "c.json").write_text(json.dumps(config))
    code, out, err = cli("config", "check", "c.json")
    assert code == 1, err
    assert out.splitlines() == [
        "c.json: problems:",
        "  zero_optimization.stage: must be 0, 1, 2 or 3 (got 7)",
        '  optimizer.params.lr: must be a number >= 0 (got "fast")',
        '  optimizer.params.weight_decy: unknown key; did you mean "weight_decay"?',
        "  scheduler.params.warmup_num_steps: must be a positive integer (got -5)",
        "not implemented yet in lightspeed (1; lightspeed.initialize refuses them):",
        "  trackio.enabled=true is not implemented yet",
        "result: invalid",
    ]


TEMPLATE = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "total_num_steps": "auto"}},
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"}}


def test_config_check_reads_a_template_s_autos_as_placeholders_and_reports_the_rest(cli, tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(TEMPLATE))
    code, out, err = cli("config", "check", "t.json")  # detected: the file holds "auto"
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith('t.json: Hugging Face template: "auto" read as a placeholder the HF Trainer or '
                               "Accelerate fills in (9: train_batch_size, train_micro_batch_size_per_gpu, "
                               "gradient_clipping, bf16.enabled, optimizer.params.lr, ")
    assert "zero_optimization" not in lines[0]  # DeepSpeed itself takes its default for those
    assert lines[1:] == ["t.json: no other problems", "result: OK"]
    assert cli("config", "check", "t.json", "--hf")[1] == out

    broken = {**TEMPLATE, "zero_optimization": {"stage": 5, "reduce_bucket_size": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decy": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1, "warmup_max_lr": "auto"}}}
    (tmp_path / "b.json").write_text(json.dumps(broken))
    code, out, err = cli("config", "check", "b.json")
    assert code == 1
    problems = [line for line in out.splitlines() if line.startswith("  ")]
    assert problems[0] == "  zero_optimization.stage: must be 0, 1, 2 or 3 (got 5)"
    assert any(p.startswith("  optimizer.params.weight_decy:") for p in problems)
    assert any(p.startswith("  scheduler.params.warmup_num_steps:") for p in problems)
    assert not any('"auto"' in p or "optimizer.params.lr" in p for p in problems) and out.endswith("result: invalid\n")


def test_config_check_no_hf_checks_a_template_as_initialize_takes_it(cli, tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(TEMPLATE))
    code, out, err = cli("config", "check", "t.json", "--no-hf")
    assert code == 1
    assert "Hugging Face template" not in out.splitlines()[0]
    assert '  train_batch_size: must be a concrete value (got "auto")' in out.splitlines()
    assert '  zero_optimization.reduce_bucket_size: must be a concrete value (got "auto")' not in out.splitlines()
    (tmp_path / "plain.json").write_text(GOOD)
    code, out, err = cli("config", "check", "plain.json", "--hf")  # no "auto": nothing set aside
    assert code == 0 and out.splitlines()[0].startswith('plain.json: Hugging Face template: "auto" read as a '
                                                         "placeholder the HF Trainer or Accelerate fills in (0)")
