"""The `lightspeed` command (DeepSpeed's `deepspeed` launcher): `cli.py` (parsing, dispatch to `demo`,
`report`, `config check|show`, `convert to-fp32`, `checkpoint verify`, else a launch), `hostfile.py`
(hostfile, --include / --exclude, the world description: pure), `job.py` (options -> a one-node plan or a
multi-node job, every check before anything starts), `local.py` (one node on torch.distributed's elastic
agent), `node.py` (the per-node entry pdsh / ssh / mpirun / srun start: one elastic agent per host under
every launcher), `multinode.py` (exported variables from `.lightspeed_env` / `.deepspeed_env`, the
per-launcher commands, `--dry_run`), `rank_exec.py` (per-rank core binding and log), `report.py`,
`config_cmd.py`, `checkpoint_cmd.py`, `errors.py`, `exits.py` (which failed rank was first).

Argument parsing never imports torch. An unknown option gets a did-you-mean; `--node_rank` outside the
job's nodes is refused. `--as_deepspeed` makes each worker `python -m lightspeed.as_deepspeed [-m]
script` (carried to every node by `node.py`; refused with --no_python). A failed job ends with one line
(`job failed: rank R (pid P) exited with status S: <the rank's error-file message>`) for the rank that
failed first, not the peers that failed because of it, and that rank's exit status; `--comm_timeout`
sets every rank's LIGHTSPEED_COMM_TIMEOUT, and on a stall report the agent dumps its workers' stacks and
resumes stopped ones so the shutdown reaches them.
"""
