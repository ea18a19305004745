"""L0: helpers every layer may use. Imports only torch, so anything that needs nothing else lives here
(DeepSpeed's accelerator object included) and every layer above may use it.

`logging.py` (the rank-aware logger: rank 0 by default, `log_all_ranks()` to lift that, and a record
logged with `extra={"all_ranks": True}` passes on every rank, for DeepSpeed's `log_dist(ranks=...)`;
`warn_once`), `sizes.py` (alignment, padding, splitting), `flat.py` (`FlatLayout`, `flat_views`,
`flatten_into`), `timers.py`, `device.py` (cpu | cuda, streams and events that are no-ops on CPU),
`accelerator.py` (DeepSpeed's `get_accelerator()`, one per process; op builders raise: no C++/CUDA
build), `pinned.py` (page-locked host tensors of the exact size), `progress.py` (`progress()`,
`format_duration`), `memory_usage.py` (`see_memory_usage`), `init_on_device.py` (`OnDevice` and
`ParameterRegistrationContext`, the parameter-registration hook it shares with `zero.Init`)."""
