"""The engine's checkpoints: `save_checkpoint` / `load_checkpoint` (DeepSpeed's API), the 16-bit model
saves, and the background writer's waits, as a mixin of `LightspeedEngine` (engine.py).

Owns: what a save collects from the engine (module state, counters, the strategy's fragments; over a
mesh, whole module tensors, the placements and the mesh coordinates; over pipeline stages, each stage's
module state; with experts, every expert under its ep = 1 name, parallel/experts/names.py) and how a
load is read on every rank (a pipeline stage takes its own layers' entries, an ep rank its experts),
agreed over the whole mesh, and only then applied. Must not: know a file layout (checkpoint/engine_checkpoint.py does) or a ZeRO stage (the
strategy's fragments and module state carry it).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.checkpoint import engine_checkpoint
from lightspeed.checkpoint.atomic import atomic_torch_save
from lightspeed.checkpoint.deepspeed_pipeline import PipelineLayout
from lightspeed.checkpoint.deepspeed_autoep_writer import AutoEPBlock, deepspeed_router_alias
from lightspeed.checkpoint.deepspeed_writer import module_entry_names, save_as_deepspeed
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.experts import ExpertSource
from lightspeed.checkpoint.integrity import verification
from lightspeed.checkpoint.module_state import check_module_state
from lightspeed.checkpoint.rng import get_rng_state, set_rng_state
from lightspeed.checkpoint.tensor_parallel import open_at_tp_size, tp_record
from lightspeed.checkpoint.universal import apply_training_state, read_training_state
from lightspeed.comm import heartbeat
from lightspeed.comm.collectives import Communicator
from lightspeed.parallel.pipeline.layout import module_layers, parts_at, tied_layers
from lightspeed.parallel.pipeline.module import PipelineModule
from lightspeed.parallel.experts.autoep_layer import EPExperts
from lightspeed.parallel.experts.transform import EXPERT_DATA_PARALLEL
from lightspeed.parallel.placement import keyed_placements
from lightspeed.parallel.tensor_parallel import gather_tp_state, tp_layouts
from lightspeed.zero.fragments import first_names, select_fragments

logger = get_logger(__name__)


class EngineCheckpoints:
    """Mixin of `LightspeedEngine`: its checkpoint methods (see the module docstring)."""

    def _get_optimizer_ckpt_name(self, checkpoints_path, tag, expp_rank: int) -> str:
        """Where DeepSpeed's layout keeps this model-parallel rank's optimizer states of expert-parallel rank
        `expp_rank` (`expp_rank_<E>_mp_rank_<MM>_optim_states.pt`; DeepSpeed's name, for code that
        locates those files; lightspeed's own layout is checkpoint/layout.py's)."""
        mp_rank = self._tp_comm.rank if self._tp_comm is not None else 0
        return os.path.join(checkpoints_path, str(tag), f"expp_rank_{expp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")

    @heartbeat.paused()  # file I/O: the stall clock waits (comm/heartbeat.py)
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Write `save_dir/<tag>/` atomically (tag defaults to `global_step<N>`), then `latest`; with
        `checkpoint.writer.decoupled` from a host snapshot in the background (see `wait_checkpoint`)."""
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        autoep = None
        if self._expert_names and self.config.checkpoint.format == "deepspeed":
            if self._expert_names.fused:  # DeepSpeed's AutoEP layout (checkpoint/deepspeed_autoep_writer.py)
                autoep = self._autoep_blocks()
            if any({"ep", "tp"} <= set(p.sharded_over) for p in self.placements.values()):
                raise NotImplementedError("checkpoint.format='deepspeed' with MoE experts sliced over tensor "
                                          "parallelism (enable_expert_tensor_parallelism / expert_parallel."
                                          "expert_tensor_parallel_size) is not written by lightspeed; save in "
                                          "lightspeed's format")
            if self.zero_optimization_stage() == 3 or self._pp_comm is not None:
                raise NotImplementedError("checkpoint.format='deepspeed' with MoE experts at zero_optimization.stage "
                                          "3 or over pipeline stages: DeepSpeed 0.19.8 has no such MoE layout (it "
                                          "refuses MoE layers at stage 3); save in lightspeed's format, or use "
                                          "ZeRO 0-2")
        if self.config.checkpoint.format == "deepspeed" and self._pp_comm is not None \
                and self.zero_optimization_stage() == 3:
            raise NotImplementedError("checkpoint.format='deepspeed' over pipeline stages at zero_optimization.stage "
                                      "3: DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3, so it has no such "
                                      "layout; save in lightspeed's format")
        tag = engine_checkpoint.check_save_agreement(save_dir, tag, Communicator(None, self.world_size),
                                                     self.config.checkpoint.tag_validation)
        module_state = self.strategy.module_state_dict()
        frozen: set[str] = set()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            module_state = {k: v for k, v in module_state.items() if k not in frozen}
        shared = {
            "excluded_frozen_parameters": sorted(frozen),
            "module": module_state,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "counters": {"global_steps": self.global_steps, "global_samples": self.global_samples,
                         "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps},
            "client_state": dict(client_state or {}),
            "zero_stage": self.zero_optimization_stage(),
            "dp_world_size": self.seq_dp_world_size,  # the ranks that wrote shards (dp x sp)
        }
        shared["buffer_names"], shared["frozen_param_names"] = module_entry_names(self.module)
        if self._expert_names:  # their names in the ep = 1 model (parallel/experts/names.py); this rank's experts
            for key in ("excluded_frozen_parameters", "buffer_names", "frozen_param_names"):
                shared[key] = sorted({self._expert_names.to_global(n, r) for n in shared[key]
                                      for r in range(self._ep_size())})
        strategy_state = self.strategy.state_dict()
        replicated = self.strategy.state_is_replicated
        module_part, pp_rank = None, 0
        if self._mesh_save:  # one tag for the whole mesh (engine_checkpoint.py's layout)
            tp_rank = self._tp_comm.rank if self._tp_comm is not None else 0
            pp_rank = self._pp_comm.rank if self._pp_comm is not None else 0
            # collective over tp (every rank calls it); only the rank that writes the module keeps them
            writes_module = tp_rank == 0 and self.groups.seq_dp_rank == 0
            module_state = self._whole_tensors(module_state, keep=writes_module)
            module_state = self._whole_experts(module_state, keep=writes_module)
            shared["module"] = module_state
            shared["mesh"] = {"tp": self._tp_comm.world_size if self._tp_comm is not None else 1,
                              "dp_sp": self.seq_dp_world_size}
            coords = {"tp": tp_rank}
            if self._expert_names or keyed_placements(self.placements):  # the layout's Note on experts
                shared["mesh"]["ep"] = self._ep_comm.world_size if self._ep_comm is not None else 1
                coords.update(self._data_coords())
            if self._pp_comm is not None:  # each stage writes its own module state (the layout's pipeline Note)
                shared["mesh"]["pp"] = self._pp_comm.world_size
                shared["module"] = {}
                shared["module_parts"] = [[engine_checkpoint.module_file(s), self._stage_writer_rank(s)]
                                          for s in range(self._pp_comm.world_size)]
                module_part = module_state if writes_module else None
                coords["pp"] = pp_rank
            if replicated and "ep" in coords:  # each parameter's state as coordinate 0 of the dims it is reduced over
                strategy_state = select_fragments(strategy_state, lambda n: self.placements[n].counts_on(
                    coords, [d for d in coords if d in self.placements[n].reduced_over]))
            elif replicated and self.groups.seq_dp_rank != 0:  # the same state as dp rank 0 of its tp column
                strategy_state = {**strategy_state, "fragments": [], "owners": [], "owner_groups": [], "state": []}
            strategy_state, placed = self._global_fragments(strategy_state)
            strategy_state = {**strategy_state, "mesh_coords": coords, "partitioned": not replicated,
                              "mesh_rank": self._ckpt_rank, "mesh_size": self._ckpt_comm.world_size,
                              "placements": placed}
            replicated = False
        engine_checkpoint.save(save_dir, tag, shared=shared, strategy_state=strategy_state,
                               strategy_replicated=replicated, comm=self._ckpt_comm,
                               dp_rank=self._ckpt_rank, save_latest=save_latest,
                               writer=self._checkpoint_writer, module_part=module_part, pp_rank=pp_rank)
        if self.config.checkpoint.format == "deepspeed":  # lightspeed's tag, converted in place by rank 0
            self._checkpoint_writer.wait(self._ckpt_comm)
            save_as_deepspeed(save_dir, tag, comm=self._ckpt_comm, rank=self._ckpt_rank,
                              stage=self.zero_optimization_stage(), world_size=self.seq_dp_world_size,
                              sub_group_size=self.config.zero_optimization.sub_group_size, ep_size=self._ep_size(),
                              autoep=autoep,
                              pipeline=None if self._pp_comm is None else (self._pipeline_layout(),
                                                                           self._pp_comm.world_size))
        return True

    def _autoep_blocks(self) -> list[AutoEPBlock]:
        """The model's AutoEP blocks as DeepSpeed's AutoEP layout names them (checkpoint.format "deepspeed")."""
        blocks = []
        for name, module in self.module.named_modules():
            if not isinstance(module, EPExperts):
                continue
            if module.transposed or any(module.bias_names):
                raise NotImplementedError(f"checkpoint.format='deepspeed' with the AutoEP experts of {name} (biases or "
                                          "transposed weights, as GPT-OSS's): DeepSpeed 0.19.8's AutoEP has no such "
                                          "layout; save in lightspeed's format")
            path, _, child = name.rpartition(".")
            block = self.module.get_submodule(path)
            preset, router, shared, shared_gate = module.block_children
            blocks.append(AutoEPBlock(path, module.num_experts, router,
                                      deepspeed_router_alias(preset, block, getattr(block, router), router), shared,
                                      shared_gate, child, *module.weight_names, preset))
        return blocks

    def _ep_size(self) -> int:
        return self._ep_comm.world_size if self._ep_comm is not None else 1

    def _data_coords(self) -> dict[str, int]:
        """This rank's coordinates on the expert-parallel and data-parallel mesh dims."""
        coords = self.groups.topology.coords()
        return {d: int(coords.get(d, 0)) for d in ("ep", *EXPERT_DATA_PARALLEL)}

    def _global_fragments(self, state: dict) -> tuple[dict, dict[str, dict]]:
        """A fragments state with each DeepSpeed-style expert's fragments under its global name, and the
        placement records of its fragments' parameters (such an expert: its whole tensor, sharded over ep;
        the layout's Note on experts)."""
        names = self._expert_names
        placed: dict[str, dict] = {}
        entries = []
        for entry in state.get("fragments", ()):
            name = entry[0]
            placement = self.placements[name]
            renamed = names.to_global(name)
            if names.is_expert(name) and not names.is_fused(name):  # its box in its own expert's whole tensor
                placement = names.one_expert(renamed, placement)
            placed[renamed] = placement.as_record()
            entries.append([renamed, *entry[1:]])
        return {**state, "fragments": entries}, placed

    def _whole_experts(self, state: dict, keep: bool) -> dict:
        """`state` with the expert entries of every ep rank under their global names (AutoEP's fused
        tensors whole), gathered over the ep group by the ranks at data-parallel coordinate 0 of the
        experts (each ep group of them: a collective); with `keep` False this rank only contributes."""
        names = self._expert_names
        if not names:
            return state
        if self._ep_comm is None:  # ep = 1: this rank holds every expert, under its global name
            return {names.to_global(k): v for k, v in state.items()}
        if any(self._data_coords()[d] for d in EXPERT_DATA_PARALLEL):
            return state  # another expert-data-parallel rank's ep group gathers them
        out = {k: v for k, v in state.items() if not names.is_expert(k)} if keep else state
        ep = self._ep_comm.world_size
        experts = [k for k, v in state.items() if names.is_expert(k) and torch.is_tensor(v)]
        gathered_parts: dict[str, list[torch.Tensor]] = {}
        for key in sorted(experts):
            local = state[key].detach().to(self.device).contiguous()
            gathered = torch.empty((ep, *local.shape), dtype=local.dtype, device=local.device)
            self._ep_comm.all_gather(gathered.view(-1), local.view(-1))
            if not keep:
                continue
            parts = [t.to(state[key].device) for t in gathered.unbind(0)]
            if names.is_fused(key):  # ep rank r holds rows [r x E/ep, (r + 1) x E/ep): autoep.py's placements
                out[key] = torch.cat(parts)
            else:
                gathered_parts[key] = parts
        # in the ep = 1 model's order (DeepSpeed's MoE layout needs it: checkpoint/deepspeed_moe_writer.py):
        # per layer, ep rank r's experts in this rank's order of its own
        prefix_of = {k: names.to_global(k, 0).rsplit("deepspeed_experts.", 1)[0] for k in gathered_parts}
        for prefix in dict.fromkeys(prefix_of.values()):
            keys = [k for k in experts if prefix_of.get(k) == prefix]
            out.update((names.to_global(k, r), gathered_parts[k][r]) for r in range(ep) for k in keys)
        return out

    def _stage_writer_rank(self, stage: int) -> int:
        """The mesh rank that writes pipeline stage `stage`'s module state: its rank at data-parallel and
        tp coordinate 0."""
        return self.groups.topology.shape.rank_of({"pp": stage})

    def _tp_record(self) -> dict:
        """This run's tp layouts; those of experts sliced over tp under every ep rank's global names (a
        checkpoint names experts so: parallel/experts/names.py)."""
        record = tp_record(self.module, self._tp_comm.world_size, self._tp_comm.rank)
        names = self._expert_names
        if names:
            record["layouts"] = dict(sorted({names.to_global(k, r) if names.is_expert(k) else k: v
                                             for k, v in record["layouts"].items()
                                             for r in range(self._ep_size())}.items()))
        return record

    def _whole_tensors(self, state: dict, keep: bool = True) -> dict:
        """`state` with tensor-parallel slices gathered into whole tensors (collective over the tp group);
        with `keep` False this rank contributes its slices and gets `state` back."""
        if self._tp_comm is None:
            return state
        layouts = tp_layouts(self.module)
        names = self._expert_names
        experts = {k: v for k, v in layouts.items() if names and names.is_expert(k)}
        if experts:  # experts sliced over tp: every rank of an ep group that gathers them needs them whole
            state = gather_tp_state(state, experts, self._tp_comm)
            layouts = {k: v for k, v in layouts.items() if k not in experts}
        state = self._whole_fused_over_tp(state)
        return gather_tp_state(state, layouts, self._tp_comm, keep=keep)

    def _whole_fused_over_tp(self, state: dict) -> dict:
        """`state` with AutoEP's experts sliced over tp joined into this ep rank's experts whole over tp
        (autoep_layer.py's Note on experts sliced over tp; collective over the tp group, every rank keeps
        them: the ep gather that follows needs them whole)."""
        out = dict(state)
        tp = self._tp_comm.world_size
        for name, module in self.module.named_modules():
            if not isinstance(module, EPExperts) or module.tp_comm is None:
                continue
            for pname in module.param_names:
                key = f"{name}.{pname}"
                if module.tp_placement(pname, 0) is None or not torch.is_tensor(state.get(key)):
                    continue
                local = state[key].detach().to(self.device).contiguous()
                gathered = torch.empty((tp, *local.shape), dtype=local.dtype, device=local.device)
                self._tp_comm.all_gather(gathered.view(-1), local.view(-1))
                whole = torch.empty(module.tp_placement(pname, 0).global_shape, dtype=local.dtype)
                for rank, piece in enumerate(gathered.unbind(0)):
                    module.tp_placement(pname, rank).place_into(whole, piece.cpu())
                out[key] = whole.to(state[key].device)
        return out

    @heartbeat.paused()  # rank 0 copies the whole model to the host while the others go on
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The whole module state_dict gathered from the ZeRO-3 shards, parameters in the training dtype
        on CPU, on global rank 0; None on the other ranks. A collective: every rank must call it.
        ValueError when the parameters are not partitioned (DeepSpeed's rule: only for ZeRO-3)."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("_zero3_consolidated_16bit_state_dict requires ZeRO stage 3 "
                             f"(got stage {self.zero_optimization_stage()})")
        state = self._whole_experts(self.strategy.module_state_dict(), keep=self.global_rank == 0)
        if self.global_rank != 0:
            return None
        if exclude_frozen_parameters:
            frozen = {self._expert_names.to_global(n, r) for n, p in self.module.named_parameters()
                      if not p.requires_grad for r in range(self._ep_size())}
            state = {k: v for k, v in state.items() if k not in frozen}
        return {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}

    def _reserve_snapshot_pool(self) -> None:
        """Size a background save's host pool from the state a save snapshots (collective at ZeRO-3 and
        with tensor parallelism, like a save). client_state tensors are not known here: a save with
        some adds them to the pool."""
        module_state = self._whole_tensors(self.strategy.module_state_dict())
        self._checkpoint_writer.reserve({"module": module_state, "strategy": self.strategy.state_dict(),
                                         "rng": get_rng_state()})

    def wait_checkpoint(self) -> None:
        """Wait for a background (`checkpoint.writer.decoupled`) save to be complete on every rank;
        raises its error, if any rank's failed. Collective; returns at once when no save is pending."""
        self._checkpoint_writer.wait(self._ckpt_comm)

    @heartbeat.paused()  # rank 0 writes the file while the others wait at the barrier
    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the whole module state_dict (parameters in the training dtype) to
        `save_dir/save_filename`; global rank 0 writes. A partitioned strategy gathers the parameters
        only with `zero_optimization.stage3_gather_16bit_weights_on_model_save` (DeepSpeed's rule):
        otherwise nothing is written and False is returned. Every rank must call it."""
        path = os.path.join(save_dir, save_filename)
        if self._pp_comm is not None:
            raise NotImplementedError(f"save_16bit_model over {self._pp_comm.world_size} pipeline stages is not "
                                      "implemented (each stage holds only its layers); save_checkpoint saves every "
                                      "stage, and `lightspeed checkpoint` consolidates it")
        # strategies that hold whole parameters (stages 0-2) can always save; stage 3 says whether it may gather
        if not self.strategy.gather_16bit_weights_on_model_save:
            logger.warning("did not save the model %s: zero_optimization.stage3_gather_16bit_weights_on_model_save "
                           "is false", path)
            return False
        state = self._whole_tensors(self.strategy.module_state_dict(), keep=self.global_rank == 0)
        state = self._whole_experts(state, keep=self.global_rank == 0)  # every expert, under the ep = 1 names
        if exclude_frozen_parameters:
            frozen = {self._expert_names.to_global(n, r) for n, p in self.module.named_parameters()
                      if not p.requires_grad for r in range(self._ep_size())}
            state = {k: v for k, v in state.items() if k not in frozen}
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            atomic_torch_save(state, path)
        self.comm.barrier()
        return True

    @heartbeat.paused()
    def load_checkpoint(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None, *, verify: bool = True):
        """Restore a checkpoint written by `save_checkpoint` at any data-parallel world size, ZeRO stage,
        tensor-parallel size and number of pipeline stages (or DeepSpeed's, pipeline layout included);
        returns `(path, client_state)`, or `(None, None)` when `load_dir` holds no `latest` file and no
        tag is given. Everything is read and checked on every rank before anything changes: a
        load that fails raises on every rank and leaves the engine as it was. Every file read is verified
        (lightspeed's against its checksum manifest, DeepSpeed's against its CRC-32s); `verify=False`
        reads them unchecked (e.g. a tag whose manifests were lost), with a warning. DeepSpeed's
        `custom_load_fn` (a user function loading the module's weights) is refused."""
        if custom_load_fn is not None:
            raise NotImplementedError("engine.load_checkpoint: custom_load_fn (a user function that loads the module's "
                                      "weights in place of load_state_dict) is not implemented in lightspeed yet")
        self.wait_checkpoint()
        with verification(verify):
            return self._load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                         load_lr_scheduler_states, load_module_only)

    def _load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                         load_module_only):
        try:
            trainable = [n for n, p in self.module.named_parameters() if p.requires_grad]
            if self._expert_names:  # the whole model's names, as a checkpoint of experts holds them
                trainable = list(dict.fromkeys(self._expert_names.to_global(n, r) for r in range(self._ep_size())
                                               for n in trainable))
            self._first_name = {n: first_names(self.module)[id(p)]
                                for n, p in self.module.named_parameters(remove_duplicate=False)}
            # at another tp size (or plan) the source merges the saved slices and cuts this tp rank's
            # (checkpoint/tensor_parallel.py); the fragments path below then re-slices over dp and stage
            opened = open_at_tp_size(load_dir, tag, dp_rank=self.groups.seq_dp_rank, param_names=trainable,
                                     current=None if self._tp_comm is None else self._tp_record(),
                                     mesh_rank=self._ckpt_rank, pipeline=self._pipeline_layout())
            read = None
            if opened is not None:
                path, source, rng = opened
                if self._expert_names:  # this ep rank's experts of the whole model's (checkpoint/experts.py)
                    source = ExpertSource(source, self._expert_names, {
                        n: p for n, p in self.placements.items() if self._expert_names.is_fused(n)})
                source_params = set(source.param_names())
                extra = source.extra()
                module_state = self._module_state_to_load(source, load_module_only)
                excluded = set(extra.get("excluded_frozen_parameters") or ())
                excluded |= {k for k in self.strategy.module_shapes() if k not in module_state
                             and self._first_name.get(k) in source_params}
                expected = {k: v for k, v in self.strategy.module_shapes().items() if k not in excluded}
                check_module_state(expected, module_state, strict=load_module_strict)
                counters = self._saved_counters(extra.get("counters") or {})
                if not load_module_only:
                    read = read_training_state(source, self.strategy.fragments(), self.optimizer,
                                               load_optimizer_states=load_optimizer_states)
            failed = None
        except (CheckpointError, KeyError, ValueError, RuntimeError) as err:
            failed = err
        self._agree_or_raise(failed)
        if opened is None:
            logger.warning("no checkpoint to load in %s (no 'latest' file and no tag given)", load_dir)
            return None, None
        client_state = extra.get("client_state") or {}
        self.strategy.load_module_state_dict(module_state, strict=False)  # checked above, before any change
        if load_module_only:
            self.strategy.masters_from_params()
            if rng is not None:
                set_rng_state(rng)
            return path, client_state
        apply_training_state(read, self.optimizer)
        self.strategy.masters_loaded()
        if load_lr_scheduler_states and self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if self.loss_scaler is not None and extra.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(extra["loss_scaler"])
        self.global_steps, self.global_samples, self.micro_steps, self.skipped_steps = counters
        saved_world = int(extra.get("dp_world_size") or 0)
        if rng is not None:
            set_rng_state(rng)
        elif self.groups.seq_dp_rank >= saved_world:
            logger.info("checkpoint %s was saved by %d ranks: ranks from %d on keep their own RNG state", path,
                        saved_world, saved_world)
        return path, client_state

    def _pipeline_layout(self) -> PipelineLayout | None:
        """What a DeepSpeed pipeline checkpoint's reader needs of this PipelineModule (None for another
        module)."""
        if not isinstance(self.module, PipelineModule):
            return None
        module = self.module
        return PipelineLayout(tied_layers=tied_layers(module), parts_at=lambda n: parts_at(module, n),
                              module_layers=module_layers(module))

    def _module_state_to_load(self, source, load_module_only: bool) -> dict[str, Any]:
        """The saved module state, less the parameters the source holds fp32 masters of whose saved entry
        is an empty placeholder (a ZeRO-3 writer keeps them partitioned): those come from the masters, or,
        for a module-only load, from the source's fp32 values one tensor at a time."""
        saved = source.module_state()
        masters = set(source.param_names())
        out: dict[str, Any] = {}
        held_layers = set(self.module._modules) if isinstance(self.module, PipelineModule) else None
        for name in list(saved.keys()):
            layer = name.split(".", 1)[0]
            if held_layers is not None and layer.isdigit() and layer not in held_layers:
                continue  # another pipeline stage's layer (PipelineModule names layers by global index)
            value = saved[name]
            first = self._first_name.get(name)
            if first in masters and torch.is_tensor(value) and value.numel() == 0:
                if load_module_only and name == first:
                    out[name] = source.read(name)
                continue
            out[name] = value
        return out

    def _saved_counters(self, saved: dict) -> tuple[int, int, int, int]:
        """(global_steps, global_samples, micro_steps, skipped_steps) from a checkpoint's counters; what a
        writer did not record follows from the steps taken. The micro-step count restarts at the
        accumulation window after the last step, at this engine's accumulation steps (the gradients of a
        window in progress are not saved, and the count saved at another `gradient_accumulation_steps`
        would misplace the boundary); DeepSpeed keeps no micro-step count either."""
        def get(key, default):
            value = saved.get(key)
            return int(default if value is None else value)

        steps = get("global_steps", 0)
        return (steps, get("global_samples", steps * self.train_batch_size()),
                steps * self.gradient_accumulation_steps(), get("skipped_steps", 0))

    def _agree_or_raise(self, failed: BaseException | None) -> None:
        """Every rank learns whether any rank failed to read the checkpoint, and then all raise."""
        flag = torch.tensor([0.0 if failed is None else float(self._ckpt_rank + 1)], device=self.device)
        self._ckpt_comm.all_reduce(flag, op="max")  # every rank of the mesh: a load changes all or none
        if failed is not None:
            raise failed if isinstance(failed, CheckpointError) else CheckpointError(str(failed)) from failed
        if flag.item() > 0:
            what = "rank" if self._mesh_save else "data-parallel rank"
            raise CheckpointError(f"load_checkpoint: {what} {int(flag.item()) - 1} could not read the "
                                  "checkpoint (its error is raised there); nothing was loaded")
