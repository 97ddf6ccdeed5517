"""A run directory's history is never discarded by a retry.

A run that once saved a checkpoint and now has none it can use (all set aside as
corrupt, or deleted) must not start again from step 0 by itself: a requeue would do that
silently, and the new run's records would replace the old ones. Such a start is refused
in one line naming what the directory holds, unless `europa-jax train --start-over` asks
for it; then the old `metrics.jsonl` is kept beside the new one
(`metrics.before-start-over-<time>.jsonl`) and events.jsonl (append-only) says so.

A run that never saved a checkpoint (killed before its first) starts at step 0 as
before: it has nothing to go back to, and the steps it logged are run again.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from europa_jax.store.saved_checkpoints import CORRUPT_SUBDIR

START_OVER_FLAG = "--start-over"


class HistoryWouldBeLost(Exception):
    """A start at step 0 in a directory whose checkpoints are gone; one line."""


def saved_before(run_dir: Path) -> list[str]:
    """What says this directory once held a checkpoint: set-aside checkpoints, saves in
    events.jsonl. Empty if nothing does."""
    found = []
    corrupt = sorted(p.name for p in (run_dir / CORRUPT_SUBDIR).glob("*")) \
        if (run_dir / CORRUPT_SUBDIR).is_dir() else []
    if corrupt:
        found.append(f"{len(corrupt)} checkpoint(s) set aside in {run_dir / CORRUPT_SUBDIR} "
                     f"({', '.join(corrupt[:3])}{', …' if len(corrupt) > 3 else ''})")
    saved = _saved_steps(run_dir / "events.jsonl")
    if saved:
        found.append(f"saves of step {', '.join(map(str, saved[-3:]))} in events.jsonl")
    logged = _line_count(run_dir / "metrics.jsonl")
    if found and logged:
        found.append(f"{logged} records in metrics.jsonl")
    return found


def check_start(run_dir: Path, start_over: bool) -> list[str]:
    """Called when no usable checkpoint exists, before anything is written: raises
    `HistoryWouldBeLost` if the directory once held one and `start_over` is not given;
    returns what was found (empty: a fresh directory or one that never saved)."""
    found = saved_before(run_dir)
    if found and not start_over:
        raise HistoryWouldBeLost(
            f"{run_dir}: no usable checkpoint, but this run saved before ({'; '.join(found)}): "
            f"not starting again from step 0 by itself; to do that here, keeping the history, "
            f"pass {START_OVER_FLAG} (or give another --run-dir)")
    return found


def keep_old_metrics(run_dir: Path) -> Path | None:
    """For a deliberate start-over: the old metrics.jsonl moved aside, not overwritten."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    target = run_dir / f"metrics.before-start-over-{datetime.datetime.now():%Y%m%d%H%M%S}.jsonl"
    path.rename(target)
    return target


def _saved_steps(events_path: Path) -> list[int]:
    steps = []
    if not events_path.is_file():
        return steps
    for line in events_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(record, dict) and record.get("event") == "checkpoint_saved":
            steps.append(record.get("step"))
    return steps


def _line_count(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
