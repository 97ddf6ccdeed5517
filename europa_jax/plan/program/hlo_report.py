"""What a step's HLO says: every collective (op, mesh axes, dtype, bytes per device per
step), matmul FLOPs, and the largest buffers.

We read the HLO *before* XLA's optimizations (`lowered.compiler_ir("hlo")`): that is the
program as written — XLA:CPU later upcasts fp8/bf16 collectives, which would hide what a
GPU run sends. The optimized text (`compiled.as_text()`) parses too: of a CPU compile it
shows the collectives the SPMD partitioner adds outside `shard_map`; of a GPU-target
compile (gpu_target.py) it is what a GPU runs — async `*-start` ops, collectives of
several dtypes combined into one (counted per dtype). Work inside `while`
loops (the scan over layers, lax.map) is counted once per iteration; trip counts come
from XLA's `known_trip_count` or the loop condition `i < N` that jax emits for scans
(fused into the condition where XLA stated no count).
Replica groups are mapped back to the mesh axes that generate them.

Bytes per device use the usual ring-algorithm volumes: all-gather moves its result
× (n−1)/n, reduce-scatter its operand × (n−1)/n, all-reduce 2 × (n−1)/n, all-to-all
× (n−1)/n, a collective-permute its result. ragged-all-to-all is reported at its buffer
size (an upper bound: it sends only the filled rows; the plan prices the rows it
carries). The part that crosses nodes comes from the devices of the replica groups
(links.py), for any mesh. A loop whose trip count is data (MoE overflow rounds) counts
once unless the caller says what it expects (`dynamic_trips`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re
from typing import Callable

import numpy as np
from jax.sharding import Mesh

from europa_jax.config import MeshConfig
from europa_jax.plan.program import links

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
    count: float  # executions per step (expected, for loops whose trip count is data)
    infiniband_bytes: float = 0.0  # the part of bytes_per_device between nodes (links.py)
    op_name: str = ""  # jax's name of the op (metadata), which says its phase

    def scaled(self, factor: float) -> "Collective":
        """The same collective carrying `factor` of its bytes (a ragged exchange's fill)."""
        return dataclasses.replace(self, bytes_per_device=self.bytes_per_device * factor,
                                   infiniband_bytes=self.infiniband_bytes * factor)


def _shape_bytes(text: str) -> tuple[str, int]:
    """(dtype of the first array, total bytes of all arrays) in an HLO shape string."""
    by_dtype = _bytes_by_dtype(text)
    return next(iter(by_dtype), ""), sum(by_dtype.values())


def _bytes_by_dtype(text: str) -> dict[str, int]:
    """Bytes of the arrays in an HLO shape string, per dtype, in order of appearance."""
    out: dict[str, int] = {}
    for dt, dims in _SHAPE.findall(text):
        if dt in DTYPE_BYTES:
            out[dt] = out.get(dt, 0) + DTYPE_BYTES[dt] * math.prod(_dims(dims) or [1])
    return out


def _top_level_items(text: str) -> list[str]:
    """`(a, (b, c), d)` → ['a', '(b, c)', 'd']; a shape that is no tuple → [itself]."""
    text = re.sub(r"/\*[^*]*\*/", "", text).strip()
    if not text.startswith("("):
        return [text]
    items, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            items.append(text[start:i].strip())
            start = i + 1
    return [item for item in items if item]


def _result_shape(op: str, result: str) -> str:
    """The collective's result arrays, from an instruction's result shape.

    An async `-start` (optimized GPU HLO) returns a tuple that also holds its operands:
    `(operands, results)` for gathers, scatters and all-to-alls, `(operands…, output)`
    for ragged all-to-all, `(operand, result, context…)` for collective-permute; an
    all-reduce-start returns its results only (shaped like its operands).
    """
    if not op.endswith("-start") or op == "all-reduce-start":
        return result
    items = _top_level_items(result)
    if op == "collective-permute-start":
        return items[1] if len(items) > 1 else result
    return items[-1]


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Instruction lines of every computation, and the entry computation's name."""
    hlo = hlo.replace("%", "")  # optimized HLO prefixes every name with %
    comps, name, entry = {}, None, ""
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            name = header.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name and line.strip() != "}":
            comps[name].append(line)
    return comps, entry


def _trip_count(while_line: str, comps: dict[str, list[str]]) -> int | None:
    """A loop's trip count: stated (optimized HLO) or jax's scan condition `i < N` (lowered
    HLO, or optimized where XLA left no count: the comparison fused into the condition);
    None when it is data."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', while_line)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", while_line)
    cond_lines = comps.get(condition.group(1), []) if condition else []
    constants = [int(c) for line in cond_lines
                 for c in re.findall(r"s32\[\] constant\((\d+)\)", line)]
    if any("direction=LT" in line for line in cond_lines) and constants:
        return max(constants)
    # XLA fused the comparison into the condition: one `i < constant` and nothing else
    fused = [line for cond in cond_lines for callee in re.findall(r"calls=%?([\w.\-]+)", cond)
             for line in comps.get(callee, [])]
    compares = [line for line in fused if " compare(" in line]
    defined = dict(re.findall(r"([\w.\-]+) = s32\[\] constant\((\d+)\)", "\n".join(fused)))
    if len(compares) == 1 and "direction=LT" in compares[0]:
        operands = re.search(r"compare\(%?([\w.\-#]+), %?([\w.\-#]+)\)", compares[0])
        if operands and operands.group(2) in defined:
            return int(defined[operands.group(2)])
    return None


def _op_name(line: str) -> str:
    found = re.search(r'op_name="([^"]*)"', line)
    return found.group(1) if found else ""


def execution_counts(comps: dict[str, list[str]], entry: str,
                     dynamic_trips: Callable[[str], float] | None = None
                     ) -> dict[str, float]:
    """How many times each computation runs per execution of the entry computation.

    Loop bodies are multiplied by their trip counts — a loop whose count is data by
    `dynamic_trips(its op name)`, or once; every branch of a conditional is counted as
    if it ran (an upper bound: `lax.cond` runs one).
    """
    counts: dict[str, float] = collections.Counter()

    def visit(name: str, times: int, depth: int = 0):
        if depth > 64 or name not in comps:
            return
        counts[name] += times
        for line in comps[name]:
            loop = re.search(r"condition=([\w.\-]+), body=([\w.\-]+)", line)
            if loop:
                trips = _trip_count(line, comps)
                if trips is None:
                    trips = dynamic_trips(_op_name(line)) if dynamic_trips else 1
                visit(loop.group(2), times * trips, depth + 1)
                continue
            for callee in re.findall(r"(?:to_apply|calls)=([\w.\-]+)", line):
                if " call(" in line or "custom-call(" in line or " fusion(" in line:
                    visit(callee, times, depth + 1)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                for callee in branches.group(1).split(","):
                    visit(callee.strip(), times, depth + 1)
            for key in ("true_computation", "false_computation"):
                callee = re.search(rf"{key}=([\w.\-]+)", line)
                if callee:
                    visit(callee.group(1), times, depth + 1)

    visit(entry, 1)
    return counts


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
    match = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(?:,\s*device_ids=\(([^)]*\)?)\)\s*)?"
                      r"\{([^}]*)\}", line)
    if match:  # optimized HLO's named form: mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, where
        # `device_ids=([2,4]T(1,0))` (an iota) or `device_ids=(0,4,…)` orders the devices
        axes = re.findall(r"'(\w+)'=(\d+)", match.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", match.group(3))]
        ids = _device_ids(match.group(2), math.prod(sizes)).reshape(sizes)
        ids = np.moveaxis(ids, grouped, range(-len(grouped), 0))
        return ids.reshape(-1, math.prod(sizes[a] for a in grouped)).tolist()
    return []


def _device_ids(text: str | None, n: int) -> np.ndarray:
    """Device order of a named replica-group mesh: identity, an iota `[dims]T(perm)`, or a list."""
    if not text:
        return np.arange(n)
    iota = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text.strip())
    if iota:
        ids = np.arange(n).reshape([int(d) for d in iota.group(1).split(",")])
        if iota.group(2):
            ids = ids.transpose([int(p) for p in iota.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(d) for d in text.split(",") if d.strip()])


def axes_of_groups(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes whose index varies inside each group (() if none recognised). Groups
    that split an axis's groups in parts (`axis_index_groups`: a node's part of the
    expert axis) are named by the axes and the part's size, e.g. `expert:4`."""
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
            if len(groups[0]) > 1 and all(any(g <= c for c in candidate) for g in target):
                return tuple(axes[:-1]) + (f"{axes[-1]}:{len(groups[0])}",)
    return ()


def collectives(hlo: str, mesh: Mesh, keep: Callable[[str], bool] | None = None, *,
                devices_per_node: int = MeshConfig.devices_per_node,
                dynamic_trips: Callable[[str], float] | None = None) -> list[Collective]:
    """Every collective reachable from the entry computation, with per-step multiplicity
    and the part of its bytes between nodes of `devices_per_node` devices (links.py).

    `keep(line)` selects instructions by their HLO text (e.g. their op_name metadata);
    `dynamic_trips(op name)`: the expected trips of a loop whose count is data.
    """
    comps, entry = _computations(hlo)
    found = []
    for name, times in execution_counts(comps, entry, dynamic_trips).items():
        for line in comps[name]:
            if not keep or keep(line):
                found += line_collectives(line, mesh, times, devices_per_node)
    return found


def line_collectives(line: str, mesh: Mesh, times: float,
                     devices_per_node: int = MeshConfig.devices_per_node) -> list[Collective]:
    """The collective of one HLO instruction executed `times` per step, one per dtype it
    carries (none for an instruction that is no collective or a `-done`)."""
    match = _INSTR.match(line)
    op = match.group(2).removesuffix("-start") if match else ""
    if op not in COLLECTIVES:
        return []
    groups = _groups(line)
    n = len(groups[0]) if groups else 1
    axes = axes_of_groups(groups, mesh) if groups else ()
    between = links.inter_node_share(op, groups, devices_per_node, line)
    # Operands are named without shapes (unoptimized HLO) or mixed into an async start's
    # tuple: sizes come from the result. XLA combines collectives of different dtypes into
    # one (an fp8 gather with the fp32 router's): per dtype.
    out = []
    for dtype, result_bytes in _bytes_by_dtype(_result_shape(match.group(2),
                                                             match.group(1))).items():
        moved = _moved_bytes(op, result_bytes, n) * times
        out.append(Collective(op, axes, dtype, moved, times, moved * between, _op_name(line)))
    return out


def _moved_bytes(op: str, result_bytes: int, n: int) -> float:
    """Bytes one device sends for one execution (ring volumes, module docstring)."""
    if op == "reduce-scatter":  # operand = n × result
        return result_bytes * (n - 1)
    if op == "all-reduce":
        return 2 * result_bytes * (n - 1) / n
    if op == "collective-permute":
        return result_bytes
    return result_bytes * (n - 1) / n  # all-gather, all-to-all, ragged-all-to-all


_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?([\w.\-]+)\s*=\s*([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def dot_flops(hlo: str, keep: Callable[[str], bool] | None = None) -> float:
    """2·(result elements)·(contracted size) summed over every `dot`, × executions per step.

    Every branch of a conditional counts (execution_counts), so a program that skips
    work with `lax.cond` (causal key blocks, unused expert blocks) is over-counted.
    """
    comps, entry = _computations(hlo)
    total = 0.0
    for name, times in execution_counts(comps, entry).items():
        shapes = {m.group(1): _dims(m.group(3)) for m in map(_DEFINITION.match, comps[name]) if m}
        for line in comps[name]:
            match = _INSTR.match(line)
            if not match or match.group(2) != "dot" or (keep and not keep(line)):
                continue
            lhs = re.search(r"\bdot\(([\w.\-]+)", line).group(1)
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
            k = math.prod(shapes[lhs][d] for d in _dims(contracting.group(1))) if contracting else 1
            result = _SHAPE.search(match.group(1))
            total += 2.0 * math.prod(_dims(result.group(2))) * k * times
    return total


def largest_buffers(hlo: str, n: int | None = 5) -> list[dict]:
    """The `n` largest distinct arrays an HLO program defines, with the jax op that made them
    and where they live: `memory` is "host" for a layout in memory space 5 (`{1,0:S(5)}`,
    XLA:GPU's pinned host memory), else "device". All of them for n=None."""
    seen: dict[tuple, dict] = {}
    for line in hlo.replace("%", "").splitlines():
        match = _DEFINITION.match(line)
        if not match or match.group(2) not in DTYPE_BYTES:
            continue
        dims = _dims(match.group(3))
        layout = re.match(r"\{[^}]*\}", line[match.end():])
        memory = "host" if layout and ":S(5)" in layout.group(0) else "device"
        source = re.search(r'op_name="([^"]*)"', line)
        key = (match.group(2), tuple(dims), memory)
        if key not in seen or (source and not seen[key]["source"]):
            seen[key] = {"dtype": match.group(2), "shape": dims, "memory": memory,
                         "bytes": DTYPE_BYTES[match.group(2)] * math.prod(dims),
                         "source": source.group(1) if source else ""}
    return sorted(seen.values(), key=lambda b: -b["bytes"])[:n]


def summarize(found: list[Collective]) -> list[dict]:
    """Totals per (op, axes, dtype), largest first; `infiniband_bytes` of them between nodes."""
    table: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for c in found:
        row = table[(c.op, c.axes, c.dtype)]
        row[0] += c.bytes_per_device
        row[1] += c.count
        row[2] += c.infiniband_bytes
    rows = [{"op": op, "axes": "+".join(axes) or "?", "dtype": dtype,
             "bytes_per_device": total, "count": int(round(count)),
             "infiniband_bytes": between}
            for (op, axes, dtype), (total, count, between) in table.items()]
    return sorted(rows, key=lambda r: -r["bytes_per_device"])


def format_table(rows: list[dict]) -> str:
    lines = [f"{'op':<18} {'axes':<12} {'dtype':<9} {'count':>6} {'MiB/device':>11} "
             f"{'of it IB':>9}"]
    for r in rows:
        lines.append(f"{r['op']:<18} {r['axes']:<12} {r['dtype']:<9} {r['count']:>6g} "
                     f"{r['bytes_per_device'] / 2**20:>11.3f} "
                     f"{r.get('infiniband_bytes', 0.0) / 2**20:>9.3f}")
    return "\n".join(lines)
