"""Test helpers shipped with the package: `run_world.py` (a function run on real gloo, or NCCL, ranks in
forkserver-spawned processes; a rank reports its result or error before the teardown), `models.py` (tiny
deterministic models, with a parameter smaller than the world size and a frozen one),
`checkpointed_models.py` (residual blocks with dropout, run plain or through either checkpoint function),
`parity.py` (`train_alongside`: an engine and a plain-PyTorch reference stepped side by side),
`deepspeed_layout.py` (synthetic checkpoints in DeepSpeed's ZeRO layout), `monitor_files.py` (reads back
what the monitors wrote), `lora.py` (DeepSpeed-Chat's LoRA layer and helpers, for the hybrid engine)."""
