"""What a run writes about itself: metrics.jsonl, the trackers, events.jsonl, log lines.

Process 0 writes the files; every process logs (logs.py puts its rank on each line).
- `metrics.jsonl`: one JSON object per logged step (and one per validation), the record
  `report.py` and tests read; after a resume it keeps the lines up to the resumed step.
- the trackers `train.trackers` names (trackers.py): TensorBoard event files beside it
  and/or a Weights & Biases run, each given every record.
- `events.jsonl`: checkpoints (started, written, failed), resumes, preemption, non-finite
  steps, memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from europa_jax.run import stragglers, trackers as trackers_lib

log = logging.getLogger(__name__)


class MetricsLog(contextlib.AbstractContextManager):
    """Appends records to metrics.jsonl and hands them to the trackers; a no-op on
    processes other than 0."""

    def __init__(self, run_dir: Path, start_step: int, enabled: bool, config: dict,
                 trackers: tuple[str, ...] = ("tensorboard",)):
        self.enabled = enabled
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        kept = []
        if start_step and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
        self._file = path.open("w")
        self._file.writelines(line + "\n" for line in kept)
        self._file.flush()
        self._trackers = [trackers_lib.TRACKERS[name](run_dir, start_step, config)
                          for name in trackers]

    def __call__(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self._trackers:
            tracker.log(record)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.enabled:
            self._file.close()
            for tracker in self._trackers:
                tracker.close(exc)


class EventLog:
    """Checkpoint, resume, preemption, non-finite and memory events: the log and events.jsonl."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path, self.enabled = run_dir / "events.jsonl", enabled

    def __call__(self, event: str, message: str | None = None, *, level: int = logging.INFO,
                 **fields) -> None:
        """Record `event` with `fields`; the log line is `message` or `event k=v ...`."""
        if not self.enabled:
            return
        record = {"event": event, **fields, "time": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.log(level, message or " ".join([event, *(f"{k}={v}" for k, v in fields.items())]))


def gigabytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.3f} GB"


def memory_line(step: int, memory: dict) -> str:
    """The memory event (loop.memory_report) as a sentence to hold against `plan`."""
    state = ", ".join(f"{kind} {gigabytes(n)}"
                      for kind, n in memory["state_bytes_per_device"].items())
    if memory["device_bytes_in_use_max"] is None:
        device = "device memory in use: not reported by this backend"
    else:
        device = (f"device memory in use {gigabytes(memory['device_bytes_in_use_max'])}, peak "
                  f"{gigabytes(memory['device_peak_bytes_max'])} of "
                  f"{gigabytes(memory['device_bytes_limit'])} (largest of this process's "
                  "devices)")
    return f"memory after step {step}: train state per device: {state}; {device}"


def step_line(record: dict, total: int) -> str:
    """The log line of a logged step: what a Slurm log reader needs to judge the run."""
    line = (f"step {record['step']}/{total} loss {record['loss']:.4f} "
            f"grad_norm {record['grad_norm']:.3f} lr {record['lr']:.2e} "
            f"step {record['step_time_s']:.3f} s "
            f"tokens/s/device {record['tokens_per_s_per_device']:,.0f} "
            f"mfu {100 * record['mfu']:.2f}%")
    if "slowest_process" in record:  # stragglers.py
        line += f" {stragglers.line(record)}"
    # the step is compiled before it, but its first run still warms up (allocations, autotuning)
    return line + (" (first step of this try)" if record.get("compiled") else "")


class _AboveBar:
    """A log handler's stream while a bar is shown: each line is written above the bar
    (tqdm.write clears and redraws it) instead of glued to its end."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


def _open_bar(total: int, initial: int):
    from tqdm import tqdm

    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
            handler.setStream(_AboveBar(handler.stream))
    return tqdm(total=total, initial=initial, unit="step")


def _close_bar(bar) -> None:
    if bar is not None:
        bar.close()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and isinstance(handler.stream, _AboveBar):
            handler.setStream(handler.stream.stream)


def progress(total: int):
    """A tqdm bar on a terminal, updated every step; `logged(record)` logs a line otherwise
    (and on a terminal only with --verbose, so the bar stays readable)."""
    if sys.stderr.isatty():
        bar = None

        def update(step, metrics):
            nonlocal bar
            if step is None:
                return _close_bar(bar)
            if bar is None:  # made after the first step: its rate, not the compile, sets the ETA
                bar = _open_bar(total, step)  # the steps done before this one
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", refresh=False)
            bar.update(1)

        def logged(record):
            log.debug(step_line(record, total))

        return update, logged

    def logged(record):
        log.info(step_line(record, total))

    return (lambda step, metrics: None), logged
