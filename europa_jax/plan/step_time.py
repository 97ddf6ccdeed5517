"""A step's time per class of kernel, and the step as a range.

What a GPU does in a step (`StepWork`) is read off the GPU program (kernel_classes.py,
hbm_traffic.py, the collectives by link) and the attention the slowest GPU runs
(attention_cost.py); each class is priced at its own efficiency (hardware.py), at the low,
expected and high end of its range:
- dense GEMMs, shape by shape: max(FLOPs / (peak · efficiency at the GEMM's smallest
  dimension), bytes / (HBM bandwidth · memory efficiency)) — a skinny GEMM is bound by
  its operands;
- grouped GEMMs, window by window: the same, at the efficiency of its rows per expert;
- flash attention forward and backward: the pairs the kernels run (masked ones included)
  × FLOPs per pair by FlashAttention's convention (forward 2·(d_qk + d_v) per head,
  backward 2.5 × forward), the convention its published efficiencies use;
- memory-bound kernels (XLA's fusions, copies, sorts): their HBM bytes; the optimizer
  update: the state it reads and writes;
- host copies: the larger direction over NVLink-C2C (both directions run at once);
- collectives: NVLink and InfiniBand bytes over their bandwidths.

The overlap model: the GEMMs, attention, memory-bound kernels and the update share the
SMs and run one after another (the compute stream, C). Collectives run on their own
streams beside it, but NCCL's kernels hold SMs while they run (NCCL_MAX_CTAS): compute
keeps `overlap_compute` of its speed for as long as the busier link L = max(NVLink,
InfiniBand) is busy, so the stream takes C/keep if it ends first, else C + L·(1 − keep).
Host copies run on the copy engines. step = max(compute stream, L, C2C). `serial` adds
everything up: the bound if nothing overlapped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from europa_jax.plan.hardware import CASES, Hardware

OVERLAP_MODEL = ("step = max(compute stream, busier link, host copies): GEMMs, attention, "
                 "memory-bound kernels and the update run one after another; collectives "
                 "overlap them on their own streams, compute keeping `overlap_compute` of its "
                 "speed while NCCL holds SMs; host copies run on the copy engines")
COMPUTE = ("dense_gemm", "grouped_gemm", "attention_forward", "attention_backward",
           "memory_bound", "optimizer_update")
LINKS = ("nvlink", "infiniband")
CLASSES = COMPUTE + ("host_copy",) + LINKS
BACKWARD_PER_FORWARD = 2.5  # FlashAttention's FLOP convention (FA2/FA3 papers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepWork:
    """What one GPU does in one step, before any efficiency."""

    # (shape, smallest dim, FLOPs, bytes) per GEMM shape; (window, rows per expert, FLOPs,
    # bytes) per grouped-GEMM window
    dense_gemms: tuple[tuple[str, float, float, float], ...]
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

    def flops(self, kind: str) -> float:
        return {"dense_gemm": sum(f for _, _, f, _ in self.dense_gemms),
                "grouped_gemm": sum(f for _, _, f, _ in self.grouped_gemms),
                "attention_forward": self.attention_forward_flops,
                "attention_backward": self.attention_backward_flops}.get(kind, 0.0)

    def bytes(self, kind: str) -> float:
        return {"dense_gemm": sum(b for _, _, _, b in self.dense_gemms),
                "grouped_gemm": sum(b for _, _, _, b in self.grouped_gemms),
                "memory_bound": self.memory_bytes, "optimizer_update": self.update_bytes,
                "host_copy": self.to_host_bytes + self.to_device_bytes,
                "nvlink": self.nvlink_bytes, "infiniband": self.infiniband_bytes}.get(kind, 0.0)


def attention_flops(pairs_per_gpu: float, *, heads: int, d_qk: int, d_v: int, layers: int
                    ) -> float:
    """One forward pass of every layer's attention over `pairs_per_gpu` query-key pairs."""
    return 2.0 * (d_qk + d_v) * heads * layers * pairs_per_gpu


def gemm_seconds(rows, curve, hw: Hardware, case: str) -> list[float]:
    """Each GEMM shape's (or window's) seconds: the roofline of its FLOPs at the curve's
    efficiency for its size and its bytes at the memory-bound efficiency of HBM."""
    peak, hbm = hw.bf16_flops, hw.hbm_bandwidth * hw.memory_bound.at(case)
    return [max(f / (peak * curve.at(size, case)), b / hbm) for _, size, f, b in rows]


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
    }


def step_seconds(seconds: dict[str, float], keep: float) -> float:
    """The overlap model of the module docstring: `keep` is the share of compute speed
    left while NCCL's kernels run."""
    compute = sum(seconds[k] for k in COMPUTE)
    links = max(seconds[k] for k in LINKS)
    stream = compute / keep if compute <= links * keep else compute + links * (1 - keep)
    return max(stream, links, seconds["host_copy"])


def estimate(work: StepWork, hw: Hardware, *, tokens_per_device: float, model_flops: float
             ) -> dict[str, Any]:
    """The step by class at every case, the range, and the expected case in the keys the
    plan has always reported (`compute_s` … `mfu_overlapped`)."""
    by_case = {case: price(work, hw, case) for case in CASES}
    steps = {case: max(1e-12, step_seconds(by_case[case], hw.overlap_compute.at(case)))
             for case in CASES}
    expected = by_case["expected"]
    serial = max(1e-12, sum(expected.values()))
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
            "gemms": {"dense_gemm": _largest(work.dense_gemms, hw.dense_gemm, hw),
                      "grouped_gemm": _largest(work.grouped_gemms, hw.grouped_gemm, hw)}}


def _largest(rows, curve, hw: Hardware, top: int = 6) -> list[dict]:
    """The `top` GEMM shapes (or windows) by expected seconds, with what bounds each."""
    seconds = gemm_seconds(rows, curve, hw, "expected")
    out = [{"shape": label, "size": size, "flops": f, "bytes": b, "seconds": s,
            "efficiency": curve.at(size, "expected"),
            "bound": "HBM" if b / (hw.hbm_bandwidth * hw.memory_bound.expected) >= s * 0.999
            and b else "FLOPs"}
           for (label, size, f, b), s in zip(rows, seconds)]
    return sorted(out, key=lambda r: -r["seconds"])[:top]
