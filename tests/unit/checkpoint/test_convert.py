"""Consolidation and conversion (checkpoint/convert.py, zero_to_fp32.py, `lightspeed convert to-fp32`):
files written equal DeepSpeed's own consolidation, shard as Hugging Face does, and `from_pretrained`
loads the safetensors output back into the model it came from."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightspeed.checkpoint.convert import open_checkpoint, parse_size, split_shards, consolidation_plan
from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.safetensors_stream import write_safetensors_streaming
from lightspeed.checkpoint.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from lightspeed.testing.deepspeed_layout import write_zero_checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"
WITH_REFERENCE = sorted(p.name for p in FIXTURES.iterdir() if (p / "consolidated.pt").is_file())


def _read_output(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.iterdir()):
        if f.suffix == ".safetensors":
            got.update(load_file(f))
        elif f.suffix == ".bin":
            got.update(torch.load(f, weights_only=True))
    return got


@pytest.mark.parametrize("safe", [False, True])
@pytest.mark.parametrize("case", WITH_REFERENCE)
def test_written_files_equal_deepspeeds_consolidation_in_fp32(case, safe, tmp_path):
    want = torch.load(FIXTURES / case / "consolidated.pt", weights_only=True)
    written = convert_zero_checkpoint_to_fp32_state_dict(str(FIXTURES / case / "ckpt"), tmp_path / "out",
                                                         max_shard_size="300B", safe_serialization=safe)
    got = _read_output(tmp_path / "out")
    assert set(got) == set(want)
    for name, tensor in want.items():
        expected = tensor.float() if tensor.is_floating_point() else tensor
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name
    index = json.loads(Path(written[-1]).read_text())
    assert set(index["weight_map"]) == set(want) and len(written) > 2
    assert {os.path.basename(p) for p in written[:-1]} == set(index["weight_map"].values())


def test_one_file_without_sharding_and_bf16_output(tmp_path):
    case = FIXTURES / "ws2_stage3_bf16" / "ckpt"
    written = convert_zero_checkpoint_to_state_dict(str(case), tmp_path, dtype="bf16", max_shard_size=None,
                                                    safe_serialization=True)
    assert [os.path.basename(p) for p in written] == ["model.safetensors"]
    got = load_file(written[0])
    want = get_fp32_state_dict_from_zero_checkpoint(str(case))
    assert all(got[k].dtype == (torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in want.items())
    assert torch.equal(got["up.weight"], want["up.weight"].bfloat16())


def test_exclude_frozen_and_tied_alias_shares_its_tensor():
    case = str(FIXTURES / "ws2_stage3_fp32" / "ckpt")
    full = get_fp32_state_dict_from_zero_checkpoint(case)
    assert "norm_scale" in full and full["head.weight"] is full["embed.weight"]
    assert "norm_scale" not in get_fp32_state_dict_from_zero_checkpoint(case, exclude_frozen_parameters=True)
    lazy = get_fp32_state_dict_from_zero_checkpoint(case, lazy_mode=True)
    assert torch.equal(lazy["up.weight"].contiguous(), full["up.weight"])


def test_load_state_dict_from_zero_checkpoint_fills_the_model():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mf", FIXTURES / "make_fixtures.py")
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    case = str(FIXTURES / "ws2_stage2_fp32" / "ckpt")
    model = load_state_dict_from_zero_checkpoint(mf.build_model(), case)
    src = DeepSpeedCheckpointSource(case)
    for name, p in model.named_parameters():
        if name in src.param_names():
            assert torch.equal(p.detach(), src.read(name))
    assert model.head.weight is model.embed.weight


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), transformers


@pytest.mark.parametrize("stage", [2, 3])
def test_from_pretrained_loads_converted_safetensors(stage, tmp_path):
    model, transformers = _gpt2()
    named = OrderedDict()
    seen = {}
    shared = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            shared[name] = seen[id(p)]
        else:
            seen[id(p)] = name
            named[name] = p.detach().clone()
    buffers = [n for n, _ in model.named_buffers()]
    state = model.state_dict()
    write_zero_checkpoint(str(tmp_path / "ckpt"), stage=stage, world_size=2,
                          shapes=OrderedDict((n, t.shape) for n, t in named.items()), masters=named,
                          module_state=None if stage == 3 else state, buffer_names=buffers, shared=shared,
                          sub_group_numel=5000)
    out = tmp_path / "hf"
    written = convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), out, max_shard_size="20KB",
                                                         safe_serialization=True)
    assert (out / "model.safetensors.index.json").is_file() and len(written) > 3
    model.config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokens = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_cli_convert_to_fp32(tmp_path, capsys):
    from lightspeed.launcher.cli import main

    rc = main(["convert", "to-fp32", str(FIXTURES / "ws2_stage2_fp32" / "ckpt"), str(tmp_path / "o"),
               "--safetensors", "--max-shard-size", "400B", "--tag", "global_step3"])
    assert rc == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1].endswith("model.safetensors.index.json") and all(os.path.isfile(p) for p in printed)
    assert main(["convert", "to-fp32", str(tmp_path / "missing"), str(tmp_path / "o2")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err


def test_open_checkpoint_of_an_empty_directory(tmp_path):
    (tmp_path / "something.txt").write_text("x")
    with pytest.raises(CheckpointError, match="no checkpoint to read"):
        open_checkpoint(tmp_path)
    src = DeepSpeedCheckpointSource(FIXTURES / "ws1_stage1_fp32" / "ckpt")
    assert open_checkpoint(src) is src


def test_parse_size_and_split_like_hugging_face():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("5 parsecs", "-1", "0"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    from lightspeed.checkpoint.convert import Entry

    f32 = torch.float32
    entries = [Entry("a", "param", torch.Size([10]), f32), Entry("b", "param", torch.Size([30]), f32),
               Entry("c", "param", torch.Size([5]), f32), Entry("d", "param", torch.Size([5]), f32),
               Entry("tied", "alias", torch.Size([10]), f32, "a")]
    shards, total = split_shards(entries, 100, f32, "model.safetensors")
    assert total == 200
    got = {k: [e.name for e in v] for k, v in shards.items()}
    # An entry past the limit becomes a shard of its own at once, before the one being filled.
    assert got == {"model-00001-of-00002.safetensors": ["b"],
                   "model-00002-of-00002.safetensors": ["a", "c", "d", "tied"]}
    hub = pytest.importorskip("huggingface_hub")
    a = torch.empty(10)
    state = {"a": a, "b": torch.empty(30), "c": torch.empty(5), "d": torch.empty(5), "tied": a}
    split = hub.split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=100)
    assert split.filename_to_tensors == got and split.metadata["total_size"] == total


def test_streaming_safetensors_matches_the_library(tmp_path):
    tensors = {"w": torch.randn(3, 5), "h": torch.randn(7, dtype=torch.float64).to(torch.bfloat16),
               "scalar": torch.tensor(2.5), "mask": torch.tensor([True, False, True]),
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "empty": torch.zeros(0, 4)}
    path = str(tmp_path / "s.safetensors")
    write_safetensors_streaming(path, [(k, v.dtype, v.shape) for k, v in tensors.items()], tensors.__getitem__,
                                metadata={"format": "pt"})
    got = load_file(path)
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="declared"):
        write_safetensors_streaming(path, [("w", torch.float16, torch.Size([3, 5]))], tensors.__getitem__)


def test_consolidation_plan_order_is_deepspeeds():
    plan = consolidation_plan(DeepSpeedCheckpointSource(FIXTURES / "ws2_stage2_fp32" / "ckpt"))
    assert [(e.name, e.kind) for e in plan] == [
        ("pos_scale", "buffer"), ("step_count", "buffer"), ("norm_scale", "frozen"), ("embed.weight", "param"),
        ("up.weight", "param"), ("down.weight", "param"), ("up.bias", "param"), ("down.bias", "param"),
        ("head.weight", "alias")]


@pytest.mark.parametrize("case", ["ws2_stage2_fp32", "ws2_stage3_fp32"])
def test_synthetic_writer_lays_out_partitions_as_deepspeed_does(case, tmp_path):
    """lightspeed.testing.deepspeed_layout (the from_pretrained test's and the benchmark's checkpoints)
    puts every master value where real DeepSpeed put it, group by group, rank by rank."""
    from lightspeed.checkpoint.deepspeed_pickle import load_deepspeed_file

    real = FIXTURES / case / "ckpt" / "global_step3"
    stage = 3 if "stage3" in case else 2
    model = load_deepspeed_file(real / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3
                                        else "mp_rank_00_model_states.pt"))
    src = DeepSpeedCheckpointSource(FIXTURES / case / "ckpt")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    real_parts = [load_deepspeed_file(real / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"][key]
                  for r in range(2)]
    for g, shapes in enumerate(model["param_shapes"]):
        masters = {n: src.read(n) for n in shapes}
        tag_dir = write_zero_checkpoint(str(tmp_path / str(g)), stage=stage, world_size=2,
                                        shapes=OrderedDict((n, torch.Size(s)) for n, s in shapes.items()),
                                        masters=masters)
        for r in range(2):
            ours = load_deepspeed_file(os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
            assert torch.equal(ours["optimizer_state_dict"][key][0], real_parts[r][g]), (g, r)


def test_deepspeeds_command_line_arguments(tmp_path):
    from lightspeed.checkpoint.zero_to_fp32 import main

    case = FIXTURES / "ws2_stage3_bf16" / "ckpt"
    assert main([str(case), str(tmp_path / "o"), "--safe_serialization", "-t", "global_step3",
                 "--max_shard_size", "500B", "--exclude_frozen_parameters"]) == 0
    got = _read_output(tmp_path / "o")
    want = get_fp32_state_dict_from_zero_checkpoint(str(case), exclude_frozen_parameters=True)
    assert set(got) == set(want) and "norm_scale" not in got
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing"), str(tmp_path / "o2")])
    assert exit_info.value.code == 2
