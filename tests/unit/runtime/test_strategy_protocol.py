"""The sharding-strategy protocol (runtime/strategy.py) tells the truth: every ZeRO stage's strategy has
each member, `select_strategy` refuses an object that lacks one, and every member the package uses on a
strategy is declared on the protocol (nothing probes a strategy with getattr/hasattr)."""

import ast
import pathlib

import pytest
import torch

import lightspeed
from lightspeed.runtime import strategy as strategy_module
from lightspeed.runtime.strategy import ShardingStrategy, check_strategy
from lightspeed.zero.stage0 import Stage0Strategy

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _engine(stage: int, **zero):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    cfg = {"train_batch_size": 2, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": stage, **zero}}
    engine, *_ = lightspeed.initialize(model=model, config=cfg, dist_init_required=False)
    return engine


def _members() -> tuple[set[str], set[str]]:
    return set(ShardingStrategy.__annotations__), {
        n for n, v in vars(ShardingStrategy).items() if not n.startswith("_") and callable(v)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_implements_the_protocol(stage):
    strategy = _engine(stage).strategy
    assert strategy.stage == stage
    assert check_strategy(strategy) is strategy
    assert isinstance(strategy, ShardingStrategy)


@pytest.mark.parametrize("stage,zero,saved", [(0, {}, True), (2, {}, True), (3, {}, False),
                                               (3, {"stage3_gather_16bit_weights_on_model_save": True}, True)])
def test_save_16bit_model_follows_the_declared_capability(tmp_path, stage, zero, saved):
    engine = _engine(stage, **zero)
    assert engine.strategy.gather_16bit_weights_on_model_save is saved
    assert engine.save_16bit_model(tmp_path, "model.bin") is saved
    assert (tmp_path / "model.bin").exists() is saved


def _complete_class(**overrides):
    """A class with every protocol member (methods that do nothing), then `overrides` (None: removed)."""
    data, methods = _members()
    body = {n: (lambda self, *a, **k: None) for n in methods}
    body.update({"stage": 0, "state_is_replicated": True, "gather_16bit_weights_on_model_save": True,
                 "optimizer": None})
    assert set(body) == data | methods  # a new data member needs a value here
    for name, value in overrides.items():
        if value is None:
            del body[name]
        else:
            body[name] = value
    return type("Candidate", (), body)


def test_check_names_what_is_missing_or_wrong():
    complete = _complete_class()()
    assert check_strategy(complete) is complete
    with pytest.raises(TypeError, match=r"Candidate is not a ShardingStrategy .*: missing fragments, masters_loaded$"):
        check_strategy(_complete_class(fragments=None, masters_loaded=None)())
    with pytest.raises(TypeError, match="missing gather_16bit_weights_on_model_save"):
        check_strategy(_complete_class(gather_16bit_weights_on_model_save=None)())
    with pytest.raises(TypeError, match="module_shapes is not callable; state_is_replicated is not bool"):
        check_strategy(_complete_class(module_shapes=7, state_is_replicated="yes")())


def test_select_strategy_refuses_an_incomplete_strategy_at_construction(monkeypatch):
    class NoMasters(Stage0Strategy):
        masters_from_params = None

    monkeypatch.setattr(strategy_module, "Stage0Strategy", NoMasters)
    with pytest.raises(TypeError, match="NoMasters is not a ShardingStrategy .*masters_from_params is not callable"):
        _engine(0)


def _is_strategy(node: ast.AST) -> bool:
    """`strategy` or `<anything>.strategy` (the engine's, a test's `engine.strategy`)."""
    return (isinstance(node, ast.Name) and node.id == "strategy") or (
        isinstance(node, ast.Attribute) and node.attr == "strategy")


def _scan_source(source: str, where: str, uses: dict[str, set[str]], probes: list[str]) -> None:
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Attribute) and _is_strategy(node.value):
            uses.setdefault(node.attr, set()).add(where)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and node.args and _is_strategy(node.args[0])):
            probes.append(f"{where}:{node.lineno}")


def _scan(*roots: str) -> tuple[dict[str, set[str]], list[str]]:
    """Per attribute used on a strategy: the files using it; and every getattr/hasattr/setattr probe
    (check_strategy's own look-ups aside)."""
    uses: dict[str, set[str]] = {}
    probes: list[str] = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where != "lightspeed/runtime/strategy.py":
                _scan_source(path.read_text(), where, uses, probes)
    return uses, probes


def test_the_scan_sees_uses_and_probes():
    uses, probes = {}, []
    _scan_source("self.strategy.flush()\nif hasattr(engine.strategy, 'units'): strategy.groups\n", "x.py", uses, probes)
    assert uses == {"flush": {"x.py"}, "groups": {"x.py"}} and probes == ["x.py:2"]


def test_every_member_the_package_uses_on_a_strategy_is_declared():
    """The engine, initialize(), checkpoint/, compat/, zero/param_access.py, testing/: anything outside a
    strategy class. (Tests may reach a stage's own internals on a strategy of that stage.)"""
    uses, _ = _scan("lightspeed")
    data, methods = _members()
    assert {"step", "fragments", "fragment", "module_state_dict"} <= set(uses)  # it reads the engine's files
    undeclared = {name: sorted(files) for name, files in uses.items()
                  if name not in data | methods}
    assert not undeclared, f"used on a strategy but not declared on ShardingStrategy: {undeclared}"


def test_nothing_probes_a_strategy():
    _, probes = _scan("lightspeed", "tests", "benchmarks", "examples")
    assert not probes, f"getattr/hasattr on a strategy (declare the member instead): {probes}"
