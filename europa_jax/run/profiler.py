"""What the devices did, seen from the loop: a jax.profiler trace of chosen steps, and the
memory the devices hold after the first step (to hold a run against `europa-jax plan`)."""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from europa_jax.config import Config
from europa_jax.parallel import offload

log = logging.getLogger(__name__)


class Profiler:
    """A jax.profiler trace of steps [a, b] (train.profile_steps) into <run_dir>/profile.

    TensorBoard's profile plugin, XProf and Perfetto read it; each process that traces
    writes its own subdirectory, so two processes on one host do not collide.
    """

    def __init__(self, cfg: Config, run_dir: Path):
        steps = cfg.train.profile_steps
        traced = jax.process_index() == 0 or cfg.train.profile_all_processes
        self.first, self.last = steps if steps and traced else (0, -1)
        self.dir = run_dir / "profile" / f"process-{jax.process_index()}"
        self.active = False

    def before(self, step: int) -> None:
        if step == self.first:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir))
            self.active = True
            log.info(f"profiling steps {self.first}-{self.last} into {self.dir}")

    def after(self, step: int) -> None:
        if self.active and step == self.last:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            log.info(f"profile written to {self.dir}")


def memory_report(state) -> dict:
    """Device memory in use and at peak (where the backend reports it) and the train
    state's bytes per device by memory kind, to hold a run against `europa-jax plan`."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    in_use = [s.get("bytes_in_use") for s in stats]
    peak = [s.get("peak_bytes_in_use") for s in stats]
    kinds: dict[str, int] = {}
    for part in offload.state_bytes(state).values():
        for kind, n in part.items():
            kinds[kind] = kinds.get(kind, 0) + n
    return {"state_bytes_per_device": kinds,
            "device_bytes_in_use_max": max(in_use) if None not in in_use else None,
            "device_peak_bytes_max": max(peak) if None not in peak else None,
            "device_bytes_limit": stats[0].get("bytes_limit")}
