"""The training runtime: `initialize()` (initialize.py), the model transforms' order (model_transforms.py),
the sharding-strategy protocol and the one place a stage is chosen (strategy.py), the engine
(engine.py: orchestration only), the optimizer view `deepspeed.initialize` returns (engine_optimizer.py;
`lightspeed.initialize` returns the optimizer itself) and the data loader (dataloader.py). The top of
training: it may import every training package, and only compat/ and the top-level entry points
(`lightspeed.initialize`) import it.

The engine also makes the calls transformers and accelerate make: `no_sync()`,
`zero_gather_16bit_weights_on_model_save()`, `_zero3_consolidated_16bit_state_dict()`, `compile()`,
`unshard()` / `reshard()` / `unsharded()`, `engine.config.get(key)`; its step log line ends with an ETA
when the run's length is known (`set_total_steps`, else the scheduler's).

Note: compiled regions (`engine.compile()`). The strategy names the modules to compile
(`compile_regions()` on the protocol) and each is compiled in place with `nn.Module.compile`, so its
parameters, hooks and state-dict names stay; torch.compile starts tracing at a compiled module's
`forward`, so the module's own hooks run outside the graph. Stages 0-2 compile the whole module (their
gradient hooks run in autograd, never traced); stage 3 compiles each innermost unit and the root around
them, each unit one opaque op of the root's graph (`after_compile()` on the protocol joins them;
zero/stage3/opaque.py), or, with units nested deeper, each parameter holder without units inside
(zero/stage3/units.py's Note: compiled regions), and the whole module where no unit has forward hooks
(a data-parallel world of one). The
coordinator's forward hooks are wrapped in `torch.compiler.disable`, and while the torch-function mode
that finds external parameters is on (the first forward and backward, by default) `engine.forward` runs
under `torch.compiler.set_stance("force_eager")`, so that step is eager and later ones compiled.
Gathering, release, prefetch and the reduce-scatter stay exactly as in eager mode: no graph break per
unit, one graph per block shape. Chosen because it works unchanged on torch 2.11 and 2.13 with public
APIs only: tracing the gathers into the graph (DeepCompile's way, or FSDP2's traceable all-gather under
compiled autograd) needs functional collectives with the parameter storage managed inside the graph and
compiled autograd, both private or moving APIs; compiling the whole model at stage 3 breaks the graph at
every unit's hooks. tests/distributed/test_compile.py reads dynamo's counters (no graph break at any
stage, world sizes 1 and 2) and checks compiled losses against eager ones; benchmarks/compile.py
measures it on a GPU.
"""
