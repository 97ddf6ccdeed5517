"""A step's time per class of kernel, and the step as a range.

What a GPU does in a step (`StepWork`) is read off the GPU program (kernel_classes.py,
hbm_traffic.py, the collectives by link) and the attention the slowest GPU runs
(attention_cost.py); each class is priced at its own efficiency (hardware.py), at the low,
expected and high end of its range:
- dense GEMMs, shape by shape: max(FLOPs / (peak · efficiency at the GEMM's smallest
  dimension), bytes / (HBM bandwidth · memory efficiency)) — a skinny GEMM is bound by
  its operands;
- grouped GEMMs, window by window: the same, at the efficiency of its rows per expert;
- dense GEMMs in float32 at the TF32 peak (half BF16's), or the FP32 one at HIGHEST
  precision (kernel_classes.gemm_math);
- flash attention forward and backward: the pairs the kernels run (masked ones included)
  × FLOPs per pair: forward 2·(d_qk + d_v) per head, backward its five matmuls,
  2·(3·d_qk + 2·d_v) — FlashAttention's 2.5 × forward at equal head dims, 2.6 × at MLA's
  192/128 (`backward_per_forward`);
- memory-bound kernels (XLA's fusions, copies, sorts): their HBM bytes; the optimizer
  update: the state it reads and writes;
- host copies: the larger direction over NVLink-C2C (both directions run at once);
- collectives: NVLink and InfiniBand bytes over their bandwidths.

The overlap model: the GEMMs, attention, memory-bound kernels and the update share the
SMs and run one after another (the compute stream, C). Collectives run on their own
streams beside it, but NCCL's kernels hold SMs while they run (NCCL_MAX_CTAS): compute
keeps `overlap_compute` of its speed for as long as the busier link L = max(NVLink,
InfiniBand) is busy, so the stream takes C/keep if it ends first, else C + L·(1 − keep).
Host copies run on the copy engines. step = max(compute stream, L, C2C) + the serial
phases. `serial` adds everything up: the bound if nothing overlapped.

What the overlap model leaves out, each a named line (`CHAIN`, `SERIAL`; the GPU
program's phases and counts, critical_path.py):
- on the compute stream's chain: the kernel launches (a gap each, hardware.launch_gap),
  the host round trip of every trip of a loop whose trip count is data
  (hardware.loop_trip_sync), and the in-layer exchanges whose results the next kernels
  need (the MoE's dispatch and combine, context parallelism's exchanges), at their
  link's speed;
- serial, beside nothing: the optimizer update's collectives (Muon's re-layout) and the
  step's first weight gathers and last gradient reduce-scatters, at the slower of their
  links; their bytes leave the overlapped links' total.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from europa_jax.plan.price.hardware import CASES, Hardware

OVERLAP_MODEL = ("step = max(compute stream, busier link, host copies): GEMMs, attention, "
                 "memory-bound kernels and the update run one after another; collectives "
                 "overlap them on their own streams, compute keeping `overlap_compute` of its "
                 "speed while NCCL holds SMs; host copies run on the copy engines")
COMPUTE = ("dense_gemm", "grouped_gemm", "attention_forward", "attention_backward",
           "memory_bound", "optimizer_update")
LINKS = ("nvlink", "infiniband")
CLASSES = COMPUTE + ("host_copy",) + LINKS
CHAIN = ("kernel_launches", "loop_trip_syncs", "in_layer_exchange")
SERIAL = ("update_exchange", "fill_drain")
LINES = CHAIN + SERIAL
# the lines priced from (NVLink, InfiniBand) bytes: StepWork's `<name>_bytes`
PRICED_EXCHANGES = ("in_layer_exchange", "update_exchange", "fill_drain")
FLASH_BACKWARD_PER_FORWARD = 2.5  # FlashAttention's convention: equal head dims


def backward_per_forward(d_qk: int, d_v: int) -> float:
    """Attention backward FLOPs over forward ones per pair: S = QKᵀ again (d_qk), dV = PᵀdO
    (d_v), dP = dO·Vᵀ (d_v), dQ = dS·K and dK = dSᵀQ (d_qk each) over the forward's QKᵀ
    and PV: (3·d_qk + 2·d_v) / (d_qk + d_v) — 2.5 at equal dims (FlashAttention's
    convention), 2.6 at MLA's 192/128."""
    return (3.0 * d_qk + 2.0 * d_v) / (d_qk + d_v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepWork:
    """What one GPU does in one step, before any efficiency."""

    # (shape, smallest dim, FLOPs, bytes[, math]) per GEMM shape (math: kernel_classes.
    # gemm_math, BF16 if absent); (window, rows per expert, FLOPs, bytes) per grouped window
    dense_gemms: tuple[tuple, ...]
    grouped_gemms: tuple[tuple[str, float, float, float], ...]
    attention_forward_flops: float
    attention_backward_flops: float
    memory_bytes: float  # memory-bound kernels' HBM bytes
    update_bytes: float  # the optimizer update's
    to_host_bytes: float
    to_device_bytes: float
    nvlink_bytes: float
    nvlink_peers: int
    infiniband_bytes: float
    attention_backward_ratio: float = FLASH_BACKWARD_PER_FORWARD  # backward_per_forward
    # critical_path.py: kernel launches and data-dependent loop trips per step; the
    # (NVLink, InfiniBand) bytes of the in-layer exchanges, the update's collectives and
    # the first gathers + last reduce-scatters (their bytes are in the totals above too)
    launches: float = 0.0
    loop_trips: float = 0.0
    in_layer_exchange_bytes: tuple[float, float] = (0.0, 0.0)  # less what kernels cover:
    in_layer_covered_bytes: tuple[float, float] = (0.0, 0.0)  # scheduled in flight
    update_exchange_bytes: tuple[float, float] = (0.0, 0.0)
    fill_drain_bytes: tuple[float, float] = (0.0, 0.0)

    def flops(self, kind: str) -> float:
        return {"dense_gemm": sum(row[2] for row in self.dense_gemms),
                "grouped_gemm": sum(row[2] for row in self.grouped_gemms),
                "attention_forward": self.attention_forward_flops,
                "attention_backward": self.attention_backward_flops}.get(kind, 0.0)

    def bytes(self, kind: str) -> float:
        return {"dense_gemm": sum(row[3] for row in self.dense_gemms),
                "grouped_gemm": sum(row[3] for row in self.grouped_gemms),
                "memory_bound": self.memory_bytes, "optimizer_update": self.update_bytes,
                "host_copy": self.to_host_bytes + self.to_device_bytes,
                "nvlink": self.nvlink_bytes, "infiniband": self.infiniband_bytes}.get(kind, 0.0)


def attention_flops(pairs_per_gpu: float, *, heads: int, d_qk: int, d_v: int, layers: int
                    ) -> float:
    """One forward pass of every layer's attention over `pairs_per_gpu` query-key pairs."""
    return 2.0 * (d_qk + d_v) * heads * layers * pairs_per_gpu


def peak_share(hw: Hardware, math: str) -> float:
    """A GEMM's speed over BF16's for the math it runs in (kernel_classes.gemm_math)."""
    return {"tf32": hw.tf32_per_bf16, "fp32": hw.fp32_per_bf16,
            "fp8": hw.fp8_per_bf16}.get(math, 1.0)


def gemm_seconds(rows, curve, hw: Hardware, case: str, *, math: bool = True) -> list[float]:
    """Each GEMM shape's (or window's) seconds: the roofline of its FLOPs at the curve's
    efficiency for its size (at the peak of its math: a row's fifth entry, BF16 if none;
    `math=False` prices all at BF16's) and its bytes at the memory-bound efficiency of HBM."""
    peak, hbm = hw.bf16_flops, hw.hbm_bandwidth * hw.memory_bound.at(case)
    return [max(f / (peak * curve.at(size, case)
                     * (peak_share(hw, rest[0]) if rest and math else 1.0)), b / hbm)
            for _, size, f, b, *rest in rows]


def link_seconds(nvlink_infiniband: tuple[float, float], work: "StepWork", hw: Hardware,
                 case: str) -> tuple[float, float]:
    """(NVLink, InfiniBand) seconds of a pair of byte counts."""
    nvlink, between = nvlink_infiniband
    return (nvlink / (hw.nvlink_bandwidth(work.nvlink_peers) * hw.nvlink.at(case)),
            between / (hw.network_bandwidth * hw.infiniband.at(case)))


def price(work: StepWork, hw: Hardware, case: str) -> dict[str, float]:
    """Seconds per class at the `case` end of every efficiency range."""
    peak, hbm = hw.bf16_flops, hw.hbm_bandwidth * hw.memory_bound.at(case)
    return {
        "dense_gemm": sum(gemm_seconds(work.dense_gemms, hw.dense_gemm, hw, case)),
        "grouped_gemm": sum(gemm_seconds(work.grouped_gemms, hw.grouped_gemm, hw, case)),
        "attention_forward": work.attention_forward_flops
        / (peak * hw.attention_forward.at(case)),
        "attention_backward": work.attention_backward_flops
        / (peak * hw.attention_backward.at(case)),
        "memory_bound": work.memory_bytes / hbm,
        "optimizer_update": work.update_bytes / hbm,
        "host_copy": max(work.to_host_bytes, work.to_device_bytes)
        / (hw.c2c_bandwidth * hw.host_copy.at(case)),
        "nvlink": work.nvlink_bytes / (hw.nvlink_bandwidth(work.nvlink_peers)
                                       * hw.nvlink.at(case)),
        "infiniband": work.infiniband_bytes / (hw.network_bandwidth * hw.infiniband.at(case)),
        **lines(work, hw, case),
    }


def lines(work: StepWork, hw: Hardware, case: str) -> dict[str, float]:
    """The chain and serial lines (module docstring) at the `case` end of their ranges;
    an in-layer exchange runs on one link at a time, so its seconds add up, while a
    serial phase's two links run at once."""
    return {
        "kernel_launches": work.launches * hw.launch_gap.at(case),
        "loop_trip_syncs": work.loop_trips * hw.loop_trip_sync.at(case),
        "in_layer_exchange": sum(link_seconds(work.in_layer_exchange_bytes, work, hw, case)),
        "update_exchange": max(link_seconds(work.update_exchange_bytes, work, hw, case)),
        "fill_drain": max(link_seconds(work.fill_drain_bytes, work, hw, case)),
    }


def step_seconds(seconds: dict[str, float], keep: float,
                 serial_links: tuple[float, float] = (0.0, 0.0)) -> float:
    """The overlap model of the module docstring: `keep` is the share of compute speed
    left while NCCL's kernels run; `serial_links`: the (NVLink, InfiniBand) seconds of
    the serial phases, which leave the links' overlapped time."""
    compute = sum(seconds[k] for k in COMPUTE) + sum(seconds.get(k, 0.0) for k in CHAIN)
    links = max(max(0.0, seconds[k] - s) for k, s in zip(LINKS, serial_links))
    stream = compute / keep if compute <= links * keep else compute + links * (1 - keep)
    return max(stream, links, seconds["host_copy"]) + sum(seconds.get(k, 0.0) for k in SERIAL)


def estimate(work: StepWork, hw: Hardware, *, tokens_per_device: float, model_flops: float
             ) -> dict[str, Any]:
    """The step by class at every case, the range, and the expected case in the keys the
    plan has always reported (`compute_s` … `mfu_overlapped`)."""
    by_case = {case: price(work, hw, case) for case in CASES}
    steps = {case: max(1e-12, step_seconds(by_case[case], hw.overlap_compute.at(case),
                                           _serial_links(work, hw, case)))
             for case in CASES}
    expected = by_case["expected"]
    # everything one after another: the classes, and the chain's waits that are no link
    # time already counted
    serial = max(1e-12, sum(expected[k] for k in CLASSES)
                 + expected["kernel_launches"] + expected["loop_trip_syncs"])
    by_class = {}
    for kind in CLASSES:
        flops = work.flops(kind)
        row = {"flops": flops, "bytes": work.bytes(kind),
               "seconds": {case: by_case[case][kind] for case in CASES},
               "share_of_serial": expected[kind] / serial if serial else 0.0}
        if flops:  # what the class reached of the FLOP peak, whatever bound it
            row["effective_efficiency"] = {
                case: flops / (hw.bf16_flops * by_case[case][kind]) if by_case[case][kind]
                else None for case in CASES}
        by_class[kind] = row
    step_range = {case: {"step_s": steps[case],
                         "tokens_per_s_per_gpu": tokens_per_device / steps[case],
                         "mfu": model_flops / steps[case] / hw.bf16_flops}
                  for case in CASES}
    overlapped = steps["expected"]
    legacy = {"compute_s": sum(expected[k] for k in COMPUTE[:4]),
              "memory_s": expected["memory_bound"], "update_s": expected["optimizer_update"],
              "nvlink_s": expected["nvlink"], "infiniband_s": expected["infiniband"],
              "c2c_s": expected["host_copy"], "step_overlapped_s": overlapped,
              "step_serial_s": serial,
              "tokens_per_s_per_gpu_overlapped": tokens_per_device / overlapped,
              "tokens_per_s_per_gpu_serial": tokens_per_device / serial,
              "mfu_overlapped": model_flops / overlapped / hw.bf16_flops}
    return {**legacy, "by_class": by_class, "range": step_range,
            "ceilings": ceilings(work, hw, tokens_per_device=tokens_per_device),
            "lines": _lines(work, hw, by_case),
            "gemms": {"dense_gemm": _largest(work.dense_gemms, hw.dense_gemm, hw),
                      "grouped_gemm": _largest(work.grouped_gemms, hw.grouped_gemm, hw)}}


def ceilings(work: StepWork, hw: Hardware, *, tokens_per_device: float) -> dict[str, dict]:
    """What cutting communication can buy at most: the same step priced again with
    InfiniBand free (no byte between nodes costs anything: the overlapped link, its part of
    the in-layer exchanges and of the serial phases), and with both links free (the compute
    stream with its launches and loop trips alone). A change that only moves fewer bytes
    cannot pass these; only less work on the SMs can."""
    free = {"infiniband_free": dataclasses.replace(
                work, infiniband_bytes=0.0,
                **{f"{name}_bytes": (getattr(work, f"{name}_bytes")[0], 0.0)
                   for name in PRICED_EXCHANGES}),
            "links_free": dataclasses.replace(
                work, infiniband_bytes=0.0, nvlink_bytes=0.0,
                **{f"{name}_bytes": (0.0, 0.0) for name in PRICED_EXCHANGES})}
    out = {}
    for name, freed in free.items():
        out[name] = {}
        for case in CASES:
            step = max(1e-12, step_seconds(price(freed, hw, case), hw.overlap_compute.at(case),
                                           _serial_links(freed, hw, case)))
            out[name][case] = {"step_s": step, "tokens_per_s_per_gpu": tokens_per_device / step}
    return out


def _serial_links(work: StepWork, hw: Hardware, case: str) -> tuple[float, float]:
    update = link_seconds(work.update_exchange_bytes, work, hw, case)
    ends = link_seconds(work.fill_drain_bytes, work, hw, case)
    return update[0] + ends[0], update[1] + ends[1]


LINE_SOURCES = {
    "tf32_gemms": "float32 GEMMs at the TF32 (or FP32) peak instead of BF16's: hardware.py "
                  "[h100], [tf32]; the program's operand dtypes and precision",
    "mla_backward_ratio": "the attention backward's five matmuls at the model's head dims "
                          "(backward_per_forward) instead of FlashAttention's 2.5",
    "kernel_launches": "launches per step (the GPU program) × hardware.launch_gap",
    "loop_trip_syncs": "trips of loops whose trip count is data (at the plan's expected "
                       "trips) × hardware.loop_trip_sync",
    "in_layer_exchange": "the forward's and backward's activation exchanges (MoE dispatch "
                         "and combine, context parallelism) waited for on the compute "
                         "stream, at their link's speed, less the bytes the kernels "
                         "scheduled while they are in flight cover (critical_path.py)",
    "update_exchange": "the optimizer update's collectives (Muon's re-layout), serial "
                       "(critical_path.py)",
    "fill_drain": "the first weight gathers and the last gradient reduce-scatters of the "
                  "step, serial — a bound (critical_path.py)",
}


def _lines(work: StepWork, hw: Hardware, by_case: dict) -> dict[str, dict]:
    """The lines the audit of the plan found missing, each with its seconds at every case
    and its source: the two priced inside their classes (what they add to them) and the
    chain and serial lines."""
    out = {}
    # the float32 GEMMs only: FP8 ones (execution.fp8_gemms) are faster than BF16, and their
    # saving would otherwise be netted into this line
    float32_rows = tuple(row for row in work.dense_gemms
                         if row[4:] and row[4] in ("tf32", "fp32"))
    for case in CASES:
        flash = FLASH_BACKWARD_PER_FORWARD / work.attention_backward_ratio
        seconds = {"tf32_gemms": (
                       sum(gemm_seconds(float32_rows, hw.dense_gemm, hw, case))
                       - sum(gemm_seconds(float32_rows, hw.dense_gemm, hw, case, math=False))),
                   "mla_backward_ratio": by_case[case]["attention_backward"] * (1 - flash),
                   **{k: by_case[case][k] for k in LINES}}
        for name, value in seconds.items():
            out.setdefault(name, {"seconds": {}, "source": LINE_SOURCES[name]})[
                "seconds"][case] = value
    out["kernel_launches"]["count"] = work.launches
    out["loop_trip_syncs"]["count"] = work.loop_trips
    for name in PRICED_EXCHANGES:
        nvlink, between = getattr(work, f"{name}_bytes")
        out[name].update(nvlink_bytes=nvlink, infiniband_bytes=between)
    covered_nvlink, covered_between = work.in_layer_covered_bytes
    out["in_layer_exchange"].update(covered_nvlink_bytes=covered_nvlink,
                                    covered_infiniband_bytes=covered_between)
    return out


def _largest(rows, curve, hw: Hardware, top: int = 6) -> list[dict]:
    """The `top` GEMM shapes (or windows) by expected seconds, with what bounds each."""
    seconds = gemm_seconds(rows, curve, hw, "expected")
    out = [{"shape": label, "size": size, "flops": f, "bytes": b, "seconds": s,
            "efficiency": curve.at(size, "expected"),
            "bound": "HBM" if b / (hw.hbm_bandwidth * hw.memory_bound.expected) >= s * 0.999
            and b else "FLOPs"}
           for (label, size, f, b, *_), s in zip(rows, seconds)]
    return sorted(out, key=lambda r: -r["seconds"])[:top]
