"""Compiling for NVIDIA GPUs on a machine that has none (deviceless ahead-of-time compile).

jax's CUDA plugin compiles for a GPU it cannot see: `get_topology_desc` makes
compile-only devices from a `stream_executor.GpuTargetConfigProto` (the GPU's facts, as
text) and a "partitions x hosts x devices-per-host" topology, and `jit(...).lower(...)
.compile()` on a mesh of them returns the GPU compiler's program: `memory_analysis()` with
separate HBM and host columns, and the optimized HLO with the GPU's collectives, fusions
and kernel calls. What it needs and what it does not give (found on jaxlib 0.10.2, each
still so on 0.12.0.1):
- the `gpu` extra (jax-cuda12-plugin/-pjrt, ptxas from nvidia-cuda-nvcc-cu12; tokamax for
  the grouped matmul) and `JAX_PLATFORMS=cpu` before jax starts, or the plugin calls
  cuInit at start-up and fails without a driver;
- shardings on the concrete mesh silently drop `memory_kind="pinned_host"` (compile-only
  devices list no memories); on `mesh.abstract_mesh` they keep it (`placement_mesh`);
- kernel libraries choose their sm90 kernels from the default device, so lowering runs
  with a target device as default (`lowering`) — only then, because eager ops would try
  to run on it;
- no autotuning (GEMMs get default tiles) and no `cost_analysis()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
from typing import TYPE_CHECKING

from europa_jax.config import ConfigError, MeshConfig

if TYPE_CHECKING:  # jax is imported where used: the toolchain check must not start it
    import jax

GPUS_PER_NODE = 4  # JUPITER: 4 GH200 per node; a host of the topology is a node

# XLA options of every GPU-target compile: exactly launch/env.sh's XLA_FLAGS, so the plan
# compiles the program a Jupiter rank runs (tests/test_gpu_target.py keeps the two equal).
# Why each is there is said in env.sh. The schedule options matter to the plan as much as
# to the run: without the latency-hiding scheduler and the pipelined collectives (XLA's
# defaults: off) europa-952b's program differs — no kernel between an MoE exchange's start
# and done, 5.5 TB less HBM traffic, 15 GB less HBM — and the plan priced a program no
# rank ran (1,001 tokens/s/GPU against 960 for the run's; docs/plan.md).
# Triton GEMMs off: deviceless, XLA's Triton GEMM fusion fails to tile some Newton–Schulz
# matmuls ("Couldn't find output tile sizes", f32[1920,1920]), and cuBLAS is the GEMM path
# most GPU training stacks pin (MaxText's recommended flags).
# Memory slop 400 %: XLA:GPU's rematerialization pass counts the step's pinned-host buffers
# (europa-952b: 67 GB of offloaded layer inputs and optimizer state) against the HBM limit
# it aims for, cannot reach it, and recomputes kernels all the same. At 200 % it stayed out
# of the way until the latency-hiding scheduler's schedule (166 GiB counted) crossed the
# limit: then it recomputed the expert windows' fusions three times over for 1.0 GB of HBM
# (38.8 TB of non-matmul HBM traffic per step against 30.6, 3.1 s). 400 % keeps it out; the
# HBM peak stays the plan's to check.
RUN_XLA_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
    # (jax 0.12's XLA: the enum options that the deprecated
    # xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}=true map to)
    "xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_ON",
    "xla_gpu_pipeline_reduce_scatter": "COLLECTIVE_PIPELINING_MODE_ON",
    "xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_ON",
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_all_gather_combine_threshold_bytes": 1073741824,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 1073741824,
    "xla_gpu_all_reduce_combine_threshold_bytes": 1073741824,
    "xla_gpu_enable_all_gather_combine_by_dim": False,
    "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
    "xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel": False,
    "xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback": True,
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_memory_limit_slop_factor": 400,
}
PIPELINING_MODE = "COLLECTIVE_PIPELINING_MODE_"


def xla_flag(option: str, value) -> str:
    """A compiler option as XLA_FLAGS spells it (`--xla_…=true`, `=on` for an enum mode)."""
    text = str(value)
    return f"--{option}={text.removeprefix(PIPELINING_MODE).lower()}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTarget:
    """What the GPU compiler needs to know about a device (all Hopper: sm_90a, 132 SMs)."""

    name: str  # the device description the compiler reports
    hbm_bytes: int  # device memory the compiler may plan for
    hbm_bandwidth: float  # bytes/s
    clock_ghz: float = 1.98
    core_count: int = 132
    l2_bytes: int = 50 * 2**20
    # XLA_CLIENT_MEM_FRACTION (launch/env.sh): the share of HBM XLA's allocator gets; the
    # rest holds the CUDA context, NCCL buffers and library workspaces.
    mem_fraction: float = 0.92

    @property
    def hbm_budget_bytes(self) -> float:
        return self.hbm_bytes * self.mem_fraction


# Vendor datasheets: H100 SXM5 80 GB HBM3 3.35 TB/s; H200 141 GB HBM3e 4.8 TB/s; the
# JUPITER GH200 96 GB HBM3 at 4 TB/s (hardware.py [jsc]). Same GH100 die and clocks.
TARGETS = {
    "gh200": GpuTarget(name="NVIDIA GH200 96GB HBM3", hbm_bytes=96_000_000_000,
                       hbm_bandwidth=4.0e12),
    "h100": GpuTarget(name="NVIDIA H100 80GB HBM3", hbm_bytes=80 * 2**30,
                      hbm_bandwidth=3.35e12),
    "h200": GpuTarget(name="NVIDIA H200 141GB HBM3e", hbm_bytes=141 * 2**30,
                      hbm_bandwidth=4.8e12),
}


class ToolchainError(ConfigError):
    """The GPU compile toolchain is not installed (one line, names the extra; exit 2)."""


# The CUDA runtime a rank loads: `pip install 'jax[cuda12]'` on a GPU node (pyproject.toml's
# gpu extra) takes the newest CUDA 12 wheels, 12.9. The compiler reads the version from the
# target: without it XLA takes the toolkit to be version 0 and silently compiles every FP8
# dot as an FP16 GEMM ("FP8 Custom Calls require CUDA 12.0 or newer"; found compiling
# execution.fp8_gemms, tests/test_fp8_linear.py).
CUDA_RUNTIME = (12, 9)


def target_config(target: GpuTarget) -> str:
    """The target as a `GpuTargetConfigProto` in text format (Hopper limits, sm_90a)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {target.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(target.hbm_bandwidth)}
  l2_cache_size: {target.l2_bytes}
  clock_rate_ghz: {target.clock_ghz}
  device_memory_size: {target.hbm_bytes}
  cuda_compute_capability {{ major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  device_vendor: "NVIDIA Corporation"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
runtime_version {{ major: {CUDA_RUNTIME[0]} minor: {CUDA_RUNTIME[1]} patch: 0 }}
device_description_str: "{target.name}"
"""


def missing_toolchain() -> list[str]:
    """The packages of the `gpu` extra that this environment lacks."""
    missing = [pkg for module, pkg in (("jax_cuda12_plugin", "jax-cuda12-plugin"),
                                       ("jax_plugins.xla_cuda12", "jax-cuda12-pjrt"))
               if not _importable(module)]
    if not (_importable("nvidia.cuda_nvcc") or shutil.which("ptxas")):
        missing.append("nvidia-cuda-nvcc-cu12 (ptxas)")
    return missing


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def require_toolchain(target_name: str) -> None:
    missing = missing_toolchain()
    if missing:
        raise ToolchainError(
            f"--target {target_name} compiles for a GPU and needs the GPU compile toolchain: "
            f"pip install -e '.[gpu]' (missing: {', '.join(missing)}), or plan the step on "
            f"XLA:CPU with --target cpu")


def prepare_process() -> None:
    """Before jax starts: keep the CPU backend the default, so that the CUDA plugin skips
    its driver check and the GPU is only a compilation target."""
    os.environ["JAX_PLATFORMS"] = "cpu"


def topology(target: GpuTarget, n_devices: int) -> list[jax.Device]:
    """`n_devices` compile-only GPUs, 4 per host (a JUPITER node); fewer than 4 on one host."""
    from jax.experimental import topologies

    per_host = min(n_devices, GPUS_PER_NODE)
    if n_devices % per_host:
        raise ConfigError(f"--devices {n_devices}: a GPU topology needs a multiple of "
                          f"{GPUS_PER_NODE} GPUs ({GPUS_PER_NODE} per node)")
    desc = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                        topology=f"1x{n_devices // per_host}x{per_host}")
    return list(desc.devices)


def mesh(mesh_cfg: MeshConfig, target: GpuTarget) -> jax.sharding.Mesh:
    """The config's `(data, expert)` mesh over a GPU topology: expert groups are hosts."""
    from europa_jax.parallel import sharding

    if mesh_cfg.devices_per_node != GPUS_PER_NODE:
        raise ConfigError(f"mesh.devices_per_node: {mesh_cfg.devices_per_node}, but a "
                          f"{target.name} node has {GPUS_PER_NODE} GPUs")

    return sharding.make_mesh(mesh_cfg, devices=topology(target, mesh_cfg.n_devices))


@contextlib.contextmanager
def lowering(mesh_: jax.sharding.Mesh):
    """Trace and lower under `mesh_`; on a compile-only GPU mesh, with a target device as
    the default device so that kernel libraries pick their GPU kernels."""
    import jax

    from europa_jax.parallel import sharding

    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.set_mesh(mesh_))
        if sharding.is_compile_only(mesh_):
            stack.enter_context(jax.default_device(mesh_.devices.flat[0]))
        yield


def compile_lowered(lowered, mesh_: jax.sharding.Mesh):
    """`lowered.compile()`, with RUN_XLA_OPTIONS when the mesh is made of GPUs."""
    from jax._src import config as jax_config

    from europa_jax.parallel import sharding

    if sharding.mesh_platform(mesh_) == "gpu":
        # not through the persistent compilation cache: jax 0.12 writes a compile-only
        # GPU program there but cannot load it back (no client: a warning, and a compile)
        with jax_config.enable_compilation_cache(False):
            return lowered.compile(compiler_options=RUN_XLA_OPTIONS)
    return lowered.compile()
