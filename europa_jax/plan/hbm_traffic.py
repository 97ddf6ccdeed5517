"""HBM bytes of the kernels a GPU program runs besides its matmuls, per step.

The plan prices matmul FLOPs and link bytes; every other kernel — XLA's fusions (the
router's top-k, SwiGLU's elementwise parts, the MoE's gathers/scatters and `where`s,
norms, converts, transposes, gradient accumulation), copies, sorts — is bound by HBM
bandwidth and costs bytes, not FLOPs. This reads them from the *optimized* GPU HLO
(`compiled.as_text()` of a gpu_target compile), kernel by kernel:

- every instruction of a computation that runs on the device as a kernel — the entry,
  loop bodies, conditional branches, called computations; not the computations fused
  into a kernel — is one launch, × its executions per step (loop trip counts);
- its bytes are what it reads plus what it writes. A fusion's operand is read whole,
  except where the fused computation only slices or gathers it (then the slices'
  bytes) or updates it in place (a dynamic-update-slice or scatter into the operand
  that becomes the output: only the update is written, nothing read). That is the
  model XLA:GPU's own cost analysis uses; it is an estimate (caches, re-reads inside a
  kernel and partial writes are not seen), good to ±2×;
- matmuls (cuBLAS calls, library GEMM/attention kernels: tokamax's ragged dot and
  flash attention) and collectives are left out: their time is priced elsewhere
  (FLOPs, links). Host copies (`copy-start` to memory space 5) are NVLink-C2C traffic,
  also priced elsewhere.
- a kernel inside a conditional branch or a loop whose trip count is data (jax's
  `fori_loop`/`while_loop` with a traced bound: MoE overflow rounds and windows, the
  attention backward's chunk pairs) is counted apart (`conditional`), at the trip count
  the caller expects (`dynamic_trips`; once per entry by default).

Each kernel is attributed to its innermost enclosing loop (the `while` op's jax name) and
to a part of the model from its jax op name (`region`), so the report can say which loop
moves what: e.g. the MoE chunk loops (`moe_loop_bytes`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Callable

from europa_jax.plan.hlo_report import DTYPE_BYTES, _computations, _dims, _top_level_items

# Opcodes that launch no kernel of their own, or are priced elsewhere.
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
             "conditional", "call", "after-all", "partition-id", "replica-id",
             "opt-barrier", "add-dependency", "domain", "get-dimension-size"}
COLLECTIVE_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                  "ragged-all-to-all", "collective-permute", "collective-broadcast", "send",
                  "recv")
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$", "__cublas")
# Library kernels that are matmuls (tokamax's ops name themselves in the metadata).
LIBRARY_MATMUL = re.compile(r"tokamax\._src\.ops\.(ragged_dot|attention)")
HOST_MEMORY = ":S(5)"
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
# Ops a fused parameter may feed that read only part of it.
_PARTIAL_READS = ("dynamic-slice", "slice", "gather")
_IN_PLACE = ("dynamic-update-slice", "scatter")
_VIEWS = ("bitcast", "reshape")  # no bytes of their own inside a fusion


@dataclasses.dataclass(frozen=True)
class KernelBytes:
    name: str  # the HLO instruction
    opcode: str  # fusion kind (loop, input, custom …) or the opcode
    op_name: str  # jax's name of the op (metadata)
    loop: str  # the jax name of the innermost enclosing while loop ('' if none)
    conditional: bool  # inside a conditional branch (may not run)
    bytes_per_run: float
    runs: float  # executions per step (expected, for a loop whose trip count is data)

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_run * self.runs


def _array_bytes(text: str, device_only: bool = True) -> int:
    """Bytes of the arrays in an HLO shape string (host-memory arrays left out)."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype not in DTYPE_BYTES or (device_only and layout and HOST_MEMORY in layout):
            continue
        total += DTYPE_BYTES[dtype] * math.prod(_dims(dims) or [1])
    return total


class _Module:
    """Name → result shape for every instruction, and each computation's lines parsed."""

    def __init__(self, hlo: str):
        self.comps, self.entry = _computations(hlo)
        self.shape: dict[str, str] = {}
        self.parsed: dict[str, list[tuple[str, str, str, str, str]]] = {}
        for comp, lines in self.comps.items():
            rows = []
            for line in lines:
                m = _LINE.match(line)
                if not m:
                    continue
                name, shape, opcode, rest = m.groups()
                self.shape[name] = shape
                rows.append((name, shape, opcode, rest, line))
            self.parsed[comp] = rows

    def operands(self, rest: str) -> list[str]:
        """An instruction's operand names, in order (`rest`: the text after its opcode's
        opening parenthesis)."""
        depth, out, cur = 0, [], ""
        for ch in rest:
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:
                    break
                depth -= 1
            if ch == "," and depth == 0:
                out.append(cur)
                cur = ""
            else:
                cur += ch
        out.append(cur)
        # in order, every one (a name defined nowhere counts 0 bytes): positions matter
        out = [re.sub(r"/\*.*?\*/", "", o).strip() for o in out]  # /*index=5*/ markers
        return [o.split()[-1] for o in out if o]


def _fusion_bytes(mod: _Module, fused: str, operands: list[str], out_shape: str) -> float:
    """Bytes one launch of a fusion reads and writes (module docstring)."""
    rows = mod.parsed.get(fused, [])
    param_of = {}  # fused parameter name → operand index
    users = collections.defaultdict(list)  # name → [(opcode, operand position, user)]
    root = rows[-1] if rows else None
    alias = {}  # a bitcast/reshape of a parameter reads what the parameter does
    for name, shape, opcode, rest, line in rows:
        if opcode == "parameter":
            param_of[name] = int(re.match(r"(\d+)", rest).group(1))
        args = mod.operands(rest)
        if opcode in _VIEWS and args:
            alias[name] = alias.get(args[0], args[0])
            continue
        for pos, arg in enumerate(args):
            users[alias.get(arg, arg)].append((opcode, pos, name))
        if line.lstrip().startswith("ROOT"):
            root = (name, shape, opcode, rest, line)
    roots = [root] if root else []
    if root and root[2] == "tuple":
        by_name = {r[0]: r for r in rows}
        roots = [by_name[a] for a in mod.operands(root[3]) if a in by_name]
    in_place, written = set(), 0.0
    for name, shape, opcode, rest, _ in roots:
        args = mod.operands(rest)
        if opcode in _IN_PLACE and args:
            in_place.add(alias.get(args[0], args[0]))  # updated in place: not read, not rewritten
            update = args[1] if opcode == "dynamic-update-slice" else args[-1]
            written += _array_bytes(mod.shape.get(update, ""))
        else:
            written += _array_bytes(shape)
    read = 0.0
    for param, index in param_of.items():
        if param in in_place or index >= len(operands):
            continue
        uses = users.get(param, [])
        if uses and all(op in _PARTIAL_READS and pos == 0 for op, pos, _ in uses):
            read += sum(_array_bytes(mod.shape.get(user, "")) for _, _, user in uses)
        else:
            read += _array_bytes(mod.shape.get(operands[index], ""))
    return read + written


def _is_matmul(mod: _Module, opcode: str, rest: str, line: str) -> bool:
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line)
        return bool((target and target.group(1).startswith(GEMM_TARGETS))
                    or LIBRARY_MATMUL.search(line))
    if opcode == "fusion":  # a fusion wrapping a GEMM (dynamic-slice address fusions)
        called = re.search(r"calls=([\w.\-]+)", rest)
        return bool(called) and any(
            _is_matmul(mod, op, r, ln) for _, _, op, r, ln in mod.parsed.get(called.group(1), [])
            if op in ("custom-call", "fusion"))
    return opcode in ("dot", "convolution")


def _is_priced_elsewhere(opcode: str, shape: str) -> bool:
    base = opcode.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVE_OPS or opcode.endswith("-done") or opcode in ("async-start",
                                                                         "async-update"):
        return True
    # host offload: copies to or from pinned host memory ride NVLink-C2C
    return opcode in ("copy-start", "copy-done") or (opcode == "copy" and HOST_MEMORY in shape)


def kernels(hlo: str, dynamic_trips: Callable[[str], float] | None = None
            ) -> list[KernelBytes]:
    """Every non-matmul device kernel of an optimized GPU program, with its bytes.

    `dynamic_trips(loop op name)`: the expected trip count of a loop whose count is data
    (default 1: once per entry); its kernels stay marked `conditional`.
    """
    mod = _Module(hlo)
    found: list[KernelBytes] = []

    def visit(comp: str, times: int, loop: str, conditional: bool, depth: int = 0):
        if depth > 64:
            return
        for name, shape, opcode, rest, line in mod.parsed.get(comp, []):
            op_name = re.search(r'op_name="([^"]*)"', line)
            op_name = op_name.group(1) if op_name else ""
            if opcode == "while":
                cond, body = re.search(r"condition=([\w.\-]+), body=([\w.\-]+)", rest).groups()
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                # a loop whose trip count is data (overflow rounds and windows): counted
                # once per entry, apart, as what may run
                dynamic = trips is None
                trips = (int(trips.group(1)) if trips else
                         dynamic_trips(op_name) if dynamic_trips else 1)
                visit(cond, times * (trips + 1), op_name, conditional or dynamic, depth + 1)
                visit(body, times * trips, op_name, conditional or dynamic, depth + 1)
                continue
            if opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = ([b.strip() for b in branches.group(1).split(",")] if branches else
                         re.findall(r"(?:true|false)_computation=([\w.\-]+)", rest))
                for branch in names:
                    visit(branch, times, loop, True, depth + 1)
                continue
            if opcode in ("call", "async-start") or (opcode == "custom-call"
                                                      and "called_computations" in rest):
                for callee in re.findall(r"(?:to_apply|calls)=([\w.\-]+)", rest):
                    visit(callee, times, loop, conditional, depth + 1)
                if opcode != "custom-call":
                    continue
            if (opcode in NO_KERNEL or _is_priced_elsewhere(opcode, shape)
                    or _is_matmul(mod, opcode, rest, line)):
                continue
            operands = mod.operands(rest)
            if opcode == "fusion":
                called = re.search(r"calls=([\w.\-]+)", rest).group(1)
                kind = re.search(r"kind=k(\w+)", rest)
                n_bytes = _fusion_bytes(mod, called, operands, shape)
                label = f"fusion:{kind.group(1).lower() if kind else '?'}"
            elif opcode in ("dynamic-slice", "slice", "gather"):
                n_bytes, label = 2 * _array_bytes(shape), opcode
            elif opcode in _IN_PLACE and operands:
                update = operands[1] if opcode == "dynamic-update-slice" else operands[-1]
                n_bytes, label = 2 * _array_bytes(mod.shape.get(update, "")), opcode
            else:
                n_bytes = _array_bytes(shape) + sum(_array_bytes(mod.shape.get(o, ""))
                                                    for o in operands)
                label = opcode
            found.append(KernelBytes(name, label, op_name, loop, conditional, n_bytes, times))

    visit(mod.entry, 1, "", False)
    return found


# Parts of the step by jax op name: the first whose marker the name contains. Kernels
# XLA adds itself (layout copies, loop-state copies) carry no name: "unnamed".
REGIONS = (("moe", "/moe/"), ("attention", "/attention/"), ("dense MLP", "/mlp/"),
           ("layers (norms, residuals)", "_stack/"), ("loss and LM head", "shard_map/"),
           ("optimizer update", "jit("))


def region(op_name: str) -> str:
    if not op_name:
        return "unnamed"
    return next((name for name, marker in REGIONS if marker in op_name), "other")


def is_moe_loop(loop: str) -> bool:
    """A loop of the MoE layer (expert groups and windows, exchange rounds, token chunks)."""
    return "/moe/" in loop


def summary(found: list[KernelBytes], top: int = 8) -> dict:
    """Per-step bytes: all, by part of the model (`region`), in the MoE layer's loops, and
    the largest kernels; `data_dependent` is what may run (conditional branches, loops
    with run-time trip counts: counted once per entry) on top."""
    sure = [k for k in found if not k.conditional]
    by_region: dict[str, float] = collections.Counter()
    maybe: dict[str, float] = collections.Counter()
    for k in found:
        (maybe if k.conditional else by_region)[region(k.op_name)] += k.bytes_per_step
    largest = sorted(sure, key=lambda k: -k.bytes_per_step)[:top]
    return {
        "bytes_per_step": sum(k.bytes_per_step for k in sure),
        "data_dependent_bytes_per_step": sum(maybe.values()),
        "by_region": dict(sorted(by_region.items(), key=lambda kv: -kv[1])),
        "data_dependent_by_region": dict(sorted(maybe.items(), key=lambda kv: -kv[1])),
        "moe_loop_bytes_per_step": sum(k.bytes_per_step for k in sure if is_moe_loop(k.loop)),
        "largest": [{"kernel": k.name, "kind": k.opcode, "source": k.op_name,
                     "bytes_per_run": k.bytes_per_run, "runs": k.runs,
                     "bytes_per_step": k.bytes_per_step} for k in largest],
    }


def priced_bytes(s: dict) -> float:
    """What the estimate charges to HBM bandwidth: every kernel, data-dependent ones at
    their expected trips, but the optimizer update's (priced from the state's bytes)."""
    return (s["bytes_per_step"] + s["data_dependent_bytes_per_step"]
            - s["by_region"].get("optimizer update", 0.0)
            - s["data_dependent_by_region"].get("optimizer update", 0.0))
