"""The flops profile as text: DeepSpeed's number formats, the summary, the aggregated profile (top
modules per depth) and the detailed module tree.

Works on plain `ModuleStats` records; must not touch modules, hooks or devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PRECISION = 2

_UNITS = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """`1.23 G`-style text: the largest unit not above `num` (1 and 0 have no unit), or `units`."""
    if units is None:
        if num == 0 or 1 <= num < 1e3:
            units, magnitude = "", 1.0
        else:
            units, magnitude = next(((u, m) for u, m in _UNITS if num >= m), ("u", 1e-6))
    else:
        magnitude = dict(_UNITS).get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


@dataclass
class ModuleStats:
    """One module's forward profile: inclusive of its children (flops, MACs, latency in seconds,
    parameters counted once per module even when tied)."""

    name: str
    class_name: str
    params: int = 0
    flops: int = 0
    duration: float = 0.0
    calls: int = 0
    children: list["ModuleStats"] = field(default_factory=list)

    @property
    def macs(self) -> int:
        # FlopCounterMode counts matmuls, convolutions and attention: two flops per multiply-accumulate
        return self.flops // 2


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, DEFAULT_PRECISION) if whole else 0:g}%"


def module_line(stats: ModuleStats, total: ModuleStats) -> str:
    """`name (Class): params = % Params, MACs = % MACs, latency = % latency, FLOPS`."""
    flops_per_s = stats.flops / stats.duration if stats.duration else 0.0
    label = f"{stats.name} ({stats.class_name})" if stats.name else stats.class_name
    return (f"{label}: {params_to_string(stats.params)} = {_pct(stats.params, total.params)} Params, "
            f"{macs_to_string(stats.macs)} = {_pct(stats.macs, total.macs)} MACs, "
            f"{duration_to_string(stats.duration)} = {_pct(stats.duration, total.duration)} latency, "
            f"{flops_to_string(flops_per_s)}")


def module_tree(root: ModuleStats) -> list[str]:
    """The detailed profile: one line per module, indented two spaces per depth."""
    lines: list[str] = []

    def walk(stats: ModuleStats, depth: int) -> None:
        lines.append("  " * depth + module_line(stats, root))
        for child in stats.children:
            walk(child, depth + 1)

    walk(root, 0)
    return lines


def aggregated(root: ModuleStats, module_depth: int = -1, top_modules: int = 1) -> list[str]:
    """Per depth, the `top_modules` module classes with the most params, MACs and latency (summed
    over the modules of that class at that depth); depths 0..module_depth, all when -1."""
    by_depth: list[dict[str, list[float]]] = []

    def walk(stats: ModuleStats, depth: int) -> None:
        if depth == len(by_depth):
            by_depth.append({})
        acc = by_depth[depth].setdefault(stats.class_name, [0, 0, 0.0])
        acc[0] += stats.params
        acc[1] += stats.macs
        acc[2] += stats.duration
        for child in stats.children:
            walk(child, depth + 1)

    walk(root, 0)
    last = len(by_depth) - 1 if module_depth < 0 else min(module_depth, len(by_depth) - 1)
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        info = by_depth[depth]

        def top(i, fmt):
            ranked = sorted(info.items(), key=lambda kv: kv[1][i], reverse=True)[:top_modules]
            return {k: fmt(v[i]) for k, v in ranked}

        lines += [f"depth {depth}:", f"    params      - {top(0, params_to_string)}",
                  f"    MACs        - {top(1, macs_to_string)}", f"    fwd latency - {top(2, duration_to_string)}"]
    return lines
