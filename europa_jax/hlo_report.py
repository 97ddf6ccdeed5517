"""Every collective of a lowered step: op, mesh axes, dtype, bytes per device per step.

We read the HLO *before* XLA's optimizations (`lowered.compiler_ir("hlo")`): that is the
program as written — XLA:CPU later upcasts fp8/bf16 collectives, which would hide what a
GPU run sends. Collectives inside `while` loops (the scan over layers, lax.map) are
counted once per iteration; trip counts come from the loop condition `i < N` that jax
emits for scans. Replica groups are mapped back to the mesh axes that generate them.

Bytes per device use the usual ring-algorithm volumes: all-gather moves its result
× (n−1)/n, reduce-scatter its operand × (n−1)/n, all-reduce 2 × (n−1)/n, all-to-all
× (n−1)/n, a collective-permute its result. ragged-all-to-all is reported at its buffer
size (an upper bound: it sends only the filled rows).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re

import numpy as np
from jax.sharding import Mesh

DTYPE_BYTES = {"f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
               "s8": 1, "u8": 1, "s32": 4, "u32": 4, "s64": 8, "pred": 1}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
               "ragged-all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?[\w.\-]+\s*=\s*(.+?)\s+([a-z\-]+)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    axes: tuple[str, ...]
    dtype: str
    bytes_per_device: float  # per execution × executions per step
    count: int  # executions per step


def _shape_bytes(text: str) -> tuple[str, int]:
    """(dtype of the first array, total bytes of all arrays) in an HLO shape string."""
    dtype, total = "", 0
    for dt, dims in _SHAPE.findall(text):
        if dt not in DTYPE_BYTES:
            continue
        dtype = dtype or dt
        total += DTYPE_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return dtype, total


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            name = header.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = comps[name]
        elif name and line.strip() != "}":
            comps[name].append(line)
    return comps


def _trip_count(cond_lines: list[str]) -> int:
    constants = [int(c) for line in cond_lines
                 for c in re.findall(r"s32\[\] constant\((\d+)\)", line)]
    if any("direction=LT" in line for line in cond_lines) and constants:
        return max(constants)
    return 1  # unknown loop shape: count once (reported as a lower bound)


def _groups(line: str) -> list[list[int]]:
    match = re.search(r"replica_groups=\{(\{[0-9,{}]*\})\}", line)
    if match:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}",
                                                                       match.group(1))]
    match = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](T\(([0-9,]+)\))?", line)
    if match:  # iota form: [G,N]<=[dims]T(perm)
        g, n = int(match.group(1)), int(match.group(2))
        dims = [int(d) for d in match.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if match.group(5):
            ids = ids.transpose([int(p) for p in match.group(5).split(",")])
        return ids.reshape(g, n).tolist()
    return []


def axes_of_groups(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes whose index varies inside each group (() if none recognised)."""
    shape = dict(zip(mesh.axis_names, mesh.devices.shape))
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    target = {frozenset(g) for g in groups}
    for r in range(1, len(mesh.axis_names) + 1):
        for axes in itertools.combinations(mesh.axis_names, r):
            moved = np.moveaxis(ids, [mesh.axis_names.index(a) for a in axes],
                                range(-len(axes), 0))
            candidate = {frozenset(row) for row in moved.reshape(-1, int(np.prod(
                [shape[a] for a in axes]))).tolist()}
            if candidate == target:
                return axes
    return ()


def collectives(hlo: str, mesh: Mesh) -> list[Collective]:
    """Every collective reachable from the entry computation, with per-step multiplicity."""
    comps = _computations(hlo)
    counts: dict[str, int] = collections.Counter()

    def visit(name: str, times: int, depth: int = 0):
        if depth > 64 or name not in comps:
            return
        counts[name] += times
        for line in comps[name]:
            loop = re.search(r"condition=([\w.\-]+), body=([\w.\-]+)", line)
            if loop:
                visit(loop.group(2), times * _trip_count(comps.get(loop.group(1), [])), depth + 1)
                continue
            for callee in re.findall(r"(?:to_apply|calls)=([\w.\-]+)", line):
                if " call(" in line or "custom-call(" in line or " fusion(" in line:
                    visit(callee, times, depth + 1)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:  # lax.cond: at most one branch runs; count each as possible
                for callee in branches.group(1).split(","):
                    visit(callee.strip(), times, depth + 1)
            for key in ("true_computation", "false_computation"):
                callee = re.search(rf"{key}=([\w.\-]+)", line)
                if callee:
                    visit(callee.group(1), times, depth + 1)

    visit("__entry__", 1)
    found = []
    for name, times in counts.items():
        if name == "__entry__":
            continue
        for line in comps[name]:
            match = _INSTR.match(line)
            if not match or match.group(2) not in COLLECTIVES:
                continue
            op, result = match.group(2), match.group(1)
            groups = _groups(line)
            n = len(groups[0]) if groups else 1
            # Unoptimized HLO names operands without shapes: sizes come from the result.
            dtype, result_bytes = _shape_bytes(result)
            if op == "reduce-scatter":  # operand = n × result
                moved = result_bytes * (n - 1)
            elif op == "all-reduce":
                moved = 2 * result_bytes * (n - 1) / n
            elif op == "collective-permute":
                moved = result_bytes
            else:  # all-gather, all-to-all, ragged-all-to-all
                moved = result_bytes * (n - 1) / n
            found.append(Collective(op, axes_of_groups(groups, mesh) if groups else (),
                                    dtype, moved * times, times))
    return found


def summarize(found: list[Collective]) -> list[dict]:
    """Totals per (op, axes, dtype), largest first."""
    table: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for c in found:
        table[(c.op, c.axes, c.dtype)][0] += c.bytes_per_device
        table[(c.op, c.axes, c.dtype)][1] += c.count
    rows = [{"op": op, "axes": "+".join(axes) or "?", "dtype": dtype,
             "bytes_per_device": total, "count": int(count)}
            for (op, axes, dtype), (total, count) in table.items()]
    return sorted(rows, key=lambda r: -r["bytes_per_device"])


def format_table(rows: list[dict]) -> str:
    lines = [f"{'op':<18} {'axes':<12} {'dtype':<9} {'count':>6} {'MiB/device':>11}"]
    for r in rows:
        lines.append(f"{r['op']:<18} {r['axes']:<12} {r['dtype']:<9} {r['count']:>6} "
                     f"{r['bytes_per_device'] / 2**20:>11.3f}")
    return "\n".join(lines)
