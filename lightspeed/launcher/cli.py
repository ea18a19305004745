"""The `lightspeed` command: one argparse parser with a subcommand per job.

Owns argument parsing and handing work to torch.distributed's elastic agent. It must not import torch
(or anything that does) while parsing, so `lightspeed --help` and argument errors stay instant; each
command imports what it needs inside its function. Subcommands register themselves in
`build_parser` (`demo` now; `report`, `config` and launching a user script come later).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

# A command gets its parsed arguments and the arguments meant for the script it runs; returns an exit status.
Command = Callable[[argparse.Namespace, list[str]], int]


def _error(msg: str) -> int:
    print(f"lightspeed: error: {msg}", file=sys.stderr)
    return 2


def _repo_root() -> Path:
    import lightspeed  # no torch: lightspeed/__init__.py imports lazily

    return Path(lightspeed.__file__).resolve().parents[1]


def launch_local(script: Path, script_args: list[str], nproc: int, run_id: str) -> int:
    """Run `python -u script *script_args` in nproc processes on this host through the elastic agent.

    The agent sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each worker, as
    torchrun does; rendezvous is c10d on localhost with a port the OS picks. Returns 0 when every
    worker succeeds, 1 when one fails (the agent stops the others and prints which one and why).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Workers must import this lightspeed even when it is not installed (run from a source checkout).
    root = str(_repo_root())
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)
    # Like torchrun: without this every worker starts one thread per core and they fight over them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.5,
    )
    try:
        elastic_launch(config, sys.executable)("-u", str(script), *script_args)
    except ChildFailedError as e:
        print(e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def run_demo(args: argparse.Namespace, script_args: list[str]) -> int:
    """`lightspeed demo`: train the small GPT of examples/ on Shakespeare in a few processes."""
    script = _repo_root() / "examples" / "train_gpt.py"
    if not script.is_file():
        return _error(f"demo script not found at {script}; the demo needs a source checkout "
                      "installed with `pip install -e .`")
    import torch

    if args.nproc is not None and args.nproc < 1:
        return _error(f"--nproc must be at least 1 (got {args.nproc})")
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if args.steps is not None:
        script_args = ["--steps", str(args.steps), *script_args]
    return launch_local(script, script_args, nproc, run_id=f"lightspeed-demo-{os.getpid()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightspeed", description="Fast, memory-efficient training of large PyTorch models."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="train a small GPT on Shakespeare (CPU or GPU)",
        description="Train the small GPT of examples/train_gpt.py on Shakespeare, data parallel over "
        "several processes. Arguments this command does not know go to the script "
        "(e.g. --preset, --seed, --config, --save_dir); put them after -- to be explicit.",
        allow_abbrev=False,  # an abbreviation must not swallow one of the script's options
    )
    demo.add_argument("--nproc", type=int, default=None,
                      help="number of processes (default: 2 on CPU, one per GPU with CUDA)")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the script's)")
    demo.set_defaults(func=run_demo, passes_extra_args=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if "--" in extra:  # argparse keeps the separator; the script must not see it
        extra.remove("--")
    return args.func(args, extra)


if __name__ == "__main__":
    sys.exit(main())
