"""DeepSpeed's `PipelineEngine`: the engine `initialize()` returns for a `PipelineModule`, trained one
batch at a time with `train_batch()` over a pipeline schedule (parallel/pipeline/schedule.py).

Owns: pulling the micro-batches from the data iterator (the ranks holding the first or the last
stage), running the schedule, the one optimizer step through the engine's own step sequence, the
loss DeepSpeed returns (the mean over micro-batches, averaged over data parallelism, broadcast to
every stage) and `eval_batch`. Must not: reduce gradients or step the optimizer itself (the
strategy and `LightspeedEngine.step` do), or drive `forward` / `backward` / `step` one micro-batch
at a time (refused, as DeepSpeed's pipeline engine refuses them).
"""

from __future__ import annotations

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.comm import api as comm_api
from lightspeed.config.errors import ConfigError
from lightspeed.parallel.experts.aux_loss import aux_loss_scale
from lightspeed.parallel.pipeline.module import PipelineModule
from lightspeed.parallel.pipeline.schedule import PipelineDriver, schedule_kind
from lightspeed.runtime.engine import LightspeedEngine

logger = get_logger(__name__)


class PipelineError(Exception):
    """DeepSpeed's `deepspeed.runtime.pipe.engine.PipelineError`: an engine method used out of pipeline
    mode (`forward`, `backward` or `step` instead of `train_batch`)."""


def _to_device(batch, device: torch.device):
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class _RepeatingLoader:
    """Iterates a data loader forever, restarting it when exhausted (DeepSpeed's RepeatingLoader)."""

    def __init__(self, loader):
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


class PipelineEngine(LightspeedEngine):
    """DeepSpeed's pipeline engine API: `train_batch(data_iter)`, `eval_batch(data_iter, ...)`,
    `is_first_stage()`, `is_last_stage()`, `set_dataiterator`, `micro_batches`."""

    # DeepSpeed's dtype codes for tensors sent between stages (its class constants)
    ID_TO_DTYPE = [torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16, torch.bfloat16,
                   torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]
    DTYPE_TO_ID = {dtype: id_ for id_, dtype in enumerate(ID_TO_DTYPE)}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(self.module, PipelineModule):
            raise TypeError("PipelineEngine: the model must be a PipelineModule")
        if not self._managed:  # DeepSpeed's rule
            raise ConfigError("managed_gradient_accumulation: false is not supported with pipeline parallelism")
        if self._autocast is not None:
            raise NotImplementedError("torch_autocast.enabled with a PipelineModule (the stages' forwards under "
                                      "autocast) is not implemented yet")
        topology = self.groups.topology
        self.num_stages = topology.size("pp")
        self.stage_id = topology.rank("pp")
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.micro_batches = self.gradient_accumulation_steps()
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.groups.dp_world_size > 1
        self._pp_group = topology.group("pp")
        coords = topology.coords()
        kind = schedule_kind(self.config.pipeline.schedule)
        for chunk in self.module.chunks:  # module.py's Note on forward brackets
            chunk.run_layers = self.strategy.forward_method(self.module.run_layers)
        self._driver = PipelineDriver(self.module, kind, self._pp_group, self.num_stages, self.device,
                                      self.strategy.backward_start, self.strategy.backward_end,
                                      reduces_every_step=self.strategy.stage >= 2,
                                      global_rank_of=lambda pp: topology.shape.rank_of({**coords, "pp": pp}))
        last_pp = self.num_stages - 1 if kind.order == "loop" else 0  # the rank holding the last stage
        self._loss_src = topology.shape.rank_of({**coords, "pp": last_pp})
        self.data_iterator = None
        self.batch_fn = None  # set_batch_fn
        self.has_attention_mask = False  # set_has_attention_mask
        self.agg_train_loss: torch.Tensor | None = None
        self.dp_group_loss: torch.Tensor | None = None
        self.outputs = None

    # ------------------------------------------------------------------ refused out of pipeline mode
    def forward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    # ------------------------------------------------------------------ DeepSpeed's queries
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataiterator(self, iterator) -> None:
        self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        self.training_dataloader = loader
        self.data_iterator = iter(_RepeatingLoader(loader))

    def set_batch_fn(self, fn) -> None:
        """`fn(batch)` is applied to each micro-batch as it is read from the data iterator (before it is
        split into inputs and labels), as DeepSpeed's post-processing of the loaded batch."""
        self.batch_fn = fn

    def set_has_attention_mask(self, value: bool) -> None:
        """DeepSpeed's flag that the last activation passed between stages is a boolean attention mask
        (DeepSpeed sends it as fp16 and turns it back to bool). Lightspeed's stages send bool tensors as
        they are, so the mask arrives as bool either way; the flag is kept for DeepSpeed's readers."""
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask: value must be a bool (got {type(value).__name__})")
        self.has_attention_mask = value

    def reset_activation_shape(self) -> None:
        """The activations' shapes change from the next batch (a new sequence length): the stages probe
        the next batch's first micro-batch again. Every rank calls it before that batch, as DeepSpeed's."""
        self._driver.reset_shapes()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        dp = self.groups.dp_world_size
        per_step = self.micro_batch_size * dp
        if train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size({train_batch_size}): not divisible by micro batch "
                             f"{self.micro_batch_size} x data parallel {dp}")
        self.config.gradient_accumulation_steps = train_batch_size // per_step
        self.config.train_batch_size = train_batch_size
        self.micro_batches = self.config.gradient_accumulation_steps

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        raise NotImplementedError("PipelineEngine.set_train_micro_batch_size: changing the pipeline's micro batch "
                                  "after initialize() (its stages exchange activations of that batch) is not "
                                  "implemented in lightspeed yet")

    # ------------------------------------------------------------------ the batch
    def _pull(self, n: int, data_iter) -> tuple[list | None, list | None]:
        """`n` micro-batches from the iterator, on the ranks whose stages read them (first: inputs, last:
        labels); every other rank reads nothing, as DeepSpeed's."""
        if not (self._driver.holds_first or self._driver.holds_last):
            return None, None
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch(): no data: pass data_iter, or training_data to initialize()")
            self.set_dataloader(self.training_dataloader)
            data_iter = self.data_iterator
        inputs, labels = [], []
        for _ in range(n):
            batch = next(data_iter)
            if self.batch_fn is not None:
                batch = self.batch_fn(batch)
            if not isinstance(batch, (list, tuple)) or len(batch) != 2:
                raise ValueError("a pipeline micro-batch must be a pair (inputs, labels), as DeepSpeed's "
                                 f"(got {type(batch).__name__}{'' if not isinstance(batch, (list, tuple)) else f' of {len(batch)}'})")
            inputs.append(_to_device(batch[0], self.device))
            labels.append(_to_device(batch[1], self.device))
        return (inputs if self._driver.holds_first else None), (labels if self._driver.holds_last else None)

    def _scale(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss / self.micro_batches
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    def _aux_scale(self) -> float:
        """The gradient each micro-batch's loss starts its backward with (what `_scale` multiplies by)."""
        return (self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0) / self.micro_batches

    def _mean_loss(self, broadcast: bool = True) -> torch.Tensor:
        """[the mean micro-batch loss, that averaged over data parallelism]: on every stage when
        `broadcast` (a collective over pp), else on the rank holding the last stage only (zeros elsewhere)."""
        out = torch.zeros(2, device=self.device)
        if self._driver.holds_last:
            mean = torch.stack(self._driver.losses).mean() if self._driver.losses else torch.tensor(0.0)
            out[0] = mean.to(self.device)
            out[1] = out[0]
            if self.is_data_parallel:
                comm_api.all_reduce(out[1:], group=self.groups.dp_group)
                out[1] /= self.groups.dp_world_size
        if broadcast and self.is_pipe_parallel:
            comm_api.broadcast(out, src=self._loss_src, group=self._pp_group)
        return out

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches pulled from `data_iter`
        (else the training data given to `initialize()`); returns the mean loss of the batch."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.tput_timer.start()
        self.timers.start("forward")
        inputs, labels = self._pull(self.micro_batches, self.data_iterator)
        with aux_loss_scale(self._aux_scale()):  # parallel/experts/aux_loss.py's Note
            self._driver.run(inputs, labels, train=True, scale_loss=self._scale, n_microbatches=self.micro_batches)
        self.timers.stop("forward")
        with torch.no_grad():
            losses = self._mean_loss()
        self.dp_group_loss, self.agg_train_loss = losses[0].clone(), losses[1].clone()
        self._loss_sum = self.agg_train_loss if self._loss_sum is None else self._loss_sum + self.agg_train_loss
        self._loss_count += 1
        self.monitor.record_loss(self.agg_train_loss, self.global_samples)
        self.micro_steps += self.micro_batches - 1  # LightspeedEngine.step counts the last one
        self._boundary_override = True
        try:
            LightspeedEngine.step(self)
        finally:
            self._boundary_override = None
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None):
        """Forward only over `num_micro_batches` (default: the accumulation steps) micro-batches; returns
        the mean loss (averaged over data parallelism; `reduce_output=None`: the list of micro-batch
        losses on the last stage), on every stage when `bcast_loss`; with `return_logits`, also the
        last stage's outputs (None elsewhere)."""
        if self._driver.kind.name == "zbv_zero_bubble":  # before any communication: every rank refuses
            raise NotImplementedError("eval_batch() with pipeline.schedule 'zbv_zero_bubble' is not implemented: "
                                      "torch's ZBV schedule runs its local backward hand-offs in eval too; evaluate "
                                      "with another engine's schedule (1f1b, gpipe, interleaved_*)")
        if reduce_output not in (None, "avg"):
            raise NotImplementedError(f"eval_batch(reduce_output={reduce_output!r}): only 'avg' and None are "
                                      "implemented")
        n = num_micro_batches or self.micro_batches
        self.module.eval()
        try:
            inputs, labels = self._pull(n, data_iter)
            with torch.no_grad():
                outputs = self._driver.run(inputs, labels if compute_loss else None, train=False,
                                           scale_loss=(lambda loss: loss) if compute_loss else None, n_microbatches=n)
                output = outputs
                if compute_loss and reduce_output is None:
                    output = list(self._driver.losses) if self._driver.holds_last else None
                elif compute_loss:
                    output = self._mean_loss(broadcast=bcast_loss)[1] if bcast_loss or self._driver.holds_last \
                        else None
        finally:
            self.module.train()
        if return_logits:
            return output, outputs
        return output


def prepare_tied(module: PipelineModule, topology, device: torch.device, zero_stage: int) -> None:
    """Tied modules across pipeline stages (module.py's Note on tied modules): every stage's copy made
    stage 0's (DeepSpeed's `_synchronize_tied_weights`; a collective over the pipeline group, once at
    set-up), and their gradients multiplied by the number of stages, so that the strategy's average over
    data parallelism x pp is DeepSpeed's sum over the stages averaged over data parallelism."""
    pp = topology.size("pp")
    if pp == 1 or not len(module.tied_modules):
        return
    if zero_stage >= 2:
        raise NotImplementedError(f"zero_optimization.stage={zero_stage} with tied modules (TiedLayerSpec "
                                  f"{sorted(module.tied_modules)}) over {pp} pipeline stages is not implemented: "
                                  "their gradients are summed over the stages, which ZeRO-2/3 would do inside "
                                  "every micro-batch's backward; use stage 0 or 1")
    src = topology.shape.rank_of({**topology.coords(), "pp": 0})
    group = topology.group("pp")
    with torch.no_grad():
        for _, p in sorted(module.tied_modules.named_parameters()):
            buf = p.detach().to(device)
            comm_api.broadcast(buf, src=src, group=group)
            if buf is not p:
                p.copy_(buf)
            if p.requires_grad:
                p.register_hook(lambda grad: grad * pp)
