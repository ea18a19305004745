"""`deepspeed.launcher`: the names other tools read from DeepSpeed's launcher (the `lightspeed` command
is the launcher itself; see lightspeed/launcher/)."""
