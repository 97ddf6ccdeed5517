"""An optimized GPU program (`compiled.as_text()` of a gpu_target compile) as the kernels
it launches per step.

Every instruction of a computation that runs on the device — the entry, loop bodies and
conditions, conditional branches, called and async computations; not the computations
fused into a kernel — is one launch, × its executions per step (loop trip counts). What
launches nothing (tuples, parameters, bitcasts, control flow itself, the `-done` half of
an async pair) is left out. Each launch keeps its innermost enclosing loop (the `while`
op's jax name) and whether it sits in a conditional branch or in a loop whose trip count
is data (jax's `fori_loop`/`while_loop` with a traced bound: MoE overflow rounds and
windows, the attention backward's chunk pairs) — counted at the trips the caller expects
(`dynamic_trips`; once per entry by default) and marked `conditional`.

hbm_traffic.py prices the memory-bound launches' bytes, kernel_classes.py sorts every
launch into one class.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Iterator

from europa_jax.plan.program.hlo_report import DTYPE_BYTES, _computations, _dims, _trip_count

# Opcodes that launch no kernel of their own.
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
             "conditional", "call", "after-all", "partition-id", "replica-id",
             "opt-barrier", "add-dependency", "domain", "get-dimension-size"}
HOST_MEMORY = ":S(5)"  # GPU layouts mark pinned host buffers with memory space 5
ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")


def array_bytes(text: str, device_only: bool = True) -> int:
    """Bytes of the arrays in an HLO shape string (host-memory arrays left out)."""
    total = 0
    for dtype, dims, layout in ARRAY.findall(text):
        if dtype not in DTYPE_BYTES or (device_only and layout and HOST_MEMORY in layout):
            continue
        total += DTYPE_BYTES[dtype] * math.prod(_dims(dims) or [1])
    return total


def host_bytes(text: str) -> int:
    """Bytes of the arrays of an HLO shape string that live in host memory."""
    return sum(DTYPE_BYTES[dtype] * math.prod(_dims(dims) or [1])
               for dtype, dims, layout in ARRAY.findall(text)
               if dtype in DTYPE_BYTES and layout and HOST_MEMORY in layout)


def array_dims(text: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of every array of an HLO shape string, in order."""
    return [(dtype, _dims(dims)) for dtype, dims, _ in ARRAY.findall(text)
            if dtype in DTYPE_BYTES]


class Module:
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

    def root(self, comp: str):
        """A computation's ROOT instruction as (name, shape, opcode, rest, line)."""
        rows = self.parsed.get(comp, [])
        return next((r for r in rows if r[4].lstrip().startswith("ROOT")),
                    rows[-1] if rows else None)

    def called(self, rest: str) -> str | None:
        """The computation a fusion (or a fusion-start) runs."""
        found = re.search(r"calls=([\w.\-]+)", rest)
        return found.group(1) if found else None


@dataclasses.dataclass(frozen=True)
class Launch:
    """One instruction that runs as a kernel (or a library call, a copy, a collective)."""

    name: str  # the HLO instruction
    opcode: str
    shape: str  # its result shape, as printed
    rest: str  # the text after its opcode's parenthesis: operands and attributes
    line: str
    op_name: str  # jax's name of the op (metadata)
    loop: str  # the jax name of the innermost enclosing while loop ('' if none)
    conditional: bool  # in a conditional branch or a loop with a data trip count
    runs: float  # executions per step (expected, for a loop whose trip count is data)


def launches(mod: Module, dynamic_trips: Callable[[str], float] | None = None
             ) -> Iterator[Launch]:
    """Every launch of the program reachable from its entry (module docstring)."""

    def visit(comp: str, times: float, loop: str, conditional: bool, depth: int = 0):
        if depth > 64:
            return
        for name, shape, opcode, rest, line in mod.parsed.get(comp, []):
            op_name = re.search(r'op_name="([^"]*)"', line)
            op_name = op_name.group(1) if op_name else ""
            if opcode == "while":
                cond, body = re.search(r"condition=([\w.\-]+), body=([\w.\-]+)", rest).groups()
                trips = _trip_count(line, mod.comps)
                dynamic = trips is None
                if dynamic:
                    trips = dynamic_trips(op_name) if dynamic_trips else 1
                yield from visit(cond, times * (trips + 1), op_name, conditional or dynamic,
                                 depth + 1)
                yield from visit(body, times * trips, op_name, conditional or dynamic,
                                 depth + 1)
                continue
            if opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = ([b.strip() for b in branches.group(1).split(",")] if branches else
                         re.findall(r"(?:true|false)_computation=([\w.\-]+)", rest))
                for branch in names:
                    yield from visit(branch, times, loop, True, depth + 1)
                continue
            if opcode in ("call", "async-start") or (opcode == "custom-call"
                                                      and "called_computations" in rest):
                for callee in re.findall(r"(?:to_apply|calls)=([\w.\-]+)", rest):
                    yield from visit(callee, times, loop, conditional, depth + 1)
                if opcode != "custom-call":
                    continue
            if opcode in NO_KERNEL or opcode.endswith("-done") or opcode == "async-update":
                continue
            yield Launch(name, opcode, shape, rest, line, op_name, loop, conditional, times)

    yield from visit(mod.entry, 1, "", False)
