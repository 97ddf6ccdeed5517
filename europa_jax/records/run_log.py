"""What a run writes about itself: metrics.jsonl, the trackers, events.jsonl, log lines.

Process 0 writes the files; every process logs (logs.py puts its rank on each line).
- `metrics.jsonl`: one JSON object per logged step (and one per validation), the record
  `report.py` and tests read; after a resume it keeps the lines up to the resumed step
  (the steps after it run again). A line a kill cut short is dropped on the next start.
- the trackers `train.trackers` names (trackers.py): TensorBoard event files beside it
  and/or a Weights & Biases run, each given every record.
- `events.jsonl`: checkpoints (started, written, failed), resumes, preemption, non-finite
  steps, memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from europa_jax.records import stragglers, trackers as trackers_lib

log = logging.getLogger(__name__)


class RunLogFailed(Exception):
    """metrics.jsonl or events.jsonl could not be written (a full disk): the run stops as
    for a failed save; one line."""


def open_for_records(path: Path):
    """The file a run's records are appended to (a seam the fault tests wrap)."""
    return path.open("a")


def readable_lines(path: Path) -> list[str]:
    """The file's lines, a last line cut short by a kill (no JSON, no newline) dropped with
    a warning and cut from the file, so the next record starts a line of its own."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            log.warning(f"{path}: its last line was cut short (the process stopped while "
                        f"writing it): dropped ({len(lines[-1])} characters)")
            lines.pop()
            path.write_text("".join(line + "\n" for line in lines))
    return lines


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record.get("step", 0) if isinstance(record, dict) else None


class MetricsLog(contextlib.AbstractContextManager):
    """Appends records to metrics.jsonl and hands them to the trackers; a no-op on
    processes other than 0. A write that fails raises `RunLogFailed` once; later records
    go to the trackers only."""

    def __init__(self, run_dir: Path, start_step: int, enabled: bool, config: dict,
                 trackers: tuple[str, ...] = ("tensorboard",)):
        self.enabled = enabled
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
        kept = []
        if start_step and self.path.exists():
            # steps past the restored one run again: their records are the rerun's
            # (a line that is not JSON stays: nothing says which step it was)
            kept = [line for line in readable_lines(self.path)
                    if line.strip()
                    and ((step := _step_of(line)) is None or step <= start_step)]
        self._file, self._broken = None, False
        try:
            self.path.write_text("".join(line + "\n" for line in kept))
            self._file = open_for_records(self.path)
        except OSError as e:
            self._fail(e)
        self._trackers = [trackers_lib.TRACKERS[name](run_dir, start_step, config)
                          for name in trackers]

    def _fail(self, error: OSError):
        self._broken = True
        raise RunLogFailed(f"{self.path}: could not be written ({error.strerror or error}); "
                           "the run stops: its checkpoints are kept and the same command "
                           "resumes once the disk has room") from None

    def __call__(self, record: dict) -> None:
        if not self.enabled:
            return
        if not self._broken:
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            except OSError as e:
                self._fail(e)
        for tracker in self._trackers:
            tracker.log(record)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.enabled:
            if self._file is not None:
                with contextlib.suppress(OSError):  # a broken file's buffer cannot go out
                    self._file.close()
            for tracker in self._trackers:
                tracker.close(exc)


class EventLog:
    """Checkpoint, resume, preemption, non-finite and memory events: the log and events.jsonl.

    A write that fails raises `RunLogFailed` once; later events are log lines only."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path, self.enabled, self._broken = run_dir / "events.jsonl", enabled, False
        if enabled and self.path.exists():
            readable_lines(self.path)  # a line cut short by a kill does not glue to the next

    def __call__(self, event: str, message: str | None = None, *, level: int = logging.INFO,
                 **fields) -> None:
        """Record `event` with `fields`; the log line is `message` or `event k=v ...`."""
        if not self.enabled:
            return
        log.log(level, message or " ".join([event, *(f"{k}={v}" for k, v in fields.items())]))
        if self._broken:
            return
        record = {"event": event, **fields, "time": time.time()}
        try:
            with open_for_records(self.path) as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            self._broken = True
            raise RunLogFailed(f"{self.path}: could not be written ({e.strerror or e}); the "
                               "run stops: its checkpoints are kept and the same command "
                               "resumes once the disk has room") from None


def gigabytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.3f} GB"


def memory_line(step: int, memory: dict) -> str:
    """The memory event (profiler.memory_report) as a sentence to hold against `plan`."""
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


MIN_BAR_COLUMNS = 40  # "12/200 [00:03<00:50, 3.5step/s, loss=2.345]" needs about this


def terminal_columns() -> int:
    """stderr's terminal width (0 when it cannot be read)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def progress(total: int):
    """A tqdm bar on a terminal, updated every step; `logged(record)` logs a line otherwise
    (and on a terminal only with --verbose, so the bar stays readable). A terminal too
    narrow for a bar (a pseudo-terminal nobody sized reports 0 columns) gets the lines."""
    if sys.stderr.isatty() and terminal_columns() >= MIN_BAR_COLUMNS:
        bar = None

        def update(step, metrics):
            nonlocal bar
            if step is None:
                return _close_bar(bar)
            if bar is None:  # made after the first step: its rate, not the compile, sets the ETA
                bar = _open_bar(total, step)  # the steps done before this one
            elif step < bar.n:  # a spike's rollback: the bar goes back with the step count
                bar.n = bar.last_print_n = step  # (the rate is of the steps since)
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", refresh=False)
            bar.update(1)

        def logged(record):
            log.debug(step_line(record, total))

        return update, logged

    def logged(record):
        log.info(step_line(record, total))

    return (lambda step, metrics: None), logged
