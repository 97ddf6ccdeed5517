"""Start jax without the CUDA plugin's driver-missing chatter on machines with no GPU.

With the `gpu` extra installed (it is how the GPU program is compiled on a laptop or CI)
and no NVIDIA driver, loading jax and its PJRT plugins prints, from C++ and before absl's
logging is initialized (so no log-level setting reaches it), four pairs of lines:
"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
and "I… cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be
used." They would bury the one-line errors the commands promise. So the first import of
jax and the plugin registration run with file descriptor 2 captured, and everything
captured except exactly those lines is written back to stderr. Nothing starts a backend
here: the device count, the platform and `jax.distributed.initialize` are still free.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

# (the last one may lack its newline: the next message then starts on the same line)
NOISE = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are "
                   r"written to STDERR\n|I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find "
                   r"cuda drivers on your machine, GPU will not be used\.\n?")


def import_quietly() -> None:
    """Import jax and register its plugins, dropping only the lines NOISE matches."""
    if "jax" in sys.modules:
        return  # already started: whatever it printed is out
    sys.stderr.flush()
    with tempfile.TemporaryFile() as captured:
        saved_fd = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            import jax  # noqa: F401
            from jax._src import xla_bridge

            # the plugins print when jax first looks for backends; register them now
            xla_bridge._discover_and_register_pjrt_plugins()
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        captured.seek(0)
        sys.stderr.write(NOISE.sub("", captured.read().decode(errors="replace")))
    sys.stderr.flush()


def has_nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA kernel driver (so the CUDA plugin can start)."""
    return os.path.exists("/proc/driver/nvidia/version")


def default_to_cpu_without_driver() -> None:
    """With no NVIDIA driver, make CPU the platform unless JAX_PLATFORMS says otherwise:
    the CUDA plugin would otherwise fail its start-up check with a traceback on stderr."""
    if not has_nvidia_driver():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
