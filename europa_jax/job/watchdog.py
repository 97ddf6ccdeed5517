"""The hang watchdog: a job in which no step completes for too long ends itself for requeue.

On a GPU cluster a rank that stops short of a collective (a stuck file system read, a
deadlocked input thread, a wedged GPU) leaves every other rank waiting in NCCL, which
has no timeout: the job burns its allocation doing nothing until the time limit. Each
process runs a thread that watches the run's phases (timeline.py). When the current
phase has lasted longer than its limit, the thread

1. writes every thread's Python stack (faulthandler) to the process's log, with the
   step and the phase it is in;
2. meets the other processes at the coordination service (its own gRPC channel: not the
   collectives that are stuck) to learn their phases, and process 0 writes one `hang`
   event naming each process's phase; a process that does not arrive in time is named
   as missing;
3. exits with `exit_codes.PREEMPTED`, the code the launch scripts requeue on: the next
   try resumes from the last checkpoint. Processes other than 0 exit first, so that the
   coordination service (process 0) outlives their departure.

The limit: `train.hang_timeout_s` when set, else 10 × the median step time so far, never
below `DERIVED_FLOOR_S`. The start of a try — building the trainer and meeting the other
processes, restore, compile: minutes at full scale, with no step time to go by yet — gets
at least `STARTUP_FLOOR_S`.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
from typing import Callable

from europa_jax.job import distributed, exit_codes, peer_lost

log = logging.getLogger(__name__)

DERIVED_FLOOR_S = 600.0  # a derived limit never below this (a long save, a slow validation)
STEP_MULTIPLE = 10.0  # a derived limit: this many median steps
STARTUP_FLOOR_S = 1800.0  # the start of a try, whatever the limit
STARTUP_PHASES = ("startup", "restore", "compile")
MEET_TIMEOUT_S = 60  # how long a firing watchdog waits for the others at the barrier
STEP_TIMES_KEPT = 101  # the median of the last this-many step times


class HangWatchdog:
    """Watches one process's phases; `fire` ends the process (tests pass `exit`)."""

    def __init__(self, timeout_s: float, *, process_index: int, process_count: int,
                 events=None, before_exit: Callable[[], None] = lambda: None,
                 exit: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic):
        self.fixed_timeout_s = timeout_s if timeout_s > 0 else None
        self.process_index, self.process_count = process_index, process_count
        self.events, self._before_exit = events, before_exit
        self._exit, self._clock = exit, clock
        self.phase, self.step, self.detail = "startup", None, ""
        self.since = clock()
        self.step_times: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ fed by the loop

    def on_phase(self, phase: str, step: int | None) -> None:
        """A Timeline listener: a new phase started now."""
        self.phase, self.step, self.detail, self.since = phase, step, "", self._clock()

    def note(self, detail: str) -> None:
        """Where inside the phase the process is (e.g. 'waiting for the batch'); shown
        when the watchdog fires. Does not reset the clock."""
        self.detail = detail

    def progress(self) -> None:
        """The current phase made progress (a long evaluation's forward pass finished): its
        clock starts again, so only a stretch without progress counts against the limit."""
        self.since = self._clock()

    def step_took(self, seconds: float) -> None:
        self.step_times = (self.step_times + [seconds])[-STEP_TIMES_KEPT:]

    # ------------------------------------------------------------------ the limit

    def timeout_s(self, phase: str | None = None) -> float:
        phase = phase or self.phase
        if self.fixed_timeout_s is not None:
            limit = self.fixed_timeout_s
        elif self.step_times:
            limit = max(DERIVED_FLOOR_S, STEP_MULTIPLE * statistics.median(self.step_times))
        else:
            limit = DERIVED_FLOOR_S
        return max(limit, STARTUP_FLOOR_S) if phase in STARTUP_PHASES else limit

    def overdue(self) -> float | None:
        """Seconds the current phase has run past its limit, None if it has not."""
        over = self._clock() - self.since - self.timeout_s()
        return over if over > 0 else None

    # ------------------------------------------------------------------ the thread

    def start(self) -> "HangWatchdog":
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "HangWatchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            if self.overdue() is not None:
                self.fire()
                return

    def where(self) -> str:
        step = f" {self.step}" if self.step is not None else ""  # "step 41"
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.phase}{step}{detail}"

    def fire(self) -> None:
        """Dump the stacks, meet the others, record the hang, exit for requeue.

        Each part is tried on its own, and the exit comes whatever they met (a log
        handler whose stream is closed, a stderr without a file descriptor, a
        coordination service that is gone): a watchdog that fails to exit is a hang."""
        waited, where = self._clock() - self.since, self.where()
        _try(log.error, f"hang: no progress for {waited:.0f} s (limit {self.timeout_s():.0f} s, "
             f"train.hang_timeout_s) in {where}; every thread's stack follows, then the job "
             f"exits {exit_codes.PREEMPTED} for requeue from the last checkpoint")
        _flush_logs()
        _try(faulthandler.dump_traceback, file=sys.stderr, all_threads=True)
        _flush_logs()
        phases = _try(meet_the_others, self.process_index, self.process_count, where) or {
            self.process_index: where}
        if self.events is not None:  # process 0
            missing = [p for p in range(self.process_count) if p not in phases]
            _try(self.events, "hang",
                 f"hang recorded: processes' phases {phases}; missing {missing}",
                 level=logging.ERROR, step=self.step, phase=self.phase,
                 seconds=round(waited, 1), timeout_s=self.timeout_s(),
                 processes={str(p): phase for p, phase in sorted(phases.items())},
                 missing=missing)
        _try(self._before_exit)  # the timeline's last line: the phase that hung
        _try(peer_lost.leaving)  # the others end by their own watchdogs, not as a lost peer
        if self.process_index == 0 and self.process_count > 1:
            time.sleep(2.0)  # the others leave first: the coordination service is ours
        _flush_logs()
        self._exit(exit_codes.PREEMPTED)


def _try(function, *args, **kwargs):
    """`function(...)`, or None if it raised: a part of firing that failed is skipped."""
    try:
        return function(*args, **kwargs)
    except Exception:  # noqa: BLE001 (nothing may stop the exit)
        return None


def _flush_logs() -> None:
    for stream in [*(getattr(h, "stream", None) for h in logging.getLogger().handlers),
                   sys.stdout, sys.stderr]:
        if stream is not None:
            _try(stream.flush)


def meet_the_others(process_index: int, process_count: int, where: str) -> dict[int, str]:
    """Every process's phase, through the coordination service's key-value store and a
    barrier with a timeout; {this process: where} when there is no job to meet."""
    if process_count == 1:
        return {process_index: where}
    client = distributed.coordination_client()
    if client is None:
        return {process_index: where}
    try:
        client.key_value_set(f"europa_hang/{process_index}", where, allow_overwrite=True)
        client.wait_at_barrier("europa_hang", MEET_TIMEOUT_S * 1000)
    except Exception as e:  # a process never arrived (dead, or its watchdog cannot run)
        log.error(f"hang: not every process arrived within {MEET_TIMEOUT_S} s: "
                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
    try:
        return {int(key.rsplit("/", 1)[1]): value
                for key, value in client.key_value_dir_get("europa_hang/")}
    except Exception:
        return {process_index: where}
