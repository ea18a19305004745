"""`deepspeed.runtime.sequence_parallel`: Ulysses / ALST sequence parallelism is not built in lightspeed yet."""
