"""The machine the plan estimates for: one GH200 of a JUPITER Booster node, its peaks and
what each class of kernel reaches of them, with sources.

Every number is per GPU and per direction unless it says otherwise. An efficiency is a
range — low / expected / high — because no one number holds for a whole step: the plan
prices each class of kernel (kernel_classes.py) at its own and reports the step as a
range (step_time.py). Nothing here has been measured on a JUPITER GPU; where a source
measured something else (FP8 for BF16, another Hopper, another fabric) the comment says
so, and the range is wider. `calibrated()` replaces the assumptions by what
`benchmarks/gpu_check.py` measured (`europa-jax plan --hardware gpu_check.json`).

Peaks:
[jsc]   JSC, "JUPITER configuration", apps.fz-juelich.de/jsc/hps/jupiter/configuration.html:
        4× GH200 per node; Hopper with 96 GB HBM3 at 4 TB/s; NVLink-C2C CPU↔GPU at 900 GB/s;
        NVLink 4 between every pair of GPUs, 300 GB/s per pair (150 GB/s per direction);
        4× InfiniBand NDR200 (ConnectX-7) per node; GH200 TDP 680 W.
[h100]  NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOP/s dense BF16 (1,979 with
        2:4 sparsity), 1,979 dense FP8, 495 dense TF32, 67 FP32 (no tensor cores); the
        GH200 datasheet lists the same Hopper GPU.
[tf32]  docs.jax.dev "Matmul precision": float32 dots at the default precision may run in
        TF32 on recent GPUs; the optimized GPU program states each cuBLAS call's operand
        precision (DEFAULT: TF32 for f32 operands; HIGHEST: full FP32).
Efficiencies (H100 SXM unless noted; % of the peak above):
[fastcu] github.com/pranjalssh/fast.cu, README "Benchmarks": cuBLAS BF16 on H100 SXM,
        8192³ 797.8 TFLOP/s (80.7 %), 6144³ 741.1 (74.9 %).
[mamf]  github.com/stas00/ml-engineering, compute/accelerator/README.md, "Maximum
        Achievable Matmul FLOPS": torch.matmul BF16, H100 SXM 794.5 TFLOP/s (80.3 %), GH200
        828.6 (83.8 %), after a shape search.
[sweep] github.com/zzc0721/torch-performance-test-data issue 79 (a user's H100 run,
        PyTorch 2.7): BF16 square 1024³ 17.9 %, 2048³ 68.4 %, 4096³ 79.7 %, 8192³ 80.6 %.
[vllm]  vLLM pull request 49363 (H100, cuBLAS BF16, N 12288, K 5376): M=64 18.5 %,
        M=128 35.6 % — a skinny GEMM falls off a cliff.
[cublasfp8] A cuBLASLt FP8 GEMM benchmark (e4m3 in, BF16 out, FP32 accumulation, TN,
        8192³; gitea.d-robotics.cc han.zhao/test_gpu_scripts,
        reports_cublaslt_fp8_crosscheck_20260524.md): 1,599–1,630 TFLOP/s on 16 Hopper
        GPUs (81–82 % of 1,979; the report names no model).
[deepgemm] github.com/deepseek-ai/DeepGEMM, README of 2025-03-25: FP8 on H800 (same SMs
        and HBM as H100), % of the FP8 peak: dense 4096×7168×2048 59 %, ×512 38 %; grouped,
        contiguous 4,096–8,192 rows per group 61–68 %; masked 1,024 rows 47–62 %, 256 rows
        41–47 %. FP8, not BF16: the nearest published curve of grouped GEMMs by rows.
[sonic] SonicMoE, arXiv 2512.14080, Fig. 14: whole BF16 MoE layers on H100 at 1.5–2.5k
        rows per expert, 34–61 % (SonicMoE) and 11–34 % (Megatron's grouped GEMM).
[ggemm] github.com/tgale96/grouped_gemm pull request 37 (H100, 512 rows per expert,
        K 2048, N 1536): cuBLAS 13 %, CUTLASS 16 %.
[fa3]   Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, BF16/FP16 on H100 SXM at
        16k tokens: forward head dim 128 65.5 % (causal 62.3 %), head dim 256 76 %;
        backward head dim 128 56.7 % (cuDNN 52 %; read off the paper's figure by a third
        party). An independent rerun of the forward came out ~4 % lower (pytorch/benchmark
        pull request 2391). Head dims 192/128 (MLA) are not published.
[fa2]   Dao 2023, FlashAttention-2, arXiv 2307.08691 (its H100 figure): forward+backward
        33–34 % at head dim 128.
[stream] github.com/UoB-HPC/BabelStream issue 194: GH200 (HBM3, 4 TB/s) copy 74 %, triad
        83 %; github.com/deepseek-ai/FlashMLA README: 3,000 GB/s of H800's 3.35 TB/s (90 %).
[c2c]   Schieffer et al., arXiv 2407.07850 (as reported by HPCwire): GH200 C2C host→device
        375 GB/s (83 %), device→host 297 GB/s (66 %); NVIDIA/nvbandwidth issue 23: GH200
        host→device 346 GB/s (77 %).
[nccl]  github.com/stas00/ml-engineering, network/README.md: 8× H200 nccl-tests at 16 GiB,
        all-gather 361 GB/s and reduce-scatter 363 GB/s bus bandwidth (80–81 % of NVLink 4's
        450); "~80 % is the normal case"; NVIDIA/nccl issue 1455: ~80 % on H100. (8-GPU
        NVSwitch nodes: the JUPITER quad links each pair directly.)
[ib]    github.com/deepseek-ai/DeepEP, README of 2025-02-24: all-to-all across H800 nodes
        over ConnectX-7 400 Gb/s at 43–47 of ~50 GB/s (86–94 %); ml-engineering
        network/README.md: inter-node all-reduce at 50 GB/s per GPU (B200, EFA) 74 % of the
        line at 16 GiB, 70 % at 1 GiB, 38 % at 128 MiB.
[sm]    NVIDIA/nccl issue 689 (maintainer): NCCL's thread blocks do not share an SM with
        compute kernels; launch/env.sh caps them at NCCL_MAX_CTAS=16 of the 132 SMs.
        arXiv 2507.03114: compute overlapped with communication ran 18.9 % slower on
        average (40 % at most) on 4× H100.
[while] openxla/xla, xla/backends/gpu/runtime/while_thunk.cc: a loop whose trip count is
        not known at compile time copies its condition to the host and blocks the host
        until the stream is done (`BlockHostUntilDone`) on every trip, so the GPU drains its
        queue and waits for the host to launch the next kernels.
[graphs] NVIDIA Technical Blog, "Getting Started with CUDA Graphs": back-to-back short
        kernels pay a launch overhead of the order of microseconds each, which a CUDA graph
        (XLA's command buffers) cuts. No GH200 figure is published: assumed until
        gpu_check measures it.
[e2e]   For scale, not used: DeepSeek-V3 pretraining on 1,024 H100 in BF16 reached 216
        TFLOP/s/GPU (22 % of 989; NeMo AutoModel performance summary); 338 TFLOP/s/GPU is
        Megatron-Bridge's FP8 figure (NeMo 25.09 performance summary).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from europa_jax.config import ConfigError

CASES = ("low", "expected", "high")  # slow → fast: every efficiency at its low end, …


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """A share of a peak that a class of kernels reaches: its range and where it is from."""

    low: float
    expected: float
    high: float
    source: str

    def __post_init__(self):
        if not 0 < self.low <= self.expected <= self.high <= 1:
            raise ConfigError(f"efficiency {self.low}/{self.expected}/{self.high} "
                              f"({self.source}): expected 0 < low ≤ expected ≤ high ≤ 1")

    def at(self, case: str) -> float:
        return getattr(self, case)


@dataclass(frozen=True, kw_only=True)
class Overhead:
    """Seconds an event costs the compute stream (a kernel launch's gap, a loop trip's
    host round trip): a range, slow end (`low` case) first, and where it is from."""

    low: float
    expected: float
    high: float
    source: str

    def __post_init__(self):
        if not self.low >= self.expected >= self.high >= 0:
            raise ConfigError(f"overhead {self.low}/{self.expected}/{self.high} s "
                              f"({self.source}): expected low ≥ expected ≥ high ≥ 0 "
                              "(the low case is the slow end)")

    def at(self, case: str) -> float:
        return getattr(self, case)


@dataclass(frozen=True, kw_only=True)
class Curve:
    """An efficiency that depends on a size (a GEMM's smallest dimension, a grouped GEMM's
    rows per expert): log-linear between anchor sizes, flat beyond the ends."""

    points: tuple[tuple[float, Efficiency], ...]  # (size, efficiency), sizes increasing

    def __post_init__(self):
        sizes = [s for s, _ in self.points]
        if not sizes or sizes[0] <= 0 or any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ConfigError(f"efficiency curve sizes {sizes}: expected positive, increasing")

    def at(self, size: float, case: str) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1].at(case)
        for (s0, e0), (s1, e1) in zip(pts, pts[1:]):
            if size <= s1:
                t = math.log(size / s0) / math.log(s1 / s0)
                return e0.at(case) + t * (e1.at(case) - e0.at(case))
        return pts[-1][1].at(case)

    @property
    def sources(self) -> list[str]:
        return [e.source for _, e in self.points]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    bf16_flops: float  # dense peak
    hbm_bytes: float
    hbm_bandwidth: float
    # Host memory the plan may fill per GPU (optimizer state, offloaded activations).
    host_bytes: float
    c2c_bandwidth: float  # host ↔ device over NVLink-C2C
    nvlink_pair_bandwidth: float  # to one other GPU of the node
    gpus_per_node: int
    network_bandwidth: float  # InfiniBand, one HCA per GPU
    # What each class of kernel reaches of those peaks (kernel_classes.py, step_time.py).
    dense_gemm: Curve  # by the GEMM's smallest dimension (M, N or K)
    grouped_gemm: Curve  # by rows per expert of a window
    attention_forward: Efficiency  # of the FLOPs the kernels' pairs take (step_time.py)
    attention_backward: Efficiency
    memory_bound: Efficiency  # of HBM bandwidth
    host_copy: Efficiency  # of C2C bandwidth, each way
    nvlink: Efficiency
    infiniband: Efficiency
    # The share of compute speed kept while NCCL's kernels hold SMs beside it.
    overlap_compute: Efficiency
    # Peaks of float32 GEMMs over the BF16 peak: TF32 tensor cores (precision DEFAULT)
    # and plain FP32 (HIGHEST) [h100], [tf32].
    tf32_per_bf16: float = 0.5
    fp32_per_bf16: float = 67.0 / 989.0
    # A cuBLASLt FP8 GEMM (execution.fp8_gemms: tensor) over a BF16 one of the same shape: the
    # FP8 peak is 2× BF16's [h100]; what kernels reach of it runs from [deepgemm]'s dense
    # 59 % of the FP8 peak at 4096×7168×2048 (against BF16's ~80 % at 4096³ [sweep]: 1.48×)
    # to [cublasfp8]'s 81 % at 8192³ (2.0×). Its quantization passes are memory-bound
    # kernels of their own in the program, priced as such.
    fp8_per_bf16: float = 1.6
    # What the compute stream loses per kernel launch and per trip of a loop whose trip
    # count is data (step_time.py's chain lines).
    launch_gap: Overhead = Overhead(low=4e-6, expected=2e-6, high=1e-6, source=(
        "[graphs] µs-order launch overhead of back-to-back kernels; XLA's command buffers "
        "cut it (assumed, unmeasured on GH200)"))
    loop_trip_sync: Overhead = Overhead(low=40e-6, expected=20e-6, high=10e-6, source=(
        "[while] each trip copies the predicate to the host and blocks: a device→host round "
        "trip and the launch queue refilled (assumed, unmeasured on GH200)"))
    calibration: str = "assumed from the sources in plan/price/hardware.py (no GPU measured)"

    def nvlink_bandwidth(self, peers: int) -> float:
        """A GPU's NVLink bandwidth to `peers` GPUs of its node at once.

        The quad is fully connected, one link bundle per pair [jsc], so an exchange with
        every peer (all-to-all; NCCL rings run a channel per link) uses them all together.
        """
        return self.nvlink_pair_bandwidth * max(1, min(peers, self.gpus_per_node - 1))

    def efficiencies(self) -> dict[str, dict]:
        """Every class's range and source, for the report."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Efficiency, Overhead)):
                out[f.name] = dataclasses.asdict(value)
            elif isinstance(value, Curve):
                out[f.name] = {"by": "smallest GEMM dimension" if f.name == "dense_gemm"
                               else "rows per expert",
                               "points": [{"size": s, **dataclasses.asdict(e)}
                                          for s, e in value.points]}
        return out


HOST_BYTES_STRICT = 30e9


def _e(low: float, expected: float, high: float, source: str) -> Efficiency:
    return Efficiency(low=low, expected=expected, high=high, source=source)


GH200_JUPITER = Hardware(
    name="GH200 (JUPITER Booster)",
    bf16_flops=989e12,  # [h100]; JUPITER caps the superchip at 680 W [jsc], so sustained
    #                     clocks may sit below NVIDIA's 900 W-class figures
    hbm_bytes=96e9,  # [jsc]
    hbm_bandwidth=4.0e12,  # [jsc]
    # Each GH200 superchip has its own Grace CPU with 120 GB of LPDDR5X [jsc]; launch/env.sh
    # caps XLA's pinned host pool per GPU at 96 GB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB),
    # leaving 24 GB for the OS, the process and its input pipeline. (A stricter reading,
    # 120 GB per node = 30 GB per GPU, is HOST_BYTES_STRICT: the plan says if a run fits it.)
    host_bytes=96e9,
    c2c_bandwidth=450e9,  # 900 GB/s both directions together [jsc]
    nvlink_pair_bandwidth=150e9,  # [jsc]
    gpus_per_node=4,  # [jsc]
    network_bandwidth=25e9,  # NDR200 = 200 Gb/s, one HCA per GPU [jsc]
    dense_gemm=Curve(points=(
        (128, _e(0.18, 0.30, 0.36, "[vllm] M=64–128: 18–36 %")),
        (512, _e(0.38, 0.50, 0.60, "[deepgemm] K=512 38 % (FP8); judgement between")),
        (2048, _e(0.55, 0.65, 0.72, "[sweep] 2048³ 68 %; [deepgemm] K=2048 59 % (FP8)")),
        (4096, _e(0.70, 0.78, 0.83, "[fastcu] 75–81 %, [mamf] 80 % H100 / 84 % GH200, "
                                    "[sweep] 80 %")))),
    grouped_gemm=Curve(points=(
        (256, _e(0.15, 0.33, 0.45, "[deepgemm] masked 256 rows 41–47 % (FP8); [ggemm] "
                                   "13–16 % at 512")),
        (1024, _e(0.30, 0.48, 0.60, "[deepgemm] masked 1,024 rows 47–62 % (FP8); [sonic] "
                                    "34–61 % per layer")),
        (4096, _e(0.45, 0.60, 0.70, "[deepgemm] contiguous 4–8k rows 61–68 % (FP8); "
                                    "tokamax's kernel unmeasured")))),
    attention_forward=_e(0.45, 0.62, 0.72, "[fa3] forward 62–66 % (head dim 128), 76 % "
                         "(256); a rerun ~4 % lower; tokamax's Mosaic kernel unmeasured"),
    attention_backward=_e(0.33, 0.48, 0.57, "[fa3] backward 57 % (cuDNN 52 %) at head dim "
                          "128; [fa2] 33–34 % forward+backward"),
    memory_bound=_e(0.55, 0.75, 0.90, "[stream] GH200 copy 74 %, triad 83 %, FlashMLA 90 %; "
                    "XLA's small fusions, gathers and scatters below streaming (judgement)"),
    host_copy=_e(0.66, 0.77, 0.83, "[c2c] GH200 device→host 66 %, host→device 77–83 %"),
    nvlink=_e(0.70, 0.80, 0.85, "[nccl] all-gather/reduce-scatter 80–81 % on NVLink 4"),
    infiniband=_e(0.55, 0.75, 0.90, "[ib] all-to-all 86–94 %; all-reduce 70–74 % at ≥ 1 GiB "
                  "(38 % at 128 MiB)"),
    overlap_compute=_e(0.81, 0.88, 0.88, "[sm] NCCL holds 16 of 132 SMs (88 % left); "
                       "overlapped compute measured 18.9 % slower on average"),
)


# ----------------------------------------------------------------------------- calibration

# What gpu_check.py writes under "calibration" (benchmarks/gpu_check.py, `calibration()`):
# per class either {"efficiency": {low, expected, high}} or, for the two curves,
# {"points": [{"size": …, "efficiency": {low, expected, high}}, …]}; plus the device, the
# date and whether it was a smoke run at tiny shapes.
CALIBRATED = ("dense_gemm", "grouped_gemm", "attention_forward", "attention_backward",
              "memory_bound", "host_copy")


def calibrated(machine: Hardware, path: str | Path) -> Hardware:
    """`machine` with the efficiencies gpu_check.py measured (its JSON's "calibration"):
    each class it measured replaces the assumed one; the rest stay as cited."""
    try:
        data = json.loads(Path(path).read_text())
        cal = data["calibration"]
    except FileNotFoundError:
        raise ConfigError(f"--hardware {path}: no such file (write one with python "
                          f"benchmarks/gpu_check.py --json {path})") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(f"--hardware {path}: expected gpu_check.py's JSON with a "
                          "'calibration' section (python benchmarks/gpu_check.py --json "
                          f"{path})") from None
    where = (f"measured by gpu_check on {cal.get('device', '?')}, {cal.get('date', '?')}"
             + (" — a smoke run at tiny shapes: says nothing about a GPU"
                if cal.get("smoke") else ""))
    replaced, measured = {}, []
    for name in CALIBRATED:
        part = cal.get(name)
        if not isinstance(part, dict) or "error" in part:
            continue
        key = f"--hardware {path}: calibration.{name}"
        if "points" in part:
            points = tuple((float(p["size"]), _measured(p["efficiency"], f"{key}.points",
                                                        f"{where}, {p.get('shape', '')}"))
                           for p in sorted(part["points"], key=lambda p: p["size"]))
            if points:
                replaced[name] = Curve(points=points)
        else:
            replaced[name] = _measured(part.get("efficiency"), key, where)
        if name in replaced:
            measured.append(name)
    if not measured:
        raise ConfigError(f"--hardware {path}: its calibration measured no class "
                          f"(expected some of {', '.join(CALIBRATED)})")
    return dataclasses.replace(machine, **replaced,
                               calibration=f"{where}: {', '.join(measured)}; the rest "
                               "assumed (plan/price/hardware.py)")


def _measured(e, key: str, source: str) -> Efficiency:
    try:
        values = [float(e[c]) for c in CASES]
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{key}: {e!r}, expected {{low, expected, high}} "
                          "fractions of the peak") from None
    if not all(0 < v <= 1 for v in values):
        raise ConfigError(f"{key}: {values} — a measured fraction of the peak must be in "
                          "(0, 1] (is the device's peak in gpu_check.py right?)")
    low, expected, high = sorted(values)
    return Efficiency(low=low, expected=expected, high=high, source=source)

