"""lightspeed's Muon follows DeepSpeed 0.19.8's: the loss trajectory and final parameters of a small model
trained by DeepSpeed's MuonWithAuxAdam on CPU (tests/fixtures/deepspeed_muon: ZeRO 0-3, Gram and
standard Newton-Schulz, gradient clipping in DeepSpeed's two orders, fp32 and bf16), replayed through
lightspeed.initialize with the same config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import lightspeed

FIXTURE = Path(__file__).parents[2] / "fixtures" / "deepspeed_muon" / "expected.pt"
# (loss, final parameters) absolute tolerances: fp32 Gram iterations agree to rounding; the standard
# iteration runs in bf16, where the fused fast path rounds differently from DeepSpeed's separate ops; bf16
# parameters: a loss within one bf16 ulp (1/64 at 2-4), parameters within two (1/256 below 1) -- the
# other clipping order misses by 0.06
TOLERANCE = {"gram": (1e-6, 1e-5), "standard": (1e-3, 1e-2), "bf16": (1 / 64 + 1e-6, 2 / 256 + 1e-6)}


class Net(nn.Module):  # the fixture's model (make_fixture.py)
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 9)
        self.fc1 = nn.Linear(9, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 7)
        self.lm_head = nn.Linear(7, 11)

    def forward(self, tokens, labels):
        h = torch.tanh(self.fc1(self.embed(tokens)))
        logits = self.lm_head(torch.tanh(self.fc2(self.norm(h))))
        return nn.functional.cross_entropy(logits.view(-1, 11), labels.view(-1))


CASES = torch.load(FIXTURE, weights_only=False)["cases"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_follows_deepspeed(name):
    case = CASES[name]
    model = Net()
    model.load_state_dict(case["start"])
    engine, *_ = lightspeed.initialize(model=model, dist_init_required=False, config=case["config"])
    tokens, labels = case["tokens"], case["labels"]
    losses = []
    for i in range(len(case["losses"])):
        loss = engine(tokens[2 * i:2 * i + 2], labels[2 * i:2 * i + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    kind = "bf16" if name.startswith("bf16") else case["config"]["optimizer"]["params"]["ns_method"]
    loss_atol, param_atol = TOLERANCE[kind]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(case["losses"]), atol=loss_atol, rtol=0)
    final = engine.strategy.module_state_dict()
    moved = 0
    for k, want in case["final"].items():
        torch.testing.assert_close(final[k].float(), want, atol=param_atol, rtol=0, msg=lambda m: f"{k}: {m}")
        moved += not torch.allclose(want, case["start"][k])
    assert moved == len(case["final"])  # every parameter trained


def test_deepspeed_checkpoint_layout_is_refused():
    case = CASES["z0_gram_clip"]
    with pytest.raises(lightspeed.ConfigError, match="checkpoint.format"):
        lightspeed.initialize(model=Net(), dist_init_required=False,
                              config={**case["config"], "checkpoint": {"format": "deepspeed"}})
