# Environment of a europa-jax rank on GH200 nodes; sourced by launch/jupiter.sbatch (source it
# yourself before an interactive `srun`). A variable already set keeps its value, so a site
# or a run changes one without editing this file, e.g. `NCCL_MAX_CTAS=8 sbatch ...`.

# --- NCCL (GPU collectives)
# The recipe's traffic setting: at most 16 thread blocks per NCCL collective, so that
# communication overlapped with compute leaves most of the 132 SMs to the matmuls.
export NCCL_MAX_CTAS=${NCCL_MAX_CTAS:-16}
# InfiniBand: NCCL picks the HCA nearest each GPU by itself (one per GH200) and uses
# GPUDirect RDMA; these settings only make it ride out fabric hiccups at 384 GPUs instead
# of failing the job: 4.096 µs × 2^22 ≈ 17 s per attempt, 10 attempts.
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-10}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# --- XLA (GPU compiler)
# Overlap: the latency-hiding scheduler moves collectives next to independent compute;
# pipelining issues layer l+1's FSDP all-gather (and layer l-1's reduce-scatter) during
# layer l of the scanned stack, and double buffering lets that cross scan iterations.
# Combining: collectives under 1 GiB are merged into fewer, larger messages (InfiniBand
# pays per message); not by dimension, so differently shaped weights combine too.
# The one-shot ragged all-to-all kernel is slower for the MoE exchange (MaxText, Marin), so
# the exchange runs on NCCL send/recv, which XLA refuses at run time from jax 0.11 on
# ("RaggedAllToAll fallback to NCCL is not allowed") unless allowed by the second flag.
# GEMMs on cuBLAS, not Triton: XLA's Triton GEMM fusion fails to tile some Newton–Schulz
# matmuls when compiled ahead of time.
# Memory slop 400 %: XLA's rematerialization pass counts the pinned-host (offloaded)
# buffers against HBM, cannot meet that, and recomputes kernels for nothing (under this
# file's schedule at 200 %: the expert windows' fusions three times over, 1.0 GB off the
# HBM peak, 3.1 s of memory-bound kernels added per europa-952b step, by the plan).
# `europa-jax plan --target gh200` compiles with exactly these options (plan/program/gpu_target.py).
europa_xla_flags=(
  --xla_gpu_enable_latency_hiding_scheduler=true
  --xla_gpu_enable_highest_priority_async_stream=true
  --xla_gpu_pipeline_all_gather=on
  --xla_gpu_pipeline_reduce_scatter=on
  --xla_gpu_pipeline_all_reduce=on
  --xla_gpu_enable_while_loop_double_buffering=true
  --xla_gpu_all_gather_combine_threshold_bytes=1073741824
  --xla_gpu_reduce_scatter_combine_threshold_bytes=1073741824
  --xla_gpu_all_reduce_combine_threshold_bytes=1073741824
  --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  --xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false
  --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true
  --xla_gpu_enable_triton_gemm=false
  --xla_gpu_memory_limit_slop_factor=400
)
# The caller's XLA_FLAGS come last, so they override these.
export XLA_FLAGS="${europa_xla_flags[*]} ${XLA_FLAGS:-}"
unset europa_xla_flags

# --- Memory
# HBM: XLA preallocates this fraction of the GPU's 96 GB; the rest holds the CUDA context,
# NCCL buffers and library workspaces. (jax refuses the old name and the new one together.)
if [ -z "${XLA_PYTHON_CLIENT_MEM_FRACTION:-}" ]; then
  export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.92}
fi
# Host offload (offload.*): the cap on XLA's pinned host memory pool per GPU (XLA's own
# default is 64 GB; the pool grows as used, so the cap reserves nothing). Each rank is bound
# to its own Grace CPU (jupiter.sbatch), whose LPDDR5X also holds the OS, Python and the
# input pipeline; `europa-jax plan` says how much host memory a layout needs.
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-96}
