"""What the GPU benchmark scripts share: whether a GPU is here, the process set-up a rank
gets from launch/env.sh, best-of-N wall time, one check run so that its failure is
recorded instead of stopping the others, an exception in one line. gpu_check.py,
gpu_regimes.py, gpu_calibration.py and gpu_smoke.py import it; it imports none of them
(jax only inside the functions: the scripts choose the platform before jax starts)."""

from __future__ import annotations

import glob
import os
import time


def timed(fn, *args, repeats: int) -> float:
    """Best wall time of `fn(*args)` after one compile-and-warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def section(results: dict, name: str, fn) -> None:
    """Run one check; an exception (OOM, missing kernel) is recorded, not fatal."""
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - the report must survive any one failure
        results[name] = {"error": one_line(e)}


def gpu_count() -> int:
    """NVIDIA GPUs this Linux machine's driver shows, seen without starting CUDA."""
    return len(glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"))


def gpu_driver_present() -> bool:
    """An NVIDIA GPU and its driver (Linux), seen without starting CUDA."""
    return gpu_count() > 0


def run_as_a_rank() -> None:
    """Before the GPU backend starts: XLA's share of HBM and compiler options as
    launch/env.sh gives a rank and the GPU compile assumes (a variable already set wins):
    the compiled program is the timed one, and its HBM is checked against that share.
    jax's own share, 0.75, leaves an H100 64 GB, about what the layer needs."""
    from europa_jax.plan.program import gpu_target

    if not os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):  # jax refuses both names
        os.environ.setdefault("XLA_CLIENT_MEM_FRACTION",
                              str(gpu_target.TARGETS["gh200"].mem_fraction))
    flags = os.environ.get("XLA_FLAGS", "")
    ours = [gpu_target.xla_flag(k, v) for k, v in gpu_target.RUN_XLA_OPTIONS.items()
            if f"--{k}=" not in flags]
    os.environ["XLA_FLAGS"] = " ".join([*ours, flags]).strip()
