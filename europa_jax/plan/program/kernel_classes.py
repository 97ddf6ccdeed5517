"""Every kernel of an optimized GPU program in exactly one class, with what prices it.

The step's time is not one efficiency times its FLOPs: its kernels are of kinds whose
speed is set by different things. A launch of the program (hlo_program.py) is
- `dense_gemm`: a cuBLAS call (or a fusion that wraps one): its shape from the operands
  and the dot dimensions, 2·batch·M·N·K FLOPs, the bytes of its operands and result
  (a skinny GEMM is bound by them, not by FLOPs), and the math it runs in (`gemm_math`:
  float32 operands run on TF32 tensor cores, or in plain FP32 at HIGHEST precision);
- `grouped_gemm`: a library grouped matmul (tokamax's ragged dot): rows W over G experts
  of one window, K × N each; 2·W·K·N FLOPs for the rows it holds (the caller says how
  full a window is expected to be);
- `attention_forward` / `attention_backward`: a library flash-attention kernel (tokamax's
  Mosaic GPU kernels, cuDNN's fused attention): its batch, sequence, heads and head dims.
  The pairs it runs depend on the documents of the batch, so its FLOPs are the plan's
  (attention_cost.py), not the call's;
- `host_copy`: a copy, or an async dynamic-(update-)slice, to or from pinned host memory:
  NVLink-C2C bytes, each way;
- `collective`: NCCL's (priced by link from its replica groups: hlo_report.py, links.py);
- `memory_bound`: everything else — XLA's fusions, copies, sorts, gathers, scatters —
  bound by HBM bandwidth: its bytes read and written (hbm_traffic.py).
A few custom calls launch no kernel (`NO_KERNEL_TARGETS`) and are no launch at all.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from typing import Callable

from europa_jax.plan.program import hlo_program
from europa_jax.plan.program.hlo_program import HOST_MEMORY, Launch, Module, array_bytes, array_dims

CLASSES = ("dense_gemm", "grouped_gemm", "attention_forward", "attention_backward",
           "memory_bound", "host_copy", "collective")
COLLECTIVE_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                  "ragged-all-to-all", "collective-permute", "collective-broadcast", "send",
                  "recv")
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas")
NO_KERNEL_TARGETS = ("AllocateBuffer",)
# A Pallas kernel's custom call names the kernel in its op_name: jax 0.12 lowers a Mosaic
# GPU kernel to `…/<kernel name>/mpmd_map` and a Triton one to `…/<kernel name>/pallas_call`
# (jax 0.10 carried tokamax's op class there instead). tokamax 0.0.17 names its sm90
# kernels — `ragged_dot_sm90`, `ragged_contracting_dim_dot_sm90` (the weight gradient),
# `flash_attention_sm90` — and its Triton ones (`pallas_flash_attention_fwd_res`,
# `pallas_flash_attention_vjp`), but leaves the sm90 flash backward's two (dq, dkv)
# unnamed (`anonymous`, or `batched_body` under a vmap), told apart by the attention scope
# (a name with `attention` in it) they run in. First match wins.
PALLAS_KERNEL = re.compile(r'op_name="([^"]*?)/(\w+)/(?:mpmd_map|pallas_call)"')
LIBRARY_KERNELS = {"ragged_dot": "grouped_gemm", "ragged_contracting_dim_dot": "grouped_gemm",
                   "pallas_flash_attention_vjp": "attention_backward",
                   "flash_attention": "attention_forward",
                   "pallas_flash_attention": "attention_forward"}
UNNAMED_ATTENTION_BACKWARD = "flash_attention_vjp"  # our name for tokamax's unnamed ones
# tokamax's Triton grouped matmul (through jax_triton: `triton_kernel_call`) is named only in
# the tokamax payload its call keeps in the metadata.
TOKAMAX_PAYLOAD = re.compile(r"tokamax\._src\.ops\.(\w+)\.[\w.]+\.(\w+)")
FLOAT_DTYPES = ("bf16", "f16", "f32", "f8e4m3fn", "f8e5m2")


@dataclasses.dataclass(frozen=True)
class Kernel:
    launch: Launch
    kind: str  # one of CLASSES
    flops_per_run: float  # matmul FLOPs (GEMMs; 0 for attention: the plan's pairs price it)
    bytes_per_run: float  # GEMM operands + result; host copies: bytes over C2C
    dims: tuple[int, ...] = ()  # dense (batch, M, N, K); grouped (W, G, K, N);
    #                             attention (batch, seq, heads, d_qk, d_v)
    to_host: bool = False  # host copies: the direction
    math: str = ""  # dense GEMMs: bf16, tf32, fp32 or fp8 (gemm_math)

    @property
    def runs(self) -> float:
        return self.launch.runs


def _target(line: str) -> str:
    found = re.search(r'custom_call_target="([^"]+)"', line)
    return found.group(1) if found else ""


def _inner_gemm(mod: Module, launch: Launch):
    """The cuBLAS call of a launch: itself, or the one a fusion wraps (XLA's dynamic-slice
    fusions address a GEMM's operands in place), as (shape, rest, line); else None."""
    if launch.opcode == "custom-call":
        return (launch.shape, launch.rest, launch.line) if _target(
            launch.line).startswith(GEMM_TARGETS) else None
    if launch.opcode == "fusion":
        for _, shape, opcode, rest, line in mod.parsed.get(mod.called(launch.rest) or "", []):
            if opcode == "custom-call" and _target(line).startswith(GEMM_TARGETS):
                return shape, rest, line
    return None


def gemm_dims(mod: Module, shape: str, rest: str, line: str) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a cuBLAS call from its operands and dot dimension numbers (a
    plain [M, K] × [K, N] product where the call states none)."""
    lhs = array_dims(mod.shape[mod.operands(rest)[0]])[0][1]
    stated = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', line)
    numbers = json.loads(stated.group(1)) if stated else {
        "lhs_contracting_dimensions": [len(lhs) - 1], "lhs_batch_dimensions": []}
    out = array_dims(first_array(shape))[0][1]
    k = math.prod(lhs[int(d)] for d in numbers["lhs_contracting_dimensions"])
    batch = math.prod(lhs[int(d)] for d in numbers["lhs_batch_dimensions"])
    m = math.prod(lhs) // (batch * k)
    return batch, m, math.prod(out) // (batch * m), k


def gemm_math(operand_shapes: list[str], line: str) -> str:
    """The arithmetic a GEMM runs in: float32 operands on TF32 tensor cores at the default
    precision (jax's default on GPU) or in plain FP32 when the call asks for HIGHEST (or
    an F32 dot algorithm); FP8 operands in FP8; else BF16 (hardware.py [tf32])."""
    dtypes = {dt for shape in operand_shapes for dt, _ in array_dims(first_array(shape))}
    if "f32" in dtypes:
        precision = re.search(r'"operand_precision":\[([^\]]*)\]', line)
        exact = ((precision and "HIGHEST" in precision.group(1))
                 or "ALG_DOT_F32_F32_F32" in line)
        return "fp32" if exact else "tf32"
    if dtypes & {"f8e4m3fn", "f8e5m2"}:
        return "fp8"
    return "bf16"


def dot_dims(mod: Module, launch: Launch) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of an HLO `dot` from its lhs and its contracting/batch dims."""
    lhs = array_dims(mod.shape[mod.operands(launch.rest)[0]])[0][1]

    def dims(key: str) -> list[int]:
        found = re.search(rf"{key}=\{{([0-9,]*)\}}", launch.line)
        return [int(d) for d in found.group(1).split(",") if d] if found else []

    k = math.prod(lhs[d] for d in dims("lhs_contracting_dims"))
    batch = math.prod(lhs[d] for d in dims("lhs_batch_dims"))
    m = math.prod(lhs) // (batch * k)
    out = math.prod(array_dims(launch.shape)[0][1])
    return batch, m, out // (batch * m), k


def first_array(shape: str) -> str:
    """The first array of a (possibly tuple) result shape: a GEMM's output before its
    workspace, a copy-start's destination."""
    items = hlo_program.ARRAY.search(shape)
    return items.group(0) if items else shape


def grouped_dims(mod: Module, launch: Launch) -> tuple[int, int, int, int]:
    """(W, G, K, N) of a grouped matmul: the [G, K, N] matrices (an operand, or the
    weight-gradient output) and the two 2-D row arrays that share the W ragged rows
    ([W, K] and [W, N], either may be transposed): W² = their sizes' product / (K·N)."""
    arrays = [d for dt, d in array_dims(launch.shape) if dt in FLOAT_DTYPES]
    arrays += [d for o in mod.operands(launch.rest)
               for dt, d in array_dims(mod.shape.get(o, "")) if dt in FLOAT_DTYPES]
    stacked = next(d for d in arrays if len(d) == 3)
    rows = [d for d in arrays if len(d) == 2][:2]
    g, kn = stacked[0], stacked[1] * stacked[2]
    w = round(math.sqrt(math.prod(rows[0]) * math.prod(rows[1]) / kn))
    return w, g, stacked[1], stacked[2]


def attention_dims(launch: Launch) -> tuple[int, int, int, int, int]:
    """(batch, seq, heads, d_qk, d_v) of a flash-attention call: q [B, S, H, K] and v
    [B, S, H, O] (B squeezed when 1), read from its operand layouts (the first and third
    operands)."""
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", launch.line)
    arrays = [d for dt, d in array_dims(layouts.group(1)) if dt in FLOAT_DTYPES] if layouts else []
    if len(arrays) < 3 or len(arrays[0]) not in (3, 4):
        return ()
    (b, s, h, k), v = [1] * (4 - len(arrays[0])) + arrays[0], arrays[2]
    return b, s, h, k, v[-1]


def library_kernel(line: str) -> tuple[str, str] | None:
    """(class, kernel name) of a custom call that is a library kernel (tokamax's Pallas and
    jax_triton kernels, cuDNN's fused attention); None for any other line. A Pallas kernel in an
    attention scope that is not the forward is the backward (tokamax leaves it unnamed)."""
    pallas = PALLAS_KERNEL.search(line)
    if pallas:
        scope, name = pallas.groups()
        for prefix, kind in LIBRARY_KERNELS.items():
            if name.startswith(prefix):
                return kind, name
        if "attention" in scope:
            return "attention_backward", UNNAMED_ATTENTION_BACKWARD
        return None
    target = _target(line)
    payload = TOKAMAX_PAYLOAD.search(line) if target.startswith("triton_kernel_call") else None
    if payload:
        op, name = payload.groups()
        if op == "ragged_dot":
            return "grouped_gemm", name
        if op == "attention":
            return ("attention_backward" if "Vjp" in name else "attention_forward"), name
    if target.startswith("__cudnn$fmha"):
        return ("attention_backward" if "Backward" in target else "attention_forward"), target
    return None


def _through_copies(mod: Module, comp: str):
    """A fused computation's root, looking through copies and views of one operand (an
    async slice's computation ends in a layout copy of the slice)."""
    rows = {r[0]: r for r in mod.parsed.get(comp, [])}
    row = mod.root(comp)
    while row and row[2] in ("copy", "bitcast", "reshape"):
        args = mod.operands(row[3])
        row = rows.get(args[0]) if args else None
    return row


def _host_copy(mod: Module, launch: Launch) -> tuple[float, bool] | None:
    """(bytes over C2C, whether towards the host) of a launch that moves data between
    HBM and pinned host memory; None for one that does not."""
    operands = [mod.shape.get(o, "") for o in mod.operands(launch.rest)]
    result_host = HOST_MEMORY in launch.shape
    if not result_host and not any(HOST_MEMORY in s for s in operands):
        return None
    if launch.opcode in ("copy-start", "copy"):
        # copy-start returns (destination, source, context): the destination says the way
        first = first_array(launch.shape)
        return float(hlo_program.array_bytes(first, device_only=False)), HOST_MEMORY in first
    root = _through_copies(mod, mod.called(launch.rest) or "")
    if root and root[2] == "dynamic-update-slice":  # a slice written into a buffer
        update = mod.operands(root[3])[1]
        return (float(hlo_program.array_bytes(mod.shape.get(update, ""), device_only=False)),
                HOST_MEMORY in root[1] or HOST_MEMORY in first_array(launch.shape))
    if root and root[2] in ("dynamic-slice", "slice"):  # a slice read from a buffer
        return float(hlo_program.array_bytes(root[1], device_only=False)), False
    moved = hlo_program.host_bytes(launch.shape) + sum(map(hlo_program.host_bytes, operands))
    return float(moved), result_host


def classify(mod: Module, launch: Launch) -> Kernel | None:
    """The class of one launch, with its FLOPs, bytes and shape (None: no kernel)."""
    opcode, line = launch.opcode, launch.line
    base = opcode.removesuffix("-start")
    if base in COLLECTIVE_OPS:
        return Kernel(launch, "collective", 0.0, 0.0)
    if opcode == "custom-call" and _target(line) in NO_KERNEL_TARGETS:
        return None
    gemm = _inner_gemm(mod, launch)
    if gemm:
        batch, m, n, k = gemm_dims(mod, *gemm)
        operands = [mod.shape.get(o, "") for o in mod.operands(gemm[1])[:2]]
        moved = sum(map(array_bytes, operands)) + array_bytes(first_array(gemm[0]))
        return Kernel(launch, "dense_gemm", 2.0 * batch * m * n * k, float(moved),
                      (batch, m, n, k), math=gemm_math(operands, gemm[2]))
    if opcode == "dot":  # a dot XLA left to itself (not seen with cuBLAS GEMMs on)
        batch, m, n, k = dot_dims(mod, launch)
        return Kernel(launch, "dense_gemm", 2.0 * batch * m * n * k, 0.0, (batch, m, n, k))
    library = library_kernel(line) if opcode == "custom-call" else None
    if library and library[0] == "grouped_gemm":
        w, g, k, n = grouped_dims(mod, launch)
        moved = array_bytes(launch.shape) + sum(
            array_bytes(mod.shape.get(o, "")) for o in mod.operands(launch.rest))
        return Kernel(launch, "grouped_gemm", 2.0 * w * k * n, float(moved), (w, g, k, n))
    if library:
        return Kernel(launch, library[0], 0.0, 0.0, attention_dims(launch))
    moved = _host_copy(mod, launch)
    if moved is not None:
        return Kernel(launch, "host_copy", 0.0, moved[0], to_host=moved[1])
    return Kernel(launch, "memory_bound", 0.0, 0.0)


def kernels(hlo: str | Module, dynamic_trips: Callable[[str], float] | None = None
            ) -> list[Kernel]:
    """Every launch of an optimized GPU program, classified (module docstring)."""
    mod = hlo if isinstance(hlo, Module) else Module(hlo)
    return [k for k in (classify(mod, launch) for launch in hlo_program.launches(
        mod, dynamic_trips)) if k is not None]


def summary(found: list[Kernel], grouped_fill: float = 1.0,
            window_experts: int | None = None) -> dict:
    """Per class: launches, runs per step, FLOPs and bytes; GEMMs by shape (largest FLOPs
    first), grouped matmuls by window (`grouped_fill`: the share of a window's rows
    routing is expected to fill; `window_experts`: the experts one window's rows reach at
    most — a window's matmul may be handed the layer's whole stack of matrices, the other
    groups' experts empty), attention calls by shape, host copies by direction. Kernels
    in data-dependent loops and branches count at their expected runs."""
    out = {kind: {"launches": 0, "runs": 0.0, "flops": 0.0, "bytes": 0.0} for kind in CLASSES}
    dense, grouped = (collections.defaultdict(lambda: [0.0, 0.0]) for _ in range(2))
    attention = collections.defaultdict(float)
    to_host = to_device = 0.0
    for k in found:
        row = out[k.kind]
        fill = grouped_fill if k.kind == "grouped_gemm" else 1.0
        row["launches"] += 1
        row["runs"] += k.runs
        row["flops"] += k.flops_per_run * k.runs * fill
        row["bytes"] += k.bytes_per_run * k.runs
        if k.kind in ("dense_gemm", "grouped_gemm"):
            key = (k.dims, k.math) if k.kind == "dense_gemm" else k.dims
            runs_bytes = (dense if k.kind == "dense_gemm" else grouped)[key]
            runs_bytes[0] += k.runs
            runs_bytes[1] += k.bytes_per_run * k.runs
        elif k.kind.startswith("attention"):
            attention[(k.kind, k.dims)] += k.runs
        elif k.kind == "host_copy":
            to_host += k.bytes_per_run * k.runs if k.to_host else 0.0
            to_device += 0.0 if k.to_host else k.bytes_per_run * k.runs
    out["dense_gemm"]["shapes"] = sorted(
        ({"batch": b, "m": m, "n": n, "k": kk, "math": math or "bf16", "runs": runs,
          "bytes": moved, "flops": 2.0 * b * m * n * kk * runs}
         for ((b, m, n, kk), math), (runs, moved) in dense.items() if runs),
        key=lambda r: -r["flops"])
    reached = lambda g: min(g, window_experts or g)
    out["grouped_gemm"]["windows"] = sorted(
        ({"rows": w, "experts": reached(g), "k": kk, "n": n, "runs": runs, "bytes": moved,
          "fill": grouped_fill, "rows_per_expert": w * grouped_fill / reached(g),
          "flops": 2.0 * w * kk * n * runs * grouped_fill}
         for (w, g, kk, n), (runs, moved) in grouped.items() if runs),
        key=lambda r: -r["flops"])
    for (kind, dims), runs in attention.items():
        out[kind].setdefault("calls", []).append({"dims": list(dims), "runs": runs})
    out["host_copy"].update(to_host_bytes=to_host, to_device_bytes=to_device)
    return out


def trimmed(summary_: dict, top: int = 8) -> dict:
    """The summary for a report: the `top` largest GEMM shapes and windows only."""
    out = {kind: dict(row) for kind, row in summary_.items()}
    for kind, key in (("dense_gemm", "shapes"), ("grouped_gemm", "windows")):
        out[kind][f"{key}_count"] = len(out[kind][key])
        out[kind][key] = out[kind][key][:top]
    return out
