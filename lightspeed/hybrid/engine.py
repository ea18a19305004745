"""`HybridEngine`: DeepSpeed's `DeepSpeedHybridEngine`, one engine that trains (any ZeRO stage) and
generates (RLHF actors: DeepSpeed-Chat's step 3, TRL).

Owns `generate` (the stage-3 weights gathered once per call, LoRA fused for its length, with
`inference_tp_size` > 1 the layers split over an inference group (tensor_parallel.py), the model's own
`generate` run, then LoRA taken out exactly and the weights resharded), `eval()` / `train()` with
DeepSpeed's per-iteration timing line, and the `hybrid_engine` config section's meaning.
Must not: reach into the strategy beyond the stage-3 seam (`unshard` / `reshard` / `unsharded`), change
what the model's forward or generate compute, or run an optimizer step while anything is gathered (the
strategy refuses it anyway).

Note: [generate is the model's] DeepSpeed swaps the model's layers for its inference kernels and points
`model.generate` at the engine's, because DeepSpeed-Chat calls `actor.module.generate(...)`. Here the
model's own forward runs (no kernel injection), and `engine.module.generate` is likewise pointed at
`engine.generate` (an attribute on the model instance, removed by `destroy()`), so both spellings get
the gather, the LoRA fusion and the timing. `engine.generate` calls the model's original bound method.
The attribute holds the engine and the model by weak reference (no cycle), and a deep copy of the model
(a reference model made from the actor) gets its class's own `generate`, bound to the copy, not the engine.

Note: [pin_parameters] DeepSpeed's `pin_parameters` (default true) gathers every layer before generating
and keeps them gathered to the end: one all-gather per parameter group per call, every decode step free
of collectives (the stage-3 seam's `unsharded()`). False leaves stage 3 gathering layer by layer as in
training (less memory, a gather and release per layer per decode step); LoRA then stays unfused (the
adapter's own forward computes it; DeepSpeed fuses layer by layer there). At stages 0-2 the parameters
are whole: no gather either way, and LoRA is always fused.

Note: [cuda graphs] `hybrid_engine.enable_cuda_graph` (DeepSpeed's key; default false): for the length of
each generate call, while the weights are whole (stages 0-2, or stage 3 pinned), the model's forward is
lightspeed.inference's CUDA-graph runner and the decode step uses a static KV cache, so every decode step
after the second replays one graph; graphs are kept across calls while the model's tensors stay where
they were, and dropped when they moved (graphs.py). Off CUDA the runner runs every call eagerly (logged).

Note: [max_out_tokens] DeepSpeed sizes its inference kernels' workspace (KV cache) by
`hybrid_engine.max_out_tokens`, the longest sequence (prompt and generated tokens) a generate call may
reach. The model's own KV cache grows as needed, but the bound is DeepSpeed's contract, so a call whose
`max_length` (or prompt length + `max_new_tokens`) exceeds it is refused before anything is gathered.
"""

from __future__ import annotations

import contextlib
import gc
import time
import types
import weakref

import torch

from lightspeed._utils.accelerator import get_accelerator
from lightspeed._utils.logging import get_logger
from lightspeed.comm.collectives import Communicator
from lightspeed.config.errors import ConfigError
from lightspeed.hybrid import tensor_parallel
from lightspeed.hybrid.graphs import DecodeGraphs
from lightspeed.hybrid.lora import fused_lora, is_dschat_lora, lora_modules
from lightspeed.runtime.engine import LightspeedEngine
from lightspeed.runtime.strategy import strategy_places_params

logger = get_logger(__name__)


def _prompt(inputs: tuple, kwargs: dict) -> torch.Tensor | None:
    ids = inputs[0] if inputs else kwargs.get("input_ids", kwargs.get("inputs"))
    return ids if torch.is_tensor(ids) else None


def _sequences(output):
    return output if torch.is_tensor(output) else getattr(output, "sequences", None)


class _EngineGenerate:
    """`engine.module.generate` while a hybrid engine holds the model (Note: [generate is the model's])."""

    def __init__(self, engine: "HybridEngine", model: torch.nn.Module):
        self._engine = weakref.ref(engine)
        self._model = weakref.ref(model)
        self.__doc__ = engine.generate.__doc__

    def __call__(self, *args, **kwargs):
        engine = self._engine()
        if engine is None:  # the engine is gone: the model's own generate
            model = self._model()
            return type(model).generate(model, *args, **kwargs)
        return engine.generate(*args, **kwargs)

    def __deepcopy__(self, memo):
        copied = memo.get(id(self._model()))  # the model's copy, registered before its attributes are copied
        if copied is None:
            raise TypeError("engine.module.generate cannot be copied apart from its model")
        return types.MethodType(type(copied).generate, copied)


class HybridEngine(LightspeedEngine):
    """The training engine plus DeepSpeed's hybrid-engine API: `generate(*args, **kwargs)` (the model's
    own `generate`, with the ZeRO-3 weights gathered once and LoRA fused), and `eval()` / `train()`
    switching between generation and training."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hybrid_config = self.config.hybrid_engine
        self._sync_rng()
        self.Z3_enabled = strategy_places_params(self.config)  # DeepSpeed's attribute name
        self.gather_all_layers = bool(self.hybrid_config.pin_parameters)
        # generation split over groups of consecutive ranks (tensor_parallel.py's Note: [tp generation])
        self._inference_comm = None
        tp_size = self.hybrid_config.inference_tp_size
        if tp_size > 1:
            if self.Z3_enabled and not self.gather_all_layers:
                raise ConfigError("hybrid_engine.inference_tp_size: splitting the layers for generation needs them "
                                  "gathered first; set hybrid_engine.pin_parameters true (its default)")
            if any(not is_dschat_lora(m) for m in lora_modules(self.module)):
                raise NotImplementedError("hybrid_engine.inference_tp_size > 1 with PEFT LoRA layers is not "
                                          "implemented (DeepSpeed-Chat's LoRA layers are split)")
            try:
                self._inference_comm = tensor_parallel.inference_groups(self.groups.world_size,
                                                                        self.groups.world_rank, tp_size)
            except ValueError as error:
                raise ConfigError(str(error)) from None
        self.mp_group = None if self._inference_comm is None else self._inference_comm.group  # DeepSpeed's name
        # Note: [cuda graphs]; unpinned stage 3 is refused by the config (config/features.py)
        self._decode_graphs = None
        if self.hybrid_config.enable_cuda_graph and callable(getattr(self.module, "generate", None)):
            self._decode_graphs = DecodeGraphs(self.module, self.device)
        # Note: [generate is the model's]
        self._module_generate = getattr(self.module, "generate", None)
        if callable(self._module_generate):
            self.module.generate = _EngineGenerate(self, self.module)
        # DeepSpeed's performance counters (its names)
        self._t_start: float | None = None
        self._total_latency = 0.0
        self._iters = 0
        self._training_start_time: float | None = None
        self._training_latency = 0.0
        self._generate_latency = 0.0
        self._gather_latency = 0.0
        self._generated_tokens = 0
        self._total_batch_size: int | None = None
        logger.info("hybrid engine: ZeRO stage %d, %s, %d LoRA layer(s) found", self.zero_optimization_stage(),
                    "weights gathered once per generate" if self.Z3_enabled and self.gather_all_layers
                    else "weights gathered layer by layer" if self.Z3_enabled else "weights whole",
                    len(lora_modules(self.module)))

    def _sync_rng(self) -> None:
        """DeepSpeed's: every rank takes rank 0's accelerator RNG state, so sampling agrees across ranks."""
        if self.groups.world_size == 1 or self.groups.topology is None:
            return
        accel = get_accelerator()
        state = accel.get_rng_state().to(self.device)
        Communicator(self.groups.topology.group("world"), self.groups.world_size).broadcast(state, src=0)
        accel.set_rng_state(state.cpu())

    # ------------------------------------------------------------------ generation
    def _check_max_out_tokens(self, prompt: torch.Tensor | None, kwargs: dict) -> None:
        """Note: [max_out_tokens]"""
        limit = self.hybrid_config.max_out_tokens
        gen = kwargs.get("generation_config") or getattr(self.module, "generation_config", None)
        prompt_len = prompt.shape[-1] if prompt is not None and prompt.dim() > 0 else 0
        new = kwargs.get("max_new_tokens", getattr(gen, "max_new_tokens", None) if "max_length" not in kwargs
                         else None)
        total = prompt_len + new if new is not None else kwargs.get("max_length", getattr(gen, "max_length", None))
        if total is not None and total > limit:
            raise ValueError(f"hybrid_engine.max_out_tokens: this generate call may reach {total} tokens (prompt "
                             f"and generated), more than the configured {limit}; raise max_out_tokens or "
                             "generate fewer tokens")

    def generate(self, *inputs, **kwargs):
        """DeepSpeed's `engine.generate`: the model's own `generate(*inputs, **kwargs)`, with the ZeRO-3
        weights gathered once for the whole call (Note: [pin_parameters]) and every LoRA adapter fused
        into its base weight; afterwards LoRA is taken out exactly and the weights go back to their
        shards (also on an exception). With `inference_tp_size` > 1 the ranks of an inference group
        generate together over their joined prompts, each on its slices of the layers, and each gets its
        own rows (tensor_parallel.py). With `enable_cuda_graph` the decode steps replay CUDA graphs
        (Note: [cuda graphs]). A collective at stage 3 or with inference_tp_size > 1: every rank
        calls it. Returns what the model's `generate` returns."""
        if not callable(self._module_generate):
            raise TypeError(f"engine.generate: the model ({type(self.module).__name__}) has no generate method")
        prompt = _prompt(inputs, kwargs)
        if self._total_batch_size is None and prompt is not None and prompt.dim() > 0:
            self._total_batch_size = prompt.shape[0] * self.groups.world_size
        self._check_max_out_tokens(prompt, kwargs)
        t0 = time.perf_counter()
        comm = self._inference_comm
        if comm is not None:
            inputs, kwargs, batch = tensor_parallel.join_prompts(comm, inputs, kwargs)
        gather = self.Z3_enabled and self.gather_all_layers
        with self.unsharded() if gather else contextlib.nullcontext():
            gathered_at = time.perf_counter()
            with fused_lora(self.module, enabled=gather or not self.Z3_enabled):
                with tensor_parallel.split_for_generation(self.module, comm) if comm is not None \
                        else contextlib.nullcontext():
                    with self._decode_graphs.generating(self.module, self._module_generate) \
                            if self._decode_graphs is not None else contextlib.nullcontext(self._module_generate) \
                            as generate:
                        output = generate(*inputs, **kwargs)
        if comm is not None:
            output = tensor_parallel.own_rows(output, comm, batch)
        if self.hybrid_config.release_inference_cache:
            if self._decode_graphs is not None:
                self._decode_graphs.release()
            gc.collect()
            get_accelerator().empty_cache()
        done = time.perf_counter()
        self._gather_latency += gathered_at - t0
        self._generate_latency += done - gathered_at
        seq = _sequences(output)
        if torch.is_tensor(seq) and seq.dim() == 2:
            encoder_decoder = bool(getattr(getattr(self.module, "config", None), "is_encoder_decoder", False))
            prompt_len = 0 if encoder_decoder or prompt is None else prompt.shape[-1]
            self._generated_tokens += seq.shape[0] * max(seq.shape[1] - prompt_len, 0)
        return output

    # ------------------------------------------------------------------ mode switches
    def eval(self):
        """Generation mode (DeepSpeed's): logs the last iteration's timing line (rank 0) and sets the
        model to eval."""
        now = time.perf_counter()
        if self._t_start is not None:
            latency = max(now - self._t_start, 1e-9)
            self._total_latency += latency
            self._iters += 1
            logger.info(self._timing_line(latency))
            self._t_start = now
        self._training_latency = 0.0
        self._gather_latency = self._generate_latency = 0.0
        self._generated_tokens = 0
        super().eval()
        if self.Z3_enabled:
            gc.collect()
            get_accelerator().empty_cache()
        if self._t_start is None:
            self._t_start = time.perf_counter()
        return self

    def train(self, mode: bool = True):
        """Training mode (`mode` false: eval, as nn.Module's)."""
        super().train(mode)
        if mode:
            self._training_start_time = time.perf_counter()
        return self

    def step(self, lr_kwargs: dict | None = None) -> None:
        super().step(lr_kwargs=lr_kwargs)
        if self._training_start_time is not None:
            now = time.perf_counter()
            self._training_latency += now - self._training_start_time
            self._training_start_time = now

    def _timing_line(self, latency: float) -> str:
        """DeepSpeed's line: end-to-end latency of the iteration (eval() to eval()), its gather,
        generate, training and other parts, and samples per second; plus the generated tokens/s."""
        def part(seconds: float) -> str:
            return f"{seconds:.2f}s ({seconds / latency * 100:.2f}%)"

        others = latency - (self._gather_latency + self._generate_latency + self._training_latency)
        line = (f"|E2E latency={latency:.2f}s |Gather latency={part(self._gather_latency)} "
                f"|Generate time={part(self._generate_latency)} |Training time={part(self._training_latency)} "
                f"|Others={part(others)}")
        if self._generate_latency > 0:
            line += f" |Generated tokens/s (this rank)={self._generated_tokens / self._generate_latency:.2f}"
        if self._total_batch_size is not None:
            line += (f" |CurSamplesPerSec={self._total_batch_size / latency:.2f}"
                     f" |AvgSamplesPerSec={self._total_batch_size * self._iters / self._total_latency:.2f}")
        return line

    def destroy(self) -> None:
        """`LightspeedEngine.destroy`, and the model's `generate` given back (Note: [generate is the model's])."""
        if isinstance(self.module.__dict__.get("generate"), _EngineGenerate):
            del self.module.__dict__["generate"]
        if self._decode_graphs is not None:
            self._decode_graphs.release()
            self._decode_graphs = None
        super().destroy()


__all__ = ["HybridEngine"]
