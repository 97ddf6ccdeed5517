"""Start jax on machines with no GPU although the `gpu` extra (the CUDA plugin) is installed.

That is how the GPU program is compiled on a laptop or in CI. Without an NVIDIA driver the
CUDA plugin fails its start-up check (`cuInit` failed, a traceback on stderr) unless CPU is
the platform, so every command but `plan` (which sets it itself) defaults to CPU there.
(jax 0.10's plugin also printed C++ chatter about the missing driver before any logging
could be set, which was filtered here; jax 0.12's prints none.)
"""

from __future__ import annotations

import os


def has_nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA kernel driver (so the CUDA plugin can start)."""
    return os.path.exists("/proc/driver/nvidia/version")


def default_to_cpu_without_driver() -> None:
    """With no NVIDIA driver, make CPU the platform unless JAX_PLATFORMS says otherwise:
    the CUDA plugin would otherwise fail its start-up check with a traceback on stderr."""
    if not has_nvidia_driver():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
