"""Run by the DeepSpeed test environment's Python (see lightspeed/testing/deepspeed_env.py), not by pytest.

Usage: ``python deepspeed_autoep_worker.py SPEC.json``. In one world of the spec's `world_size` processes
(gloo, DeepSpeed's CPU accelerator; a world per autoep_size), for each case: build the case's tiny Hugging
Face model (`MODELS`: the Mixtral of tests/fixtures/deepspeed_autoep_checkpoint, or a Qwen2-MoE with a shared
expert and its gate; other weights than saved: the load must replace every one), ``deepspeed.initialize`` it with AutoEP at the case's autoep_size, ZeRO stage and gradient clipping
(torch's AdamW), ``load_checkpoint`` the case's directory and train its steps on the fixtures' global
batches (each rank its share). Rank r writes ``{"losses": [the global batch's mean loss per step],
"global_steps": N}`` (or ``{"error": traceback}``) to the spec's ``result`` path + ``.<case name>.<r>``.
Imports nothing of lightspeed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # worker_exit, beside this file
from worker_exit import free_port, leave  # noqa: E402

SEQ, MICRO, VOCAB, LR = 6, 2, 64, 0.01
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.2)
# a case's "model" -> (transformers class names, its config's own keys, DeepSpeed's preset)
MODELS = {"mixtral": ("MixtralForCausalLM", "MixtralConfig",
                      dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2), "mixtral"),
          "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                        dict(intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1), "qwen3_moe")}


def _transformers_shim() -> None:
    """DeepSpeed 0.19.8's AutoEP calls transformers' output-recorder registry as a plain dict
    (`registry.get(key, default)`); transformers 5.25's registry takes one argument. Accept the default."""
    from transformers.utils import output_capturing

    registry = type(output_capturing._CAN_RECORD_REGISTRY)
    one_arg = registry.get
    registry.get = lambda self, key, *default: dict.get(self, key, *default) if default else one_arg(self, key)


def _case(case: dict, rank: int, world: int) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers

    model_class, config_class, own, preset = MODELS[case.get("model", "mixtral")]
    torch.manual_seed(1)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON, **own)).float()
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": case["stage"]}, "gradient_clipping": case["clip"],
              "expert_parallel": {"enabled": True, "autoep_size": case["ep"], "preset_model": preset,
                                  "use_grouped_mm": False}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.load_checkpoint(case["checkpoint"])
    losses = []
    for step in case["steps"]:
        gen = torch.Generator().manual_seed(11 + step)
        ids = torch.randint(0, VOCAB, (world * MICRO, SEQ), generator=gen)[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses, "global_steps": engine.global_steps}


def _run(rank: int, spec: dict, ep: int, port: int) -> None:
    import deepspeed
    import torch

    world = spec["world_size"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _transformers_shim()
    deepspeed.init_distributed(dist_backend="gloo")
    for case in spec["cases"]:
        if case["ep"] != ep:
            continue
        try:
            out = _case(case, rank, world)
        except Exception:
            out = {"error": traceback.format_exc()}
        with open(f"{spec['result']}.{case['name']}.{rank}", "w") as f:  # every rank's: any rank's error is seen
            json.dump(out, f)
    leave()  # every result is on disk


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    # a world per autoep_size: DeepSpeed's expert groups are process-wide
    for ep in dict.fromkeys(case["ep"] for case in spec["cases"]):
        port = free_port()
        mp.spawn(_run, args=(spec, ep, port), nprocs=spec["world_size"])
