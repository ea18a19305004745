"""`compute_elastic_config` against DeepSpeed's answers, and the elastic batch the config loader applies.

The expected values are what DeepSpeed 0.19.8's `deepspeed/elasticity/elasticity.py` returns for the same
inputs (its formulas run on these 20 sections, including its unit tests' cases: `test_basic_10k`,
`test_valid_world_size`, `test_proper_mbsz`, `test_batch_size_within_max`).
"""

import pytest

from lightspeed.config import load
from lightspeed.config.elasticity import (ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
                                          compute_elastic_config)

BIG = [32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288, 306, 408, 576, 612, 816, 1224]
V2 = [4, 8, 12, 16, 20, 24, 32, 40, 48, 60, 64]
CASES = [
    (dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=0.1), 0,
     [9792, BIG]),
    (dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=0.1), 64,
     [9792, BIG, 17]),
    (dict(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], min_gpus=1, max_gpus=1500, version=0.1), 4,
     [24, [1, 2, 3, 4, 6, 8, 12, 24], 3]),
    (dict(max_train_batch_size=100, micro_batch_sizes=[8, 10, 12], min_gpus=1, max_gpus=1500, version=0.1), 0,
     [96, [1, 2, 3, 4, 6, 8, 12]]),
    (dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=10000, version=0.1), 0,
     [1680, [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105, 120, 140, 168,
             210, 280, 420, 840]]),
    (dict(max_train_batch_size=4, micro_batch_sizes=[1, 2, 3, 4], min_gpus=1, max_gpus=4, version=0.1), 2,
     [4, [1, 2, 4], 2]),
    (dict(max_train_batch_size=16, micro_batch_sizes=[8, 12], min_gpus=1, max_gpus=1500, version=0.1), 0, [16, [1, 2]]),
    (dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=0.1,
          prefer_larger_batch=False), 0, [9792, BIG]),
    (dict(max_train_batch_size=1000, micro_batch_sizes=[3, 5, 7], min_gpus=1, max_gpus=64, version=0.1), 0,
     [840, [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60]]),
    (dict(max_train_batch_size=1500000, micro_batch_sizes=[1], min_gpus=1, max_gpus=8, version=0.1), 0,
     [720720, [1, 2, 3, 4, 5, 6, 7, 8]]),
    (dict(max_train_batch_size=512, micro_batch_sizes=[4], min_gpus=2, max_gpus=16, version=0.1), 8,
     [480, [2, 3, 4, 5, 6, 8, 10, 12, 15], 4]),
    (dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=0.2,
          model_parallel_size=4, num_gpus_per_node=8), 16, ElasticityIncompatibleWorldSize),
    (dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=0.2,
          model_parallel_size=4, num_gpus_per_node=8), 64, ElasticityIncompatibleWorldSize),
    (dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=64, version=0.2,
          num_gpus_per_node=4), 8, [1920, V2, 6]),
    (dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=64, version=0.2,
          num_gpus_per_node=4), 12, [1920, V2, 4]),
    (dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=64, version=0.2,
          num_gpus_per_node=4, prefer_larger_batch=False), 12, [1920, V2, 4]),
    (dict(max_train_batch_size=256, micro_batch_sizes=[2, 3], min_gpus=1, max_gpus=16, version=0.2,
          num_gpus_per_node=2, model_parallel_size=2), 6, [240, [1, 2, 3, 4, 5, 6, 8], 2]),
    (dict(max_train_batch_size=96, micro_batch_sizes=[1, 2, 4], min_gpus=1, max_gpus=8, version=0.2,
          num_gpus_per_node=1), 5, [95, [5], 1]),
    (dict(max_train_batch_size=8, micro_batch_sizes=[1, 2], min_gpus=1, max_gpus=2, version=0.2), 2, [8, [1, 2], 2]),
    (dict(max_train_batch_size=720, micro_batch_sizes=[5, 6, 9], min_gpus=3, max_gpus=40, version=0.1), 0,
     [720, [3, 4, 5, 6, 8, 9, 10, 12, 15, 16, 18, 20, 24, 30, 36, 40]]),
]


def _cfg(**section):
    return {"elasticity": {"enabled": True, "min_time": 20, **section}}


@pytest.mark.parametrize("section, world, expected", CASES)
def test_same_answers_as_deepspeed(section, world, expected):
    kwargs = {"world_size": world} if world else {}
    if isinstance(expected, type):
        with pytest.raises(expected):
            compute_elastic_config(_cfg(**section), "0.19.8", **kwargs)
        return
    assert list(compute_elastic_config(_cfg(**section), "0.19.8", **kwargs)) == expected


def test_version_02_reads_world_size_from_the_environment(monkeypatch):
    section = dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500,
                   version=0.2, model_parallel_size=4, num_gpus_per_node=8)
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert compute_elastic_config(_cfg(**section), "0.19.8", return_microbatch=True) == (9996, [4], 16)
    monkeypatch.setenv("WORLD_SIZE", "256")  # DeepSpeed's fallback finds no micro batch: None, as there
    assert compute_elastic_config(_cfg(**section), "0.19.8", return_microbatch=True) == (9984, [64], None)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(_cfg(**section), "0.19.8")


BASE = dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=0.1)


@pytest.mark.parametrize("change, target", [
    ({"enabled": False}, "0.19.8"), ({}, "0.2"), ({"version": "0.3"}, "0.19.8"),
    ({"max_train_batch_size": None}, "0.19.8"), ({"micro_batch_sizes": None}, "0.19.8"),
    ({"model_parallel_size": 4, "num_gpus_per_node": 8}, "0.19.8"),
    ({"micro_batch_sizes": [1, 4, -1, 2, -10]}, "0.19.8"), ({"min_gpus": -1}, "0.19.8"), ({"max_gpus": -1}, "0.19.8"),
    ({"micro_batch_sizes": 5}, "0.19.8"), ({"micro_batch_sizes": ["a", None, 0.5]}, "0.19.8"),
    ({"micro_batch_sizes": [2, 0.5, 4]}, "0.19.8"),
])
def test_refusals_are_deepspeeds(change, target):
    section = {**BASE, **change}
    section = {k: v for k, v in section.items() if v is not None}
    with pytest.raises(ElasticityError):
        compute_elastic_config(_cfg(**section), target)


def test_v2_model_parallel_must_divide_gpus_per_node():
    section = {**BASE, "version": 0.2, "model_parallel_size": 16, "num_gpus_per_node": 8}
    with pytest.raises(ElasticityError, match="divisible"):
        compute_elastic_config(_cfg(**section), "0.19.8", world_size=16)


ELASTIC = {"enabled": True, "max_train_batch_size": 4, "micro_batch_sizes": [1, 2, 3, 4], "min_gpus": 1, "max_gpus": 4,
           "version": 0.1}


def test_config_applies_the_elastic_batch(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    cfg = load({"elasticity": ELASTIC}, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 2, 1)
    cfg = load({"elasticity": ELASTIC}, world_size=1)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 4, 1)
    with pytest.raises(ElasticityError, match="ignore_non_elastic_batch_info"):  # DeepSpeed's TestNonElasticBatchParams
        load({"train_batch_size": 2, "elasticity": ELASTIC}, world_size=2)
    cfg = load({"train_batch_size": 2, "elasticity": {**ELASTIC, "ignore_non_elastic_batch_info": True}}, world_size=2)
    assert cfg.train_batch_size == 4
    with pytest.raises(ElasticityIncompatibleWorldSize):
        load({"elasticity": ELASTIC}, world_size=3)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", '{"elasticity": {"enabled": true, "max_train_batch_size": 27, '
                       '"micro_batch_sizes": [1, 2, 3, 4], "version": 0.1}}')
    with pytest.raises(ElasticityError, match="scheduler"):  # DeepSpeed's TestElasticConfigChanged
        load({"elasticity": {**ELASTIC, "ignore_non_elastic_batch_info": True}}, world_size=2)


def test_compat_module_is_the_same_function():
    from lightspeed.compat.deepspeed import elasticity

    assert elasticity.compute_elastic_config is compute_elastic_config
    assert issubclass(elasticity.config.ElasticityIncompatibleWorldSize, elasticity.ElasticityError)


def test_deepspeed_config_reports_the_elastic_batch(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    from lightspeed.compat.deepspeed.runtime.config import DeepSpeedConfig

    class Mpu:
        def get_data_parallel_world_size(self):
            return 2

    cfg = DeepSpeedConfig({"elasticity": ELASTIC}, mpu=Mpu())
    assert cfg.elasticity_enabled and (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                       cfg.gradient_accumulation_steps) == (4, 2, 1)
