"""HBM bytes of the kernels a GPU program runs besides its matmuls, per step.

The plan prices matmul FLOPs and link bytes; every other kernel — XLA's fusions (the
router's top-k, SwiGLU's elementwise parts, the MoE's gathers/scatters and `where`s,
norms, converts, transposes, gradient accumulation), copies, sorts — is bound by HBM
bandwidth and costs bytes, not FLOPs. This reads them from the *optimized* GPU HLO
(`compiled.as_text()` of a gpu_target compile), kernel by kernel:

- every launch of the program (hlo_program.py: each instruction of a computation that
  runs on the device, × its executions per step) that kernel_classes.py finds
  memory-bound is one kernel;
- its bytes are what it reads plus what it writes. A fusion's (or an async fusion's,
  `fusion-start`, whose result tuple holds its operands too) operand is read whole,
  except where the fused computation only slices or gathers it (then the slices'
  bytes) or updates it in place (a dynamic-update-slice or scatter into the operand
  that becomes the output: only the update is written, nothing read). That is the
  model XLA:GPU's own cost analysis uses; it is an estimate (caches, re-reads inside a
  kernel and partial writes are not seen), good to ±2×;
- matmuls (cuBLAS calls, library GEMM/attention kernels: tokamax's ragged dot and
  flash attention) and collectives are left out: their time is priced elsewhere
  (FLOPs, links). Host copies (copies and async slices to or from memory space 5) are
  NVLink-C2C traffic, also priced elsewhere.
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
import re
from typing import Callable

from europa_jax.plan.program import kernel_classes
from europa_jax.plan.program.hlo_program import ARRAY as _ARRAY  # noqa: F401 (tests read shapes)
from europa_jax.plan.program.hlo_program import Module as _Module, array_bytes as _array_bytes

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


def kernels(hlo: str | _Module, dynamic_trips: Callable[[str], float] | None = None
            ) -> list[KernelBytes]:
    """Every memory-bound kernel of an optimized GPU program (kernel_classes.py: not a
    GEMM, attention, collective or host copy), with its bytes.

    `dynamic_trips(loop op name)`: the expected trip count of a loop whose count is data
    (default 1: once per entry); its kernels stay marked `conditional`.
    """
    mod = hlo if isinstance(hlo, _Module) else _Module(hlo)
    return [kernel_bytes(mod, k.launch) for k in kernel_classes.kernels(mod, dynamic_trips)
            if k.kind == "memory_bound"]


def kernel_bytes(mod: _Module, launch) -> KernelBytes:
    """The bytes one memory-bound launch reads and writes (module docstring)."""
    opcode, rest, shape = launch.opcode, launch.rest, launch.shape
    operands = mod.operands(rest)
    if opcode in ("fusion", "fusion-start"):  # -start: an async fusion, its -done no kernel
        kind = re.search(r"kind=k(\w+)", rest)
        n_bytes = _fusion_bytes(mod, mod.called(rest), operands, shape)
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
    return KernelBytes(launch.name, label, launch.op_name, launch.loop, launch.conditional,
                       n_bytes, launch.runs)


# Parts of the step by jax op name: the first whose marker the name contains. Kernels
# XLA adds itself (layout copies, loop-state copies) carry no name: "unnamed".
REGIONS = (("moe", "/moe/"), ("attention", "/attention/"), ("dense MLP", "/mlp/"),
           ("MTP modules (norms, projection, their head)", "mtp_layers/"),
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
