"""Faults on purpose, for the tests of what a job does when one of its processes misbehaves.

Set in a process's environment (never by a configuration):
- `EUROPA_JAX_INJECT_DELAY=P:SECONDS` — process P sleeps SECONDS after drawing each
  batch, before its step: a straggler (a slow input pipeline or host).
- `EUROPA_JAX_INJECT_HANG=P:STEP` — process P stops before dispatching step STEP and
  never goes on: a rank stuck short of a collective, which the hang watchdog must break.
- `EUROPA_JAX_INJECT_SPIKE=STEP` — the first time step STEP runs, every process trains it
  on scrambled tokens: a bad batch whose loss spikes, for the spike guard (spikes.py).
- `EUROPA_JAX_INJECT_SIGNAL=PHASE[@STEP]:SIGNAL[,...]` — the process sends itself SIGNAL
  (SIGTERM, SIGUSR1, SIGINT) when it enters PHASE: `startup` (the CLI's handlers just
  installed, before jax starts), or a phase of the run's timeline (`restore`, which
  initializes a run with no checkpoint, `compile`, `step`, `checkpoint`; timeline.py).
  The entries fire in order, each once: `step@3:SIGINT,checkpoint:SIGINT` is a Ctrl-C
  during step 3 and a second one when its save begins (preemption.py). `:stall` after an
  entry (`compile:SIGTERM:stall`) keeps the main thread in one native wait for
  `STALL_S`, its stop signals blocked, as inside XLA's compile: no Python handler runs
  there, and only preemption.py's watcher thread can end the process.
  With `EUROPA_JAX_INJECT_SIGNAL_TRY=N` the entries fire only in try N of a Slurm job
  (`SLURM_RESTART_COUNT`, 0 before any requeue): a stop in the requeued try alone.

Malformed values are a one-line configuration error: a test that meant to inject a fault
and silently did not would pass for the wrong reason.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Mapping

from europa_jax.config import ConfigError

ENV_DELAY = "EUROPA_JAX_INJECT_DELAY"
ENV_HANG = "EUROPA_JAX_INJECT_HANG"
ENV_SPIKE = "EUROPA_JAX_INJECT_SPIKE"
ENV_SIGNAL = "EUROPA_JAX_INJECT_SIGNAL"
ENV_SIGNAL_TRY = "EUROPA_JAX_INJECT_SIGNAL_TRY"
_signals_sent: dict[str, int] = {}  # EUROPA_JAX_INJECT_SIGNAL's value → entries fired
STALL_S = 120.0


def _parse(env: Mapping[str, str], key: str, kind) -> tuple[int, float] | None:
    raw = env.get(key)
    if not raw:
        return None
    try:
        process, value = raw.split(":")
        return int(process), kind(value)
    except ValueError:
        raise ConfigError(f"{key}: {raw!r} is not PROCESS:{kind.__name__.upper()}") from None


class Faults:
    def __init__(self, process_index: int, env: Mapping[str, str] = os.environ):
        delay, hang = _parse(env, ENV_DELAY, float), _parse(env, ENV_HANG, int)
        self.delay_s = delay[1] if delay and delay[0] == process_index else 0.0
        self.hang_step = hang[1] if hang and hang[0] == process_index else None
        raw = env.get(ENV_SPIKE)
        try:
            self.spike_step = int(raw) if raw else None
        except ValueError:
            raise ConfigError(f"{ENV_SPIKE}: {raw!r} is not STEP") from None

    def bad_batch(self, step: int, batch: dict) -> dict:
        """`batch`, or at the spike step (once) its tokens scrambled (t·31 + 7 mod 256:
        text no model predicts), on the devices as they are sharded."""
        if self.spike_step is None or step != self.spike_step:
            return batch
        self.spike_step = None  # a rollback runs the step number again: a good batch then
        return {**batch, "tokens": (batch["tokens"] * 31 + 7) % 256}

    def before_step(self, step: int) -> None:
        """Called after the batch of 1-based `step` is drawn, before it is dispatched."""
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.hang_step is not None and step == self.hang_step:
            threading.Event().wait()  # forever, like a read that never returns


def signal_at(phase: str, step: int | None = None, env: Mapping[str, str] = os.environ) -> None:
    """Send this process the signal of `EUROPA_JAX_INJECT_SIGNAL`'s next entry if it names
    `phase` (and `step`); a Timeline listener (timeline.py), and the CLI's `startup`. The
    signal is sent from the thread that enters the phase: the main thread's handler runs
    at its next Python instruction, deterministically at that point of the run."""
    raw = env.get(ENV_SIGNAL)
    if not raw or not _this_try(env):
        return
    entries = [_signal_entry(entry, raw) for entry in raw.split(",")]
    done = _signals_sent.get(raw, 0)
    if done >= len(entries) or entries[done][:2] not in ((phase, step), (phase, None)):
        return
    _signals_sent[raw] = done + 1
    sig, stall = entries[done][2:]
    if not stall:
        os.kill(os.getpid(), sig)
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [sig])
    threading.Timer(0.1, os.kill, (os.getpid(), sig)).start()  # to another thread, then
    time.sleep(STALL_S)  # one call the signal does not interrupt
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _this_try(env: Mapping[str, str]) -> bool:
    """Whether the signal entries are for this try (EUROPA_JAX_INJECT_SIGNAL_TRY)."""
    only = env.get(ENV_SIGNAL_TRY)
    if only is None:
        return True
    if not only.isdigit():
        raise ConfigError(f"{ENV_SIGNAL_TRY}: {only!r} is not a try number (0, 1, ...)")
    return int(env.get("SLURM_RESTART_COUNT") or 0) == int(only)


def _signal_entry(entry: str, raw: str) -> tuple[str, int | None, signal.Signals, bool]:
    try:
        where, name, *stall = entry.split(":")
        phase, _, step = where.partition("@")
        if stall not in ([], ["stall"]):
            raise ValueError(stall)
        return phase, int(step) if step else None, signal.Signals[name], bool(stall)
    except (ValueError, KeyError):
        raise ConfigError(f"{ENV_SIGNAL}: {raw!r} is not PHASE[@STEP]:SIGNAL[:stall][,...] "
                          "(e.g. compile:SIGTERM)") from None
