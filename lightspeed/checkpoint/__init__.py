"""Training checkpoints: writing them crash-safely, reading any of them into any layout, and
consolidating them into one state dict.

Writing: the engine hands each rank's objects to `writer.CheckpointWriter` (synchronous, or with
`checkpoint.writer.decoupled` a host snapshot written by a background thread; `engine.wait_checkpoint()`
waits, and a load waits first); files go into the tag's staging directory with `atomic.py`'s writes,
each rank's checksum manifest last (`integrity.py`), and rank 0 publishes the tag (`tag_dir.py`) and then
`latest`. `engine_checkpoint.py` says which files a tag holds. Writer types other than PYTHON and the
other writer keys that are not built are refused by config/support.py.

Reading: `engine_checkpoint.load` verifies the shared file and the rank's RNG state before it returns,
and every optimizer-state file is verified as it is opened (`tag_reader.TagReader`). Any saved training
state is a `source.TrainingStateSource`: lightspeed's fragments (`universal.LightspeedSource`), the
tensor-parallel layouts (`tensor_parallel.py`), a model's weights (`from_weights.py`), DeepSpeed's own
checkpoints (`deepspeed_pickle.py`, `deepspeed_format.py`, `deepspeed_stage0.py`); `universal.py` fills
any set of fragments from any source, read on every rank, agreed, then applied. So a checkpoint saved at
(world size N, stage S) loads at (M, S'): masters and elementwise optimizer state re-sliced, scalar state
per optimizer group, hyperparameters from the checkpoint. RNG across a world-size change: the ranks that
existed in the saved run restore their generators, new ranks keep theirs (DeepSpeed's engine saves no RNG
state at all).

Consolidation (`convert.py`, `safetensors_stream.py`, `zero_to_fp32.py`) works over any source.
DeepSpeed's readers are tested against checkpoints real DeepSpeed wrote (tests/fixtures/deepspeed/,
made by its `make_fixtures.py`): masters and moments equal DeepSpeed's own accessors, consolidation
equals its zero_to_fp32 bit for bit, and plain PyTorch continues with DeepSpeed's next losses.
"""
