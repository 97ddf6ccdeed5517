"""Cheap restarts: the JAX persistent compilation cache, and the train step compiled ahead.

A requeued europa-952b job would otherwise spend minutes compiling the program it
compiled the try before. JAX keeps compiled programs in a directory: chosen here as
`train.compile_cache_dir` when set (`none` turns it off), else `JAX_COMPILATION_CACHE_DIR`
when the launch environment sets it, else `<run_dir>/compile_cache`, which every rank of
the job shares. JAX writes entries from process 0 only; on GPU one entry serves every
rank (the key leaves out the device assignment), on CPU each process's program has its
own key, so only process 0's is found again.

The train step is compiled explicitly, before its first call, and the processes then
meet at the coordination service with a long timeout: a process whose compile was a
cache hit would otherwise wait inside the first step's collectives for the others'
compiles, longer than gloo's own timeout allows on CPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from jax import monitoring

from europa_jax.job import distributed

ENV_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def cache_dir(setting: str, run_dir: Path, env=os.environ) -> Path | None:
    """The directory compiled programs go to (None: no persistent cache)."""
    if setting == "none":
        return None
    if setting:
        return Path(setting)
    if env.get(ENV_CACHE_DIR):
        return Path(env[ENV_CACHE_DIR])
    return Path(run_dir) / "compile_cache"


def use_cache(setting: str, run_dir: Path) -> Path | None:
    """Point JAX's persistent cache at `cache_dir(...)`, before anything is compiled."""
    path = cache_dir(setting, run_dir)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if jax.process_index() == 0:  # the writer; the others only read
        path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path


class _Hits:
    """Counts JAX's persistent-cache hits (a monitoring event per hit)."""

    count = 0
    registered = False

    @classmethod
    def listen(cls) -> None:
        if not cls.registered:
            monitoring.register_event_listener(cls._on_event)
            cls.registered = True

    @classmethod
    def _on_event(cls, event: str, **_kwargs) -> None:
        if event == _HIT_EVENT:
            cls.count += 1


@dataclass(frozen=True)
class Compiled:
    executable: object  # jax.stages.Compiled: call it as the step
    cache_hit: bool
    waited_s: float  # then waiting at the barrier for the job's slowest compile


def compile_step(step_fn, state, batch, *, barrier_timeout_s: int) -> Compiled:
    """Lower and compile `step_fn` for these arguments, then meet the other processes."""
    _Hits.listen()
    hits = _Hits.count
    executable = step_fn.lower(state, batch).compile()
    compiled = time.perf_counter()
    distributed.barrier("europa_step_compiled", barrier_timeout_s)
    return Compiled(executable, _Hits.count > hits, time.perf_counter() - compiled)


def announcement(devices: int, path: Path | None) -> str:
    """The line before the compile. Whether it will be a hit is known only once JAX has
    looked the program up, inside the compile: the line after it says (`outcome`)."""
    where = (f", or read from the compilation cache in {path} if it holds it" if path
             else " (the compilation cache is off)")
    return f"compiling the train step for {devices} devices{where}: the first step waits for it"


def outcome(compiled: Compiled, seconds: float) -> str:
    """The line after the compile phase of `seconds` (the barrier's wait included)."""
    how = "read from the compilation cache" if compiled.cache_hit else "compiled"
    waited = (f", then {compiled.waited_s:.1f} s waiting for the other processes"
              if compiled.waited_s >= 0.1 else "")
    return f"train step {how} in {seconds - compiled.waited_s:.1f} s{waited}"
