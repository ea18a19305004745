"""ZeRO-3 units (no processes): which modules are units, which parameters each groups, hooks on units
only, and training through coarse units (tied across units, nested lists, leaves) equal to PyTorch."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lightspeed
from lightspeed.comm.collectives import Communicator
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.testing.models import TinyMLP
from lightspeed.testing.parity import train_alongside
from lightspeed.zero import register_external_parameter
from lightspeed.zero.stage3 import Stage3Options, Stage3Strategy, param_state
from lightspeed.zero.stage3.units import LeafRule, choose_units

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.timeout(60)
GPT2 = GPTConfig.preset("demo", n_layer=2, n_embd=16, n_head=2, block_size=8)


def _names(model, **rule):
    return [u.name for u in choose_units(model, LeafRule(**rule))]


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(6)
        self.ff = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 6))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Nested(torch.nn.Module):
    """Layers in a ModuleList, each with a Sequential inside; layer 2's last linear shares its weight
    with layer 0's (tied across units), and the root reads `layers.1.norm.weight` itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 6)
        self.shift = torch.nn.Parameter(torch.randn(50, 6) * 0.1)  # the root's own
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
        self.out = torch.nn.Linear(6, 4)
        self.layers[2].ff[2].weight = self.layers[0].ff[2].weight  # tied across two units

    def forward(self, x, y):
        h = self.inp(x) + self.shift.mean(0)
        for layer in self.layers:
            h = layer(h)
        h = h * self.layers[1].norm.weight  # a parameter of another unit, read by the root
        return F.mse_loss(self.out(h), y)


def test_gpt_units_are_the_blocks_and_the_root():
    model = GPT(GPT2)
    units = choose_units(model)
    assert [u.name for u in units] == ["<root>", "blocks.0", "blocks.1"]
    assert [n for n, _ in units[0].owned()] == ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]  # head tied
    assert len(units[1].owned()) == 12 and all(n.startswith("blocks.0.") for n, _ in units[1].owned())
    assert model.blocks[0].attn.c_attn in units[1].region and model.lm_head in units[0].region
    assert _names(TinyMLP()) == ["<root>"]  # no container: one unit


def test_nested_containers_give_nested_units():
    assert _names(Nested()) == ["<root>", "layers.0", "layers.0.ff.0", "layers.0.ff.2", "layers.1", "layers.1.ff.0",
                                "layers.1.ff.2", "layers.2", "layers.2.ff.0", "layers.2.ff.2"]


def test_pipeline_module_layers_are_units():
    """A PipelineModule registers its layers on itself (`holds_layers`): a schedule calls its stage
    chunks, never the module, so no layer may depend on the root's hooks; each is a unit, as a
    ModuleList's blocks are, and the granularity threshold never makes the whole module one leaf."""
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(0)
    net = PipelineModule([TiedLayerSpec("embed", torch.nn.Embedding, 8, 6), LayerSpec(Layer), torch.tanh,
                          LayerSpec(torch.nn.LayerNorm, 6),
                          TiedLayerSpec("embed", torch.nn.Embedding, 8, 6, forward_fn=lambda m, x: x @ m.weight.t())],
                         num_stages=1)
    expected = ["<root>", "tied_modules", "tied_modules.embed", "1", "1.ff.0", "1.ff.2", "3"]
    assert _names(net) == expected
    assert not choose_units(net)[0].owned()  # the root itself gathers nothing
    assert _names(net, granularity_threshold=10**6) == ["<root>", "tied_modules", "tied_modules.embed", "1", "3"]


def test_leaf_modules_and_granularity_threshold_only_coarsen():
    nested = Nested()
    by_class = ["<root>", "layers.0", "layers.1", "layers.2"]
    assert _names(nested, classes=("Layer",)) == by_class
    assert _names(nested, classes=(f"{Layer.__module__}.{Layer.__qualname__}",)) == by_class
    assert _names(nested, name_suffixes=(".ff",)) == ["<root>", "layers.0", "layers.0.ff", "layers.1", "layers.1.ff",
                                                      "layers.2", "layers.2.ff"]  # in place of the linears' units
    assert _names(nested, names=("layers.1",)) == ["<root>", "layers.0", "layers.0.ff.0", "layers.0.ff.2", "layers.1",
                                                   "layers.2", "layers.2.ff.0", "layers.2.ff.2"]
    assert _names(nested, names=("layers",)) == _names(nested)  # a ModuleList is never called: never a leaf
    assert _names(nested, names=("inp",)) == _names(nested)  # inside the root's region already
    # DeepSpeed's granularity: Layer = (12 + 84 + 78) // (3 + 1) = 43; ff (a container) never;
    # the root = (300 + 30 + 3 * 174 + 28) // (14 + 1) = 58 (the tied weight counts twice, as in DeepSpeed)
    assert _names(nested, granularity_threshold=42) == _names(nested)
    assert _names(nested, granularity_threshold=43) == _names(nested, granularity_threshold=57) == by_class
    assert _names(nested, granularity_threshold=58) == ["<root>"]
    gpt = GPT(GPT2)
    # GPT blocks (816 + 272 + 1088 + 1040 + 64 = 3280 over 9 = 364) are units already; attention (362) is inside one
    assert _names(gpt, granularity_threshold=364) == _names(gpt, granularity_threshold=362) == _names(gpt)


def test_hooks_only_on_units_and_external_uses_go_to_the_unit():
    model = Nested()
    s = Stage3Strategy(model, None, PrecisionPolicy(), Communicator(None, world_size=1),
                       Stage3Options(one_rank_views=False), device=torch.device("cpu"))
    hooked = [m for m in model.modules() if m._forward_pre_hooks]
    assert hooked == [u.module for u in s.units]
    group0 = param_state(model.layers[0].ff[2].weight).group
    assert group0.name == "layers.0.ff.2"
    assert group0 in s.coordinator.uses[id(model.layers[2].ff[2])]  # the tied weight, owned by layer 0's unit
    register_external_parameter(model.layers[1].norm, model.inp.weight)  # a module inside a unit: its unit gathers
    assert param_state(model.inp.weight).group in s.coordinator.uses[id(model.layers[1])]


def _train_equal(make, zero, steps=5):
    ref = make()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    cfg = {"train_batch_size": 4, "steps_per_print": 10**6, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, **zero}}
    engine, *_ = lightspeed.initialize(model=make(), config=cfg, dist_init_required=False)
    g = torch.Generator().manual_seed(1)
    train_alongside(engine, ref, opt, [(torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g))
                                       for _ in range(steps)])
    return engine


RELEASE_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
               "stage3_prefetch_bucket_size": 200}


@pytest.mark.parametrize("zero", [RELEASE_ALL, {}, {**RELEASE_ALL, "stage3_module_granularity_threshold": 43},
                                  {**RELEASE_ALL, "stage3_module_granularity_threshold": 58},
                                  {**RELEASE_ALL, "leaf_module": {"name_suffixes": [".ff"]}}])
def test_training_through_units_equals_plain_pytorch(zero):
    engine = _train_equal(Nested, zero)
    model = engine.module
    if zero:  # (with the defaults every group persists: nothing is released, so nothing needs finding)
        # the root's read of layers.1.norm.weight was found and registered with the root
        assert param_state(model.layers[1].norm.weight).group in engine.strategy.coordinator.uses[id(model)]
