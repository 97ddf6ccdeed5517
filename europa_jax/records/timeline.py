"""Where a run's wall time went: `<run_dir>/timeline.jsonl`, one line per finished phase.

Each try of a run (the first start and every restart after a preemption, a crash or a
broken hang) writes a chain of intervals with no gap between them, from the moment its
process began running europa-jax (before jax is imported) to the last thing it finished:

    {"try": 1, "phase": "compile", "start": 1796416271.6, "end": 1796416302.9}
    {"try": 1, "phase": "step", "step": 41, "start": ..., "end": ...}

Phases: `startup` (imports, joining the job, building the trainer, opening the data),
`restore`, `compile`, `step` (one per step: waiting for its batch, the devices' work,
logging it, agreeing on stop requests), `validation`, `checkpoint` (the time the loop
itself spends on saves: the device→host copy and waiting for a write to finish).
`report` turns the file into goodput (goodput.py). Process 0 writes it; every process
keeps the same clock, which is what the hang watchdog reads (watchdog.py).

A try killed without warning (kill -9, a node failure) leaves its chain at the last
phase it finished: the time after it counts as downtime, the steps it ran past its last
checkpoint as lost work.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

import europa_jax

log = logging.getLogger(__name__)

FILE = "timeline.jsonl"
PHASES = ("startup", "restore", "compile", "step", "validation", "checkpoint")


def process_start_time() -> float:
    """When this process began running europa-jax (Unix time): the package's first import,
    before jax's and every other library's (`europa_jax.STARTED_AT`, which says why not
    the kernel's start time). The interpreter's own start before it, tens of
    milliseconds, is not counted."""
    return europa_jax.STARTED_AT


def next_try(run_dir: Path) -> int:
    """The number of this try: one more than the last in the run's timeline (0 if none)."""
    path = Path(run_dir) / FILE
    last = -1
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line)["try"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
    return last + 1


class Timeline:
    """The current phase of this process and, on process 0, the file of finished ones.

    `phase(name, step=...)` ends the phase in progress (writing its line) and starts the
    next at the same instant; listeners (the watchdog) hear of every change.
    """

    def __init__(self, run_dir: Path, enabled: bool, try_index: int,
                 listeners: tuple[Callable[[str, int | None], None], ...] = ()):
        self.path, self.enabled, self.try_index = Path(run_dir) / FILE, enabled, try_index
        self.listeners = list(listeners)
        self.current, self.step, self.started = "startup", None, process_start_time()

    def phase(self, name: str, step: int | None = None) -> float:
        """End the current phase now and start `name`; returns the seconds the ended one took."""
        assert name in PHASES, name
        now = time.time()
        seconds = now - self.started
        if (name, step) == (self.current, self.step):
            return seconds  # the same phase goes on
        self._write(now)
        self.current, self.step, self.started = name, step, now
        for listener in self.listeners:
            listener(name, step)
        return seconds

    def close(self) -> None:
        """End the last phase (the run is leaving the loop, for whatever reason)."""
        self._write(time.time())
        self.current = None

    def _write(self, end: float) -> None:
        if not self.enabled or self.current is None:
            return
        record = {"try": self.try_index, "phase": self.current, "start": self.started,
                  "end": end}
        if self.step is not None:
            record["step"] = self.step
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: the goodput loses phases, the run goes on
            self.enabled = False
            log.warning(f"{self.path}: could not be written ({e.strerror or e}); this try's "
                        "later phases are not recorded (the goodput will miss them)")
