"""How long a try took to reach its first step: process start to the trainer, restore or
initialize, the compile (or the compile cache's hit) and the wait for the job, the first
step — the `start_phases` event and its line (step_hooks.FirstStepReport)."""

from __future__ import annotations

from europa_jax.job import distributed
from europa_jax.store import compile_cache


class StartPhases:
    """How long this try took to reach its first step: the `start_phases` event."""

    def __init__(self, startup_s: float):
        self.startup_s, self.restore_s, self.compile_s = startup_s, None, None
        self.restored = False  # a fresh start initializes instead
        self.compile_cache_hit, self.compile_wait_s, self.first_step_s = None, None, None

    def compile(self, compiled: compile_cache.Compiled, phase_s: float) -> None:
        self.compile_s, self.compile_cache_hit = phase_s, compiled.cache_hit
        self.compile_wait_s = compiled.waited_s

    def fields(self) -> dict:
        return {"startup_s": self.startup_s, "distributed_join_s": distributed.join_seconds(),
                "restored": self.restored, "restore_s": self.restore_s,
                "compile_s": self.compile_s,
                "compile_cache_hit": self.compile_cache_hit,
                "compile_wait_s": self.compile_wait_s, "first_step_s": self.first_step_s}

    def line(self, step: int) -> str:
        joined = distributed.join_seconds()
        joined = f" (joining the job {joined:.1f} s)" if joined is not None else ""
        cache = "a compile-cache hit" if self.compile_cache_hit else "compiled"
        return (f"start: process start to the trainer {self.startup_s:.1f} s{joined}, "
                f"{'restore' if self.restored else 'initialize'} {self.restore_s:.1f} s, "
                f"compile {self.compile_s:.1f} s ({cache}; "
                f"then {self.compile_wait_s:.1f} s waiting for the job), first step "
                f"{self.first_step_s:.2f} s (step {step})")
