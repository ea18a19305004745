"""`hybrid_engine.inference_tp_size` > 1: generation split over groups of consecutive ranks.

Owns DeepSpeed's hybrid-engine tensor parallelism for `generate`: the inference groups (ranks
`[g*t, (g+1)*t)`, DeepSpeed's, made once at construction), the prompts of a group's ranks joined into one
batch, the whole model's linear layers swapped for this rank's slices for the length of the call (the
plan, slices and all-reduce hooks of `lightspeed.inference.tensor_parallel`, shared with
`init_inference`), and everything put back afterwards; each rank keeps its own rows of the result.
Must not: touch the training parameters (the slices are copies of the gathered, LoRA-fused weights), or
issue collectives except through comm/.

Note: [tp generation] The weights are gathered and LoRA fused as at inference_tp_size 1 (engine.py); then
each fused DeepSpeed-Chat LoRA layer is stood in for by a plain nn.Linear over the same (fused) tensors, so
the plan sees the model's own linear layers, and every planned layer is replaced by its slice. A group's
ranks run one generate over the joined batch (every rank the same tokens: the RNG is rank 0's on every
rank, and every row runs the same number of steps on all of them), so each decode step reads 1/t of the
layers' weights per rank. DeepSpeed gathers `tp_gather_partition_size` layers at a time and releases them
once split; here the whole model is gathered first (the stage-3 seam), so that key is refused at other
than its default.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from lightspeed.comm.api import new_group
from lightspeed.comm.collectives import Communicator
from lightspeed.hybrid.lora import is_dschat_lora, lora_modules
from lightspeed.inference.checkpoint import replace_submodule
from lightspeed.inference.tensor_parallel import (EXPERTS, attach_all_reduce, build_plan, per_rank_attributes,
                                                  shard_linear)

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")


def inference_groups(world_size: int, world_rank: int, tp_size: int) -> Communicator:
    """DeepSpeed's inference groups: consecutive ranks, `tp_size` each; this rank's. A collective (every
    rank makes every group, in the same order)."""
    if world_size % tp_size:
        raise ValueError(f"hybrid_engine.inference_tp_size: {tp_size} does not divide the world size {world_size}")
    mine = None
    for g in range(world_size // tp_size):
        ranks = list(range(g * tp_size, (g + 1) * tp_size))
        group = new_group(ranks)
        if world_rank in ranks:
            mine = group
    return Communicator(mine, tp_size)


def join_prompts(comm: Communicator, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, int]:
    """The group's prompts as one batch, rank order: `input_ids` (the first positional argument or the
    keyword) and `attention_mask` joined along dim 0. Returns (inputs, kwargs, this rank's batch size).
    Every rank of the group must pass the same shapes (DeepSpeed-Chat pads its prompts to one length)."""
    ids = inputs[0] if inputs else kwargs.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ValueError("hybrid_engine.inference_tp_size: generate needs the prompt as input_ids [batch, length]")
    others = [k for k, v in kwargs.items() if torch.is_tensor(v) and k not in ("input_ids", "attention_mask")]
    if others:
        raise ValueError(f"hybrid_engine.inference_tp_size: generate's tensor argument {others[0]!r} cannot be "
                         "joined over the inference group (input_ids and attention_mask can)")
    if kwargs.get("return_dict_in_generate"):
        raise ValueError("hybrid_engine.inference_tp_size: return_dict_in_generate is not supported (each rank's "
                         "rows are cut from the joined sequences)")
    shapes = comm.all_gather_object(tuple(ids.shape))
    if len(set(shapes)) != 1:
        raise ValueError(f"hybrid_engine.inference_tp_size: the ranks of an inference group must generate from "
                         f"prompts of one shape (got {shapes}); pad them to one length")

    def joined(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty((t.shape[0] * comm.world_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        comm.all_gather(out, t.contiguous())
        return out

    if inputs:
        inputs = (joined(ids), *inputs[1:])
    else:
        kwargs = {**kwargs, "input_ids": joined(ids)}
    if torch.is_tensor(kwargs.get("attention_mask")):
        kwargs = {**kwargs, "attention_mask": joined(kwargs["attention_mask"])}
    return inputs, kwargs, ids.shape[0]


def _linear_over(module: nn.Module) -> nn.Linear:
    """A plain nn.Linear over a fused LoRA layer's own (fused) weight and bias tensors."""
    out_features, in_features = module.weight.shape
    linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device="meta")
    linear.weight = module.weight
    linear.bias = module.bias
    return linear


class _Attributes:
    """What `per_rank_attributes` and `attach_all_reduce` change on the parents of split layers: their
    plain attributes and hook tables, as they were."""

    def __init__(self, modules: list[nn.Module]):
        self.saved = [(m, {k: v for k, v in vars(m).items() if not k.startswith("_")},
                       {h: dict(getattr(m, h)) for h in _HOOK_DICTS if hasattr(m, h)}) for m in modules]

    def restore(self) -> None:
        for module, plain, hooks in self.saved:
            state = vars(module)
            for key in [k for k in state if not k.startswith("_") and k not in plain]:
                del state[key]
            state.update(plain)
            for name, before in hooks.items():
                table = getattr(module, name)
                for key in [k for k in table if k not in before]:
                    del table[key]


@contextlib.contextmanager
def split_for_generation(model: nn.Module, comm: Communicator):
    """Inside, the model's planned linear layers are this rank's slices of the (gathered, LoRA-fused)
    weights, row-parallel outputs summed over `comm`; on exit (also by an exception) every layer,
    attribute and hook is as it was. Note: [tp generation]"""
    originals: dict[str, nn.Module] = {}
    restore: _Attributes | None = None
    try:
        for name, module in model.named_modules():
            if is_dschat_lora(module):
                if getattr(module, "fuse_lora", False) is not True:
                    raise NotImplementedError(f"hybrid_engine.inference_tp_size: {name} is a LoRA layer that cannot "
                                              "be fused (no fuse_lora_weight), so it cannot be split")
                originals[name] = module
        if len(originals) != len(lora_modules(model)):
            raise NotImplementedError("hybrid_engine.inference_tp_size with PEFT LoRA layers is not implemented")
        for name, module in originals.items():
            replace_submodule(model, name, _linear_over(module))
        plan = build_plan(model, comm.world_size)
        if EXPERTS in plan.values():
            raise NotImplementedError("hybrid_engine.inference_tp_size with MoE experts is not implemented")
        parents = {name.rpartition(".")[0] for name in plan}
        restore = _Attributes([model.get_submodule(p) for p in sorted(parents)])
        for name, style in plan.items():
            layer = model.get_submodule(name)
            originals.setdefault(name, layer)
            replace_submodule(model, name, shard_linear(layer, style, comm.rank, comm.world_size))
        per_rank_attributes(model, plan, comm.world_size, comm.rank)
        attach_all_reduce(model, plan, comm)
        yield plan
    finally:
        if restore is not None:
            restore.restore()
        for name, module in originals.items():
            replace_submodule(model, name, module)


def own_rows(output, comm: Communicator, batch: int):
    """This rank's rows of the joined batch's result."""
    return output[comm.rank * batch:(comm.rank + 1) * batch]


__all__ = ["inference_groups", "join_prompts", "own_rows", "split_for_generation"]
