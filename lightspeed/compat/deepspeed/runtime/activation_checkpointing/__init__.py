"""`deepspeed.runtime.activation_checkpointing`: activation checkpointing is not built in lightspeed yet
(see `checkpointing`)."""
