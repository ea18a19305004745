"""Sources: dict, path (str or PathLike), JSON string; hjson syntax; parse errors with file:line."""

import pytest

from lightspeed.config import ConfigError, LightspeedConfig, load


def write(tmp_path, text, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_path_str_pathlike_and_string(tmp_path):
    text = '{"train_batch_size": 8}'
    path = write(tmp_path, text)
    for source in (path, str(path), text, "  \n" + text, {"train_batch_size": 8}):
        cfg = load(source, world_size=1)
        assert isinstance(cfg, LightspeedConfig) and cfg.train_micro_batch_size_per_gpu == 8
    assert load(path, world_size=1).source == str(path)
    assert load(text, world_size=1).source == "<string>"


def test_hjson_comments_and_trailing_commas(tmp_path):
    path = write(tmp_path, ' {\n  // micro batch\n  "train_micro_batch_size_per_gpu": 2, # per GPU\n  /* block */\n  "fp16": {"enabled": true,},\n}\n')
    cfg = load(path, world_size=1)
    assert cfg.fp16.enabled and cfg.train_batch_size == 2


def test_malformed_file_names_file_and_line(tmp_path):
    path = write(tmp_path, '{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true\n  "bf16": [1, }\n}\n')
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value).startswith(f"{path}:4:")
    assert "not valid JSON/HJSON" in str(info.value)


def test_malformed_string_names_line():
    with pytest.raises(ConfigError, match=r"^<string>:2:\d+: not valid JSON/HJSON"):
        load('{"train_batch_size": 8,\n "x": [1, }')


def test_duplicate_key_is_an_error_naming_the_key(tmp_path):
    path = write(tmp_path, '{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true},\n  "train_batch_size": 16\n}\n')
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == f'{path}:4: duplicate key "train_batch_size" (a key may appear once per object)'


def test_nested_duplicate_key(tmp_path):
    path = write(tmp_path, '{"fp16": {"enabled": true, "enabled": false}, "bf16": {"enabled": false}}')
    with pytest.raises(ConfigError, match='duplicate key "enabled"'):
        load(path)


def test_missing_file_and_wrong_source_type(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="must be a dict, a path"):
        load(42)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load(write(tmp_path, "[1, 2]"))


def test_base64_config_string():
    """DeepSpeed takes a config as URL-safe base64 of its JSON (its autotuner passes one on the command line)."""
    import base64

    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 8, "gradient_accumulation_steps": 2}').decode()
    cfg = load(encoded, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8, 2)
    with pytest.raises(ConfigError, match="<base64>:1:.*duplicate key"):
        load(base64.urlsafe_b64encode(b'{"a": 1, "a": 2}').decode())
    for not_a_config in ("abcd", base64.urlsafe_b64encode(b"[1]").decode(), "ds.json"):
        with pytest.raises(ConfigError, match="config file not found"):
            load(not_a_config)


def test_dict_source_is_not_modified():
    source = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"cpu_offload": True}}
    load(source, world_size=1, check_support=False)
    assert source == {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"cpu_offload": True}}
