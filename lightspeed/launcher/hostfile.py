"""The resource pool and which part of it a job uses: hostfile, --include / --exclude, --num_nodes and
--num_gpus, and the world description handed to every node.

Pure parsing on strings and dicts: no processes, no torch, no logging of its own. Every bad input
raises `LaunchError` with one line naming the hostfile line or the option and the host at fault.

DeepSpeed's formats, byte for byte:
- hostfile: ``HOSTNAME slots=N`` per line, ``#`` comments, blank lines ignored. Other ``key=value``
  words after ``slots=N`` (an MPI hostfile's ``max_slots=16``) are accepted and ignored.
- --include / --exclude: ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``;
  a host without ``:SLOT`` means all of its slots.
- world info: the active resources ``{host: [slot, ...]}`` as JSON, URL-safe base64 encoded, so it
  survives every shell and launcher on the way to a remote node.

Note: where this differs from DeepSpeed
    DeepSpeed checks --include slots against the include list itself, so ``worker-0:7`` on a host with
    4 slots passes and fails later on the node; here it is an error naming the host's slots. Likewise
    --num_nodes larger than the host count, and --num_gpus larger than a host's slots, are errors here
    where DeepSpeed silently runs on fewer (or on devices that do not exist).
"""

from __future__ import annotations

import base64
import json
import re
from typing import Iterable

from lightspeed.launcher.errors import LaunchError

# host -> slot ids (GPU indices, or process slots on CPU), hosts in hostfile order.
Resources = dict[str, list[int]]

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default (DLTS)

_HOST_LINE = re.compile(r"(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\d+)(?P<rest>(\s+\S+=\S*)*)")


def parse_hostfile(lines: Iterable[str], source: str = "hostfile") -> dict[str, int]:
    """``{host: number of slots}`` in file order from the lines of a hostfile.

    `source` names the file in error messages, e.g. ``hostfile:3: expected "HOSTNAME slots=N" ...``.
    """
    pool: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.fullmatch(line)
        if match is None:
            raise LaunchError(f'{source}:{lineno}: expected "HOSTNAME slots=N", got "{line}"')
        host, slots = match.group("host"), int(match.group("slots"))
        if slots < 1:
            raise LaunchError(f"{source}:{lineno}: host {host} needs at least one slot (got slots={slots})")
        if host in pool:
            raise LaunchError(f"{source}:{lineno}: host {host} is listed twice (first on line {first_seen[host]})")
        pool[host] = slots
        first_seen[host] = lineno
    if not pool:
        raise LaunchError(f'{source}: no hosts listed (expected lines like "worker-0 slots=8")')
    return pool


def read_hostfile(path: str) -> dict[str, int]:
    """`parse_hostfile` on the file at `path`; a missing or unreadable file is a LaunchError."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LaunchError(f"cannot read hostfile {path}: {e.strerror or e}") from None
    return parse_hostfile(lines, source=path)


def pool_from_hostfile(slots_per_host: dict[str, int]) -> Resources:
    return {host: list(range(n)) for host, n in slots_per_host.items()}


def describe_slots(slots: list[int]) -> str:
    """``0-3`` for a contiguous run, else ``0,2,5``."""
    if slots and slots == list(range(slots[0], slots[0] + len(slots))) and len(slots) > 1:
        return f"{slots[0]}-{slots[-1]}"
    return ",".join(map(str, slots))


def parse_node_spec(spec: str, option: str = "--include") -> dict[str, list[int]]:
    """``"worker-0@worker-1:0,2"`` -> ``{"worker-0": [], "worker-1": [0, 2]}`` (empty: every slot).

    A host named twice has its slots merged; slots come back sorted and without duplicates.
    """
    nodes: dict[str, list[int]] = {}
    for part in spec.split("@"):
        part = part.strip()
        host, sep, slot_text = part.partition(":")
        if not host:
            raise LaunchError(f'{option}: empty host name in "{spec}" (expected HOST[:SLOT,...][@HOST...])')
        slots: list[int] = []
        if sep:
            for word in slot_text.split(","):
                if not word.strip().isdigit():
                    raise LaunchError(f'{option}: bad slot "{word}" for host {host} in "{spec}" '
                                      f"(slots are non-negative integers, e.g. {host}:0,1)")
                slots.append(int(word))
        if host in nodes and (not nodes[host] or not slots):
            nodes[host] = []  # the whole host named once wins over a slot list
        else:
            nodes[host] = sorted(set(nodes.get(host, []) + slots))
    return nodes


def _known_hosts(pool: Resources) -> str:
    hosts = list(pool)
    return ", ".join(hosts[:8]) + (f", ... ({len(hosts)} hosts)" if len(hosts) > 8 else "")


def _check_node(pool: Resources, host: str, slots: list[int], option: str) -> None:
    if host not in pool:
        raise LaunchError(f"{option}: unknown host {host} (the resource pool has: {_known_hosts(pool)})")
    missing = [s for s in slots if s not in pool[host]]
    if missing:
        raise LaunchError(f"{option}: host {host} has slots {describe_slots(pool[host])}; "
                          f"there is no slot {describe_slots(missing)}")


def select_resources(pool: Resources, include: str = "", exclude: str = "") -> Resources:
    """The part of `pool` that --include keeps or --exclude leaves, in pool order."""
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together")
    if not include and not exclude:
        return {host: list(slots) for host, slots in pool.items()}
    option, spec = ("--include", include) if include else ("--exclude", exclude)
    nodes = parse_node_spec(spec, option)
    for host, slots in nodes.items():
        _check_node(pool, host, slots, option)
    if include:
        active = {host: list(nodes[host] or pool[host]) for host in pool if host in nodes}
    else:
        active = {}
        for host, slots in pool.items():
            if host in nodes:
                slots = [s for s in slots if nodes[host] and s not in nodes[host]]
            if slots:
                active[host] = list(slots)
    if not active:
        raise LaunchError(f'{option} "{spec}" leaves no slots to run on')
    return active


def limit_resources(active: Resources, num_nodes: int = -1, per_node: int = -1,
                    per_node_option: str = "--num_gpus") -> Resources:
    """The first `num_nodes` hosts, and the first `per_node` slots of each (-1: no limit)."""
    if num_nodes > 0:
        if num_nodes > len(active):
            raise LaunchError(f"--num_nodes {num_nodes} but only {len(active)} host"
                              f"{'s are' if len(active) != 1 else ' is'} available ({_known_hosts(active)})")
        active = dict(list(active.items())[:num_nodes])
    if per_node > 0:
        for host, slots in active.items():
            if per_node > len(slots):
                raise LaunchError(f"{per_node_option} {per_node} but host {host} has only {len(slots)} "
                                  f"slot{'s' if len(slots) != 1 else ''}")
        active = {host: slots[:per_node] for host, slots in active.items()}
    return active


def encode_world_info(active: Resources) -> str:
    """The active resources as URL-safe base64 of their JSON (DeepSpeed's --world_info)."""
    return base64.urlsafe_b64encode(json.dumps(active, separators=(",", ":")).encode("utf-8")).decode("utf-8")


def decode_world_info(text: str) -> Resources:
    try:
        world = json.loads(base64.urlsafe_b64decode(text.encode("utf-8")))
        if not isinstance(world, dict) or not world:
            raise ValueError("not a non-empty object")
        return {str(host): [int(s) for s in slots] for host, slots in world.items()}
    except (ValueError, TypeError) as e:
        raise LaunchError(f"--world_info is not a base64-encoded JSON object of host -> slots ({e})") from None
