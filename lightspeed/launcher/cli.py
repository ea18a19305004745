"""The `lightspeed` command: argument parsing and dispatch.

``lightspeed [launcher options] script.py [script args]`` starts a training script on this node or on
every host of a hostfile, with the options of DeepSpeed's `deepspeed` command. Subcommands, named
first: ``lightspeed demo``, ``lightspeed report``, ``lightspeed config check|show FILE``, ``lightspeed convert
to-fp32|to-deepspeed CKPT_DIR OUT``, ``lightspeed checkpoint verify DIR``, ``lightspeed autotune [options] script.py [args]`` (``--autotuning tune``). (A script named like a subcommand is run as
``lightspeed ./report``.)

Must not import torch (or anything that does) while parsing, so `lightspeed --help` and argument
errors stay instant; each command imports what it needs inside its function. Bad input is one line
on stderr and exit status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Callable, NoReturn, Optional

from lightspeed.launcher.errors import LaunchError
from lightspeed.launcher.hostfile import DEFAULT_HOSTFILE, describe_slots

# A subcommand gets its parsed arguments and the arguments meant for the script it runs; returns an exit status.
Command = Callable[[argparse.Namespace, list[str]], int]
SUBCOMMANDS = ("demo", "report", "config", "convert", "checkpoint")
LAUNCHER_CHOICES = ("pdsh", "ssh", "openmpi", "slurm", "local")


def _error(msg: str) -> int:
    print(f"lightspeed: error: {msg}", file=sys.stderr)
    return 2


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (no usage dump) and exit 2, and which
    suggests the option an unknown one was probably meant to be."""

    def error(self, message: str) -> NoReturn:
        message = message.replace(", user_args", "")
        if message.startswith("unrecognized arguments: "):
            message += _did_you_mean(message.split(": ", 1)[1].split(), _option_strings(self))
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of `parser` and of its subcommands' parsers."""
    found = []
    for action in parser._actions:
        found += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return sorted(set(found))


def _did_you_mean(words: list[str], known: list[str]) -> str:
    """`` (did you mean --num_procs?)`` for the first unknown option close to a known one, else ''."""
    import difflib

    for word in words:
        if not word.startswith("--"):
            continue
        name = word.split("=", 1)[0]
        variants = {o.replace("-", "_"): o for o in known}
        close = difflib.get_close_matches(name.replace("-", "_"), list(variants), n=1, cutoff=0.75)
        if close:
            return f" (did you mean {variants[close[0]]}?)"
    return ""


def _repo_root() -> Path:
    import lightspeed  # no torch: lightspeed/__init__.py imports lazily

    return Path(lightspeed.__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- launch


def build_launch_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lightspeed", allow_abbrev=False,
        usage="lightspeed [launcher options] script.py [script args]\n"
              "       lightspeed {demo,report,config,convert,checkpoint} ...",
        description="Run a training script on this node's GPUs (or CPU processes), or on every host of a "
                    "hostfile, through torch.distributed's elastic agent. Options are DeepSpeed's.",
        epilog="subcommands: `lightspeed demo` trains a small GPT; `lightspeed report` shows versions, GPUs "
               "and which kernels can run here; `lightspeed config check|show FILE` validates or resolves "
               "a ds_config; `lightspeed convert to-fp32 CKPT OUT` consolidates a checkpoint into fp32 weights; "
               "`lightspeed checkpoint verify DIR` checks a checkpoint's checksums. Each has --help.",
    )
    add = p.add_argument
    add("-H", "--hostfile", default=None,
        help=f'hostfile of "HOSTNAME slots=N" lines (default: {DEFAULT_HOSTFILE} if present, else this machine)')
    add("-i", "--include", default="", help='hosts/slots to use, e.g. "worker-0@worker-1:0,2"')
    add("-e", "--exclude", default="", help='hosts/slots not to use, e.g. "worker-1:0" (same syntax)')
    add("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    add("--num_gpus", "--num_accelerators", type=int, default=-1, help="use GPUs [0, N) of each host")
    add("--num_procs", type=int, default=-1, help="run N CPU processes per node (no GPUs)")
    add("--master_addr", default="", help="address of node 0 (default: 127.0.0.1, or the first host)")
    add("--master_port", type=int, default=None,
        help="port on node 0 (default: 29500 for several nodes, a free port for one)")
    add("--node_rank", type=int, default=-1, help="this node's rank, with --launcher local / --no_ssh")
    add("--launcher", type=str.lower, default="pdsh", choices=LAUNCHER_CHOICES,
        help="how to start the hosts of a multi-node job (default: pdsh); local: this node only")
    add("--launcher_args", default="", help="extra arguments for pdsh / ssh / mpirun / srun, as one string; write "
        "--launcher_args='-i key ...' when it starts with a dash")
    add("--force_multi", action="store_true", help="use the multi-node launcher even for one host")
    add("--no_ssh", action="store_true", help="same as --launcher local: run this node's share only")
    add("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check of the first host")
    add("--ssh_port", type=int, default=None, help="ssh port for pdsh and ssh")
    add("--module", action="store_true", help="run the script as a module (python -m)")
    add("--no_python", action="store_true", help="the script is an executable; do not run it with python")
    add("--no_local_rank", action="store_true", help="never pass --local_rank to the script")
    add("--as_deepspeed", action="store_true",
        help="run an unchanged DeepSpeed script: every rank registers lightspeed as `deepspeed` before it starts")
    add("--max_restarts", type=int, default=None,
        help="restart all workers up to N times after a failure (default 0; 100 with --elastic_training, as DeepSpeed)")
    add("--comm_timeout", type=float, default=None, metavar="SECONDS",
        help="end the job when a collective waits longer than this; every rank's stacks are printed "
             "(default: $LIGHTSPEED_COMM_TIMEOUT, else 600)")
    add("--enable_each_rank_log", default=None, metavar="DIR",
        help="write each rank's output to DIR/<time>_rank<R>.log")
    add("--bind_cores_to_rank", action="store_true", help="give each rank its own share of the cores")
    add("--bind_core_list", default=None, help='cores to share out, e.g. "0-15,32-47" (implies --bind_cores_to_rank)')
    add("--autotuning", default="", choices=("tune", "run"),
        help="tune the ds_config's batch, ZeRO stage, offload and compile with short experiments (the script's "
        "`autotuning` section), write the best config; `run` then trains with it (also `lightspeed autotune`)")
    add("--autotuning_memory_budget", type=int, default=None, metavar="BYTES",
        help="autotuning: prune candidates predicted above this many bytes per rank (default: "
        "autotuning.memory_budget, else the accelerator's memory)")
    add("--elastic_training", action="store_true", help="elastic rendezvous: nodes may come and go")
    add("--min_elastic_nodes", "--min_nodes", type=int, default=-1, help="elastic: fewest nodes to run on (default 1)")
    add("--max_elastic_nodes", "--max_nodes", type=int, default=-1,
        help="elastic: most nodes (default: the hosts given)")
    add("--comment", default="", help="slurm: srun --comment")
    add("--account", default="", help="slurm: srun --account")
    add("--dry_run", action="store_true", help="print the command(s) that would run, and run nothing")
    add("--version", action="version", version=_version())
    add("user_script", metavar="script", help="the training script, followed by its arguments")
    add("user_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def _version() -> str:
    import lightspeed

    return f"lightspeed {lightspeed.__version__}"


def _dry_run(job) -> list[str]:
    from lightspeed.launcher import multinode
    from lightspeed.launcher.local import NodePlan, worker_command, worker_env
    from lightspeed.launcher.node import node_command

    if not isinstance(job, NodePlan):
        return multinode.dry_run_lines(job, dict(os.environ))
    plan = job
    env = worker_env(plan, dict(os.environ))
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()
                     if k in ("CUDA_VISIBLE_DEVICES", "LIGHTSPEED_ACCELERATOR"))
    return [shlex.join(node_command(plan, str(plan.node_rank))),
            f"# {plan.host}: node {plan.node_rank}, slots {describe_slots(plan.slots)}, {plan.nprocs} of "
            f"{plan.world_size} ranks" + (f", {shown}" if shown else ""),
            f"# each worker runs: {shlex.join(worker_command(plan))}"]


def run_launch(args: argparse.Namespace, argv: Optional[list[str]] = None) -> int:
    """`lightspeed [options] script.py [args]`; `argv`: the command line, which `--autotuning` runs again."""
    from lightspeed.launcher import multinode
    from lightspeed.launcher.job import resolve_job
    from lightspeed.launcher.local import NodePlan, run_node

    try:
        job = resolve_job(args)
        if args.autotuning:
            return _autotune(args, argv, job)
        if args.dry_run:
            print("\n".join(_dry_run(job)))
            return 0
        if isinstance(job, NodePlan):
            return run_node(job)
        return multinode.run(job, check_ssh_first=not args.no_ssh_check)
    except LaunchError as e:
        return _error(str(e))


def _autotune(args: argparse.Namespace, argv: Optional[list[str]], job) -> int:
    """`--autotuning tune|run`: experiments through this launcher with the same options (autotuning/driver.py)."""
    from lightspeed.autotuning.driver import run_autotuning
    from lightspeed.config.errors import ConfigError
    from lightspeed.launcher.local import NodePlan

    if argv is None:
        raise LaunchError("--autotuning: the launcher's command line is needed to run the experiments")
    launcher_argv = _without_autotuning(argv[:len(argv) - len(args.user_args) - 1])
    plan = job if isinstance(job, NodePlan) else job.plan
    try:
        return run_autotuning(args.autotuning, launcher_argv, args.user_script, list(args.user_args),
                              plan.world_size, memory_budget=args.autotuning_memory_budget)
    except (ConfigError, NotImplementedError) as e:
        return _error(str(e))


def _without_autotuning(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--autotuning", "--autotuning_memory_budget"):
            skip = True
        elif not arg.startswith(("--autotuning=", "--autotuning_memory_budget=")):
            out.append(arg)
    return out


# ------------------------------------------------------------------------------------------ subcommands


def run_demo(args: argparse.Namespace, script_args: list[str]) -> int:
    """`lightspeed demo`: train the small GPT of examples/ on Shakespeare in a few processes."""
    script = _repo_root() / "examples" / "train_gpt.py"
    if not script.is_file():
        return _error(f"demo script not found at {script}; the demo needs a source checkout "
                      "installed with `pip install -e .`")
    if args.nproc is not None and args.nproc < 1:
        return _error(f"--nproc must be at least 1 (got {args.nproc})")
    import torch

    from lightspeed.launcher.local import launch_local

    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if args.steps is not None:
        script_args = ["--steps", str(args.steps), *script_args]
    return launch_local(script, script_args, nproc, run_id=f"lightspeed-demo-{os.getpid()}")


def run_report(args: argparse.Namespace, script_args: list[str]) -> int:
    from lightspeed.launcher.report import print_report

    return print_report()


def run_config(args: argparse.Namespace, script_args: list[str]) -> int:
    from lightspeed.launcher.config_cmd import config_check, config_show

    if args.action == "check":
        return config_check(args.file, args.world_size, hf=args.hf)
    return config_show(args.file, args.world_size)


def run_convert(args: argparse.Namespace, script_args: list[str]) -> int:
    """`lightspeed convert to-fp32 CKPT_DIR OUT`: DeepSpeed's zero_to_fp32, streaming."""
    from lightspeed.checkpoint.errors import CheckpointError
    from lightspeed.checkpoint.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    shard = None if args.max_shard_size.lower() in ("none", "0") else args.max_shard_size
    try:
        written = convert_zero_checkpoint_to_state_dict(
            args.checkpoint_dir, args.output_dir, dtype=args.dtype, max_shard_size=shard,
            safe_serialization=args.safetensors, tag=args.tag, exclude_frozen_parameters=args.exclude_frozen,
            verify=not args.no_verify)
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        return _error(str(e).strip("'\""))
    for path in written:
        print(path)
    return 0


def run_convert_to_deepspeed(args: argparse.Namespace, script_args: list[str]) -> int:
    """`lightspeed convert to-deepspeed CKPT_DIR OUT`: DeepSpeed 0.19.8's layout, which it resumes."""
    from lightspeed.checkpoint.deepspeed_writer import write_deepspeed_checkpoint
    from lightspeed.checkpoint.errors import CheckpointError

    try:
        path = write_deepspeed_checkpoint(args.checkpoint_dir, args.output_dir, source_tag=args.tag,
                                          stage=args.stage, world_size=args.world_size, dtype=args.dtype,
                                          sub_group_size=args.sub_group_size, verify=not args.no_verify,
                                          ep_size=args.ep_size)
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        return _error(str(e).strip("'\""))
    print(path)
    return 0


def run_convert_from_hf(args: argparse.Namespace, script_args: list[str]) -> int:
    """`lightspeed convert from-hf MODEL_DIR SAVE_DIR`: a model's safetensors as a training checkpoint."""
    from lightspeed.checkpoint.errors import CheckpointError
    from lightspeed.checkpoint.from_weights import read_safetensors_dir, write_checkpoint_from_weights

    try:
        path = write_checkpoint_from_weights(read_safetensors_dir(args.model_dir), args.save_dir, tag=args.tag)
    except (CheckpointError, ValueError, OSError) as e:
        return _error(str(e).strip("'\""))
    print(path)
    return 0


def run_checkpoint(args: argparse.Namespace, script_args: list[str]) -> int:
    from lightspeed.launcher.checkpoint_cmd import checkpoint_verify

    return checkpoint_verify(args.dir, args.tag, args.all)


def build_parser() -> argparse.ArgumentParser:
    """The subcommands' parser (`demo`, `report`, `config`, `convert`, `checkpoint`)."""
    parser = _Parser(prog="lightspeed", description="Fast, memory-efficient training of large PyTorch models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

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

    report = commands.add_parser("report", help="versions, GPUs and which kernels can run here (like ds_report)",
                                 description="Print lightspeed, torch, triton, CUDA and NCCL versions, the GPUs "
                                 "seen, and for each kernel family whether it can run on this machine and why not.")
    report.set_defaults(func=run_report)

    config = commands.add_parser("config", help="check or show a ds_config file",
                                 description="Validate a DeepSpeed config (check) or print it resolved (show).")
    actions = config.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    for name, text in (("check", "print every problem with its JSON path, and the settings lightspeed does not "
                                 "implement yet; exit 1 if there is any"),
                       ("show", "print the resolved config as JSON: every default filled in, batch sizes resolved")):
        action = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        action.add_argument("file", help="ds_config file (JSON or HJSON)")
        action.add_argument("--world-size", "--world_size", dest="world_size", type=int, default=None,
                            help="data-parallel world size for the batch triad (default: $WORLD_SIZE, else 1)")
        if name == "check":
            action.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None,
                                help='check a Hugging Face template: read each "auto" as a placeholder and report '
                                     'every other problem (default: when the file holds an "auto")')
        action.set_defaults(func=run_config)

    convert = commands.add_parser("convert", help="convert a checkpoint (DeepSpeed's or lightspeed's)",
                                  description="Convert a training checkpoint into other forms.")
    kinds = convert.add_subparsers(dest="kind", metavar="KIND", required=True, parser_class=_Parser)
    to_fp32 = kinds.add_parser(
        "to-fp32", help="consolidate into one set of weights (DeepSpeed's zero_to_fp32)",
        description="Consolidate a checkpoint saved at any world size and ZeRO stage into the model's weights "
        "(fp32 masters of the trained parameters, buffers, frozen parameters), as pytorch_model.bin or "
        "model.safetensors, sharded with a Hugging Face index past --max-shard-size. Reads one parameter and "
        "writes one shard at a time, so memory stays near one shard (safetensors: one tensor).")
    to_fp32.add_argument("checkpoint_dir", help="the save dir (with `latest`), or one tag directory")
    to_fp32.add_argument("output_dir", help="directory for the weights (created if missing)")
    to_fp32.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step100 (default: latest)")
    to_fp32.add_argument("--safetensors", "--safe_serialization", dest="safetensors", action="store_true",
                         help="write model.safetensors (default: pytorch_model.bin)")
    to_fp32.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default="5GB",
                         help='largest shard, e.g. 5GB, 500MB, 2GiB; "none" for one file (default: 5GB)')
    to_fp32.add_argument("--exclude-frozen", "--exclude_frozen_parameters", dest="exclude_frozen",
                         action="store_true", help="leave out frozen (not trained) parameters")
    to_fp32.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                         help="dtype of the floating tensors written (default: fp32)")
    to_fp32.add_argument("--no-verify", "--no_verify", dest="no_verify", action="store_true",
                         help="read the checkpoint without checking its checksums (a lightspeed tag without its "
                         "manifests); the weights written are then unverified")
    to_fp32.set_defaults(func=run_convert)
    to_ds = kinds.add_parser(
        "to-deepspeed", help="write DeepSpeed's checkpoint layout, which DeepSpeed's engine resumes",
        description="Write a checkpoint (lightspeed's, or DeepSpeed's at another stage or world size) in DeepSpeed "
        "0.19.8's layout: <OUT>/<tag>/ and <OUT>/latest, for ZeRO --stage over --world-size data-parallel ranks "
        "(default: the saved ones; DeepSpeed loads ZeRO files only at the world size they were written for). "
        "DeepSpeed's param groups must list the parameters in the module's order, as model.parameters() does.")
    to_ds.add_argument("checkpoint_dir", help="the save dir (with `latest`), or one tag directory")
    to_ds.add_argument("output_dir", help="directory to write the tag and `latest` into (created if missing)")
    to_ds.add_argument("-t", "--tag", default=None,
                       help="checkpoint tag to read, and the tag written (default: latest)")
    to_ds.add_argument("--stage", type=int, default=None, choices=(0, 1, 2, 3),
                       help="ZeRO stage to write for (default: the saved one)")
    to_ds.add_argument("--world-size", "--world_size", dest="world_size", type=int, default=None,
                       help="data-parallel world size to write for (default: the saved one)")
    to_ds.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                       help="training dtype DeepSpeed runs in (default: the saved module's)")
    to_ds.add_argument("--sub-group-size", "--sub_group_size", dest="sub_group_size", type=int,
                       default=1_000_000_000, help="stage 3: DeepSpeed's zero_optimization.sub_group_size "
                       "(default: DeepSpeed's, 1e9)")
    to_ds.add_argument("--ep-size", "--ep_size", dest="ep_size", type=int, default=None,
                       help="MoE (DeepSpeed-style experts, stages 0-2): the expert-parallel size DeepSpeed runs "
                       "with, which its optimizer files are laid out for (default: the saved one)")
    to_ds.add_argument("--no-verify", "--no_verify", dest="no_verify", action="store_true",
                       help="read the checkpoint without checking its checksums")
    to_ds.set_defaults(func=run_convert_to_deepspeed)
    from_hf = kinds.add_parser(
        "from-hf", help="a Hugging Face model's safetensors as a training checkpoint",
        description="Write a Hugging Face model directory's safetensors weights as a lightspeed training checkpoint "
        "(module state, fp32 masters, no optimizer state, step 0) that engine.load_checkpoint starts a run from "
        "at any world size and ZeRO stage.")
    from_hf.add_argument("model_dir", help="directory with model.safetensors, or shards and their index")
    from_hf.add_argument("save_dir", help="checkpoint directory to write (the tag and `latest` go in it)")
    from_hf.add_argument("-t", "--tag", default="global_step0", help="the tag to write (default: global_step0)")
    from_hf.set_defaults(func=run_convert_from_hf)

    checkpoint = commands.add_parser("checkpoint", help="verify a saved engine checkpoint",
                                     description="Tools for engine checkpoints written by save_checkpoint.")
    ckpt_actions = checkpoint.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    text = ("check every file of a checkpoint tag against its checksum manifests (size, CRC-32 of every tensor "
            "and of the pickled structure) and that the tag is complete and consistent as load_checkpoint checks it "
            "(every rank's files and manifest, the rank count, every rank's optimizer state); exit 1 if anything "
            "does not match")
    verify = ckpt_actions.add_parser("verify", help=text, description=text[0].upper() + text[1:] + ".")
    verify.add_argument("dir", help="the save directory (holding `latest`), or a tag directory")
    verify.add_argument("--tag", default=None, help="the tag to verify (default: the one `latest` names)")
    verify.add_argument("--all", action="store_true", help="verify every tag directory in DIR")
    verify.set_defaults(func=run_checkpoint)
    return parser


def _ignore_missing_numpy() -> None:
    """torch warns at import ("Failed to initialize NumPy") when NumPy is not installed, and it is not
    a dependency; the launcher never uses NumPy, so its own import of torch stays quiet."""
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


def main(argv: Optional[list[str]] = None) -> int:
    _ignore_missing_numpy()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "autotune":  # `lightspeed autotune [options] script.py [args]`: --autotuning tune
        argv = ["--autotuning", "tune", *argv[1:]]
    if not argv or argv[0] not in SUBCOMMANDS:
        return run_launch(build_launch_parser().parse_args(argv), argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if "--" in extra:  # argparse keeps the separator; the script must not see it
        extra.remove("--")
    return args.func(args, extra)


if __name__ == "__main__":
    sys.exit(main())
