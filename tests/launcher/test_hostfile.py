"""Hostfile, --include/--exclude, world info, env files, core lists, --local_rank detection, node rank
and rendezvous choice: pure functions, no processes."""

import pytest

from lightspeed.launcher.errors import LaunchError
from lightspeed.launcher.hostfile import (decode_world_info, encode_world_info, limit_resources, parse_hostfile,
                                          parse_node_spec, pool_from_hostfile, select_resources)
from lightspeed.launcher.local import LOCAL_RANK_MACRO, NodePlan, local_rank_option, rendezvous, worker_command
from lightspeed.launcher.multinode import collect_exports, read_env_file
from lightspeed.launcher.node import resolve_node_rank
from lightspeed.launcher.rank_exec import cores_for_rank, parse_core_list

HOSTFILE = """\
# the cluster
worker-0 slots=4

worker-1   slots=4   # second node
worker-2 slots=2 max_slots=8
"""


def pool():
    return pool_from_hostfile(parse_hostfile(HOSTFILE.splitlines()))


def test_hostfile_lines_comments_and_blank_lines():
    assert parse_hostfile(HOSTFILE.splitlines()) == {"worker-0": 4, "worker-1": 4, "worker-2": 2}
    assert list(parse_hostfile(HOSTFILE.splitlines())) == ["worker-0", "worker-1", "worker-2"]


@pytest.mark.parametrize("text, message", [
    ("worker-0 slots=4\nworker-1 slot=4\n", 'hf:2: expected "HOSTNAME slots=N", got "worker-1 slot=4"'),
    ("worker-0\n", 'hf:1: expected "HOSTNAME slots=N", got "worker-0"'),
    ("worker-0 slots=four\n", 'hf:1: expected "HOSTNAME slots=N", got "worker-0 slots=four"'),
    ("worker-0 slots=4 extra\n", 'hf:1: expected "HOSTNAME slots=N", got "worker-0 slots=4 extra"'),
    ("worker-0 slots=0\n", "hf:1: host worker-0 needs at least one slot (got slots=0)"),
    ("worker-0 slots=2\n\nworker-0 slots=2\n", "hf:3: host worker-0 is listed twice (first on line 1)"),
    ("# nothing\n\n", 'hf: no hosts listed (expected lines like "worker-0 slots=8")'),
])
def test_bad_hostfile_lines_name_the_line(text, message):
    with pytest.raises(LaunchError) as err:
        parse_hostfile(text.splitlines(), source="hf")
    assert str(err.value) == message


def test_node_spec_syntax():
    assert parse_node_spec("worker-0@worker-1:0,2") == {"worker-0": [], "worker-1": [0, 2]}
    assert parse_node_spec("worker-1:2@worker-1:0,2") == {"worker-1": [0, 2]}
    for spec, message in [("worker-0:a", 'bad slot "a" for host worker-0'), ("@worker-0", "empty host name"),
                          ("worker-0:", 'bad slot "" for host worker-0'), ("worker-0:-1", 'bad slot "-1"')]:
        with pytest.raises(LaunchError, match=message):
            parse_node_spec(spec)


def test_include_keeps_named_hosts_and_slots_in_hostfile_order():
    assert select_resources(pool(), include="worker-2@worker-0:1,3") == {"worker-0": [1, 3], "worker-2": [0, 1]}
    assert select_resources(pool(), include="worker-1") == {"worker-1": [0, 1, 2, 3]}


def test_exclude_removes_slots_and_whole_hosts():
    assert select_resources(pool(), exclude="worker-1:0@worker-2") == {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}
    assert select_resources(pool()) == pool()


@pytest.mark.parametrize("include, exclude, message", [
    ("worker-9", "", "--include: unknown host worker-9 (the resource pool has: worker-0, worker-1, worker-2)"),
    ("worker-2:2", "", "--include: host worker-2 has slots 0-1; there is no slot 2"),
    ("", "worker-0:7,9", "--exclude: host worker-0 has slots 0-3; there is no slot 7,9"),
    ("", "worker-0@worker-1@worker-2", '--exclude "worker-0@worker-1@worker-2" leaves no slots to run on'),
    ("worker-0", "worker-1", "--include and --exclude cannot be used together"),
])
def test_bad_include_exclude(include, exclude, message):
    with pytest.raises(LaunchError) as err:
        select_resources(pool(), include, exclude)
    assert str(err.value) == message


def test_num_nodes_and_slots_per_node():
    assert limit_resources(pool(), num_nodes=2, per_node=2) == {"worker-0": [0, 1], "worker-1": [0, 1]}
    with pytest.raises(LaunchError, match="--num_nodes 4 but only 3 hosts are available"):
        limit_resources(pool(), num_nodes=4)
    with pytest.raises(LaunchError, match="--num_gpus 3 but host worker-2 has only 2 slots"):
        limit_resources(pool(), per_node=3)


def test_world_info_round_trip():
    active = {"worker-0": [1, 3], "worker-2": [0]}
    assert decode_world_info(encode_world_info(active)) == active
    with pytest.raises(LaunchError, match="--world_info"):
        decode_world_info("not base64 json")


def test_env_file(tmp_path):
    (tmp_path / "e").write_text('# comment\n\nNCCL_IB_HCA=mlx5_0:1,mlx5_1:1\nexport QUOTED="a b"\nEQ=x=y\n')
    assert read_env_file(str(tmp_path / "e")) == {"NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1", "QUOTED": "a b", "EQ": "x=y"}
    (tmp_path / "bad").write_text("GOOD=1\nno equals sign\n")
    with pytest.raises(LaunchError, match=r'bad:2: expected "NAME=VALUE", got "no equals sign"'):
        read_env_file(str(tmp_path / "bad"))


def test_exports_from_environment_then_env_files_home_first(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home-ds\nB=home-ds\n")
    (home / ".lightspeed_env").write_text("B=home-ls\nC=home-ls\n")
    (cwd / ".deepspeed_env").write_text("C=cwd-ds\n")
    environ = {"NCCL_DEBUG": "INFO", "UCX_TLS": "tcp", "HOME": str(home), "OTHER": "x", "PYTHONPATH": "/p"}
    exports = collect_exports(environ, str(cwd), str(home))
    assert exports.pop("PYTHONPATH").split(":")[0::2] == [str(cwd), "/p"]  # cwd first, then this checkout
    assert exports == {"NCCL_DEBUG": "INFO", "UCX_TLS": "tcp", "A": "home-ds", "B": "home-ls", "C": "cwd-ds"}
    (home / "custom_env").write_text("A=custom\n")
    renamed = collect_exports({**environ, "DS_ENV_FILE": "custom_env"}, str(cwd), str(home))
    assert renamed["A"] == "custom" and "C" in renamed and renamed["C"] == "home-ls"  # ./.deepspeed_env unread


def test_core_lists():
    assert parse_core_list("0,2-4,6") == [0, 2, 3, 4, 6]
    for bad in ("3-1", "0,0", "2,1", "a", "1-"):
        with pytest.raises(ValueError):
            parse_core_list(bad)
    assert [cores_for_rank(list(range(10)), 3, r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="2 cores for 4 processes"):
        cores_for_rank([0, 1], 4, 0)


def _plan(tmp_path, source, **kw):
    script = tmp_path / "train.py"
    script.write_text(source)
    return NodePlan(world_info={"localhost": [0, 1]}, node_rank=0, script=str(script), **kw)


def test_local_rank_passed_only_to_scripts_that_declare_it(tmp_path):
    assert local_rank_option(_plan(tmp_path, "p.add_argument('--local_rank', type=int)")) == "--local_rank"
    assert local_rank_option(_plan(tmp_path, 'p.add_argument("--local-rank", type=int)')) == "--local-rank"
    assert local_rank_option(_plan(tmp_path, "rank = int(os.environ['LOCAL_RANK'])")) is None
    assert local_rank_option(_plan(tmp_path, "p.add_argument('--local_rank')", no_local_rank=True)) is None
    cmd = worker_command(_plan(tmp_path, "p.add_argument('--local_rank')", script_args=["--lr", "1"]))
    assert cmd[-3:] == [f"--local_rank={LOCAL_RANK_MACRO}", "--lr", "1"]


def test_node_rank_from_option_host_name_or_starter():
    world = {"a": [0], "b": [0, 1], "c": [0]}
    assert resolve_node_rank(world, 2, {}, set()) == 2
    assert resolve_node_rank(world, -1, {"OMPI_COMM_WORLD_RANK": "0"}, {"b"}) == 1  # the host name wins
    assert resolve_node_rank(world, -1, {"SLURM_PROCID": "2"}, {"elsewhere"}) == 2
    with pytest.raises(LaunchError, match="cannot tell which"):
        resolve_node_rank(world, -1, {}, {"elsewhere"})
    with pytest.raises(LaunchError, match="--node_rank 3 but the job has 3 nodes"):
        resolve_node_rank(world, 3, {}, set())


def test_rendezvous_choice(tmp_path):
    one = _plan(tmp_path, "")
    assert rendezvous(one)["rdzv_backend"] == "c10d" and rendezvous(one)["rdzv_endpoint"] == "localhost:0"
    two = NodePlan(world_info={"a": [0, 1], "b": [0]}, node_rank=1, script="t.py", master_addr="a", master_port=29500)
    assert rendezvous(two) == dict(rdzv_backend="static", rdzv_endpoint="a:29500", rdzv_configs={"rank": 1},
                                   min_nodes=2, max_nodes=2)
    elastic = NodePlan(world_info={"a": [0], "b": [0]}, node_rank=0, script="t.py", master_addr="a",
                       master_port=29400, elastic=(1, 4))
    assert rendezvous(elastic) == dict(rdzv_backend="c10d", rdzv_endpoint="a:29400", rdzv_configs={},
                                       min_nodes=1, max_nodes=4)


def test_node_command_round_trips_through_the_node_parser():
    from lightspeed.launcher.node import build_parser, node_command

    plan = NodePlan(world_info={"a": [0, 1], "b": [2]}, node_rank=0, script="train.py", script_args=["--lr", "1"],
                    master_addr="a", master_port=6000, no_local_rank=True, max_restarts=2, each_rank_log="/logs",
                    bind_cores=True, bind_core_list="0-7", elastic=(1, 3), cpu=True, run_id="r1")
    args = build_parser().parse_args(node_command(plan, "1")[4:])
    assert decode_world_info(args.world_info) == plan.world_info
    assert (args.node_rank, args.master_addr, args.master_port, args.training_script, args.training_script_args) == \
        (1, "a", 6000, "train.py", ["--lr", "1"])
    assert (args.no_local_rank, args.max_restarts, args.enable_each_rank_log, args.bind_cores_to_rank,
            args.bind_core_list, args.enable_elastic_training, args.min_elastic_nodes, args.max_elastic_nodes,
            args.cpu, args.run_id, args.module, args.no_python) == \
        (True, 2, "/logs", True, "0-7", True, 1, 3, True, "r1", False, False)
