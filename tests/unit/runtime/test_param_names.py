"""model_parameters followed through a transform that replaces the model's parameters (runtime/param_names.py),
without processes: a replaced layer stands in for tensor parallelism's split."""

import pytest
import torch

from lightspeed.config.errors import ConfigError
from lightspeed.runtime.param_names import params_by_name, params_from_names


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _replace_first(model):
    model[0] = torch.nn.Linear(4, 4)  # new parameter objects under the same names
    return model


def test_a_generator_and_groups_follow_the_replacement():
    model = _model()
    named = params_by_name(model, model.parameters())
    assert named == ["0.weight", "0.bias", "1.weight", "1.bias"]
    _replace_first(model)
    assert [id(p) for p in params_from_names(model, named)] == [id(p) for p in model.parameters()]

    model = _model()
    groups = params_by_name(model, ({"params": [model[0].weight, model[1].weight], "lr": 0.1},
                                    {"params": iter([model[0].bias]), "weight_decay": 0.0}))
    _replace_first(model)
    bound = params_from_names(model, groups)
    assert [set(g) - {"params"} for g in bound] == [{"lr"}, {"weight_decay"}] and bound[0]["lr"] == 0.1
    assert bound[0]["params"][0] is model[0].weight and bound[0]["params"][1] is model[1].weight
    assert bound[1]["params"] == [model[0].bias]


def test_a_parameter_not_the_models_and_a_name_gone_are_refused():
    model = _model()
    with pytest.raises(ConfigError, match=r"model_parameters\[1\] \(shape \(3,\)\) is not one of the model's"):
        params_by_name(model, [model[0].weight, torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ConfigError, match=r"model_parameters\[0\]\['params'\]\[0\]"):
        params_by_name(model, [{"params": [torch.nn.Parameter(torch.zeros(3))]}])
    with pytest.raises(TypeError, match="mixes param group dicts and parameters"):
        params_by_name(model, [{"params": [model[0].weight]}, model[1].weight])
    named = params_by_name(model, model.parameters())
    model[0] = torch.nn.Identity()
    with pytest.raises(ConfigError, match="the split model has no parameter '0.weight'"):
        params_from_names(model, named)
