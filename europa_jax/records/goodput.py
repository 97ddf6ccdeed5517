"""Goodput: the share of a run's wall time that trained, and where the rest went.

Read from `<run_dir>/timeline.jsonl` (timeline.py): every try's chain of phases. The wall
time runs from the first try's process start to the end of the last phase any try
recorded, and splits into

- **training steps**: for each step, the step phases of the last try that ran it;
- **lost work**: step phases of a try whose steps a later try ran again (the steps past
  the last checkpoint before a kill, a crash or a broken hang);
- **startup** (imports, joining the job, building the trainer, opening the data),
  **restore** (or initialization, on a fresh start), **compile**, **checkpoint** (the
  loop's time on saves), **validation**;
- **downtime**: from the end of a try's last recorded phase to the start of the next
  try's process (the queue, the scheduler's restart, and whatever the ended try did after
  its last recorded phase: for a kill -9, the phase it was in);
- **unaccounted**: what is left; gaps inside a try's chain. A run's timeline has none
  but clock rounding, so its size is the check that the parts add up.

Goodput is training steps / wall time.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from europa_jax.records import timeline

# The parts in the order reported: (key, label).
PARTS = (
    ("training_steps", "training steps"),
    ("lost_work", "lost work (steps run again)"),
    ("startup", "startup"),
    ("restore", "restore or initialization"),
    ("compile", "compile"),
    ("checkpoint", "checkpoint stalls"),
    ("validation", "validation"),
    ("downtime", "downtime between tries"),
    ("unaccounted", "unaccounted"),
)


class TimelineError(Exception):
    """The timeline file holds something that is not a phase record."""


def read_timeline(path: Path) -> list[dict]:
    """The phase records. A line that is not JSON is skipped (a try killed while writing
    it); a JSON line that is not a phase record is an error."""
    records = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(record, dict) and record.get("phase") in timeline.PHASES
                and all(_is_number(record.get(k)) for k in ("try", "start", "end"))):
            raise TimelineError(f"{path}, line {i + 1}: expected a phase record "
                                f"{{try, phase, start, end}} with a phase of "
                                f"{', '.join(timeline.PHASES)}, found {line[:120]!r}")
        records.append(record)
    return records


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def goodput(records: list[dict]) -> dict | None:
    """The breakdown of the run's wall time (seconds per part); None for no records."""
    if not records:
        return None
    tries: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        tries[int(record["try"])].append(record)
    order = sorted(tries, key=lambda t: min(r["start"] for r in tries[t]))
    wall_start = min(r["start"] for r in records)
    wall_end = max(r["end"] for r in records)
    last_try_of_step: dict[int, int] = {}
    for t in order:  # later tries overwrite: the step the run kept
        for r in tries[t]:
            if r["phase"] == "step":
                last_try_of_step[int(r["step"])] = t
    parts = dict.fromkeys((key for key, _ in PARTS), 0.0)
    kept_steps, lost_steps = set(), set()
    per_try = []
    previous_end = None
    for t in order:
        chain = sorted(tries[t], key=lambda r: r["start"])
        start, end = chain[0]["start"], max(r["end"] for r in chain)
        for r in chain:
            seconds = r["end"] - r["start"]
            if r["phase"] != "step":
                parts[r["phase"]] += seconds
            elif last_try_of_step[int(r["step"])] == t:
                parts["training_steps"] += seconds
                kept_steps.add(int(r["step"]))
            else:
                parts["lost_work"] += seconds
                lost_steps.add((t, int(r["step"])))
        if previous_end is not None:
            parts["downtime"] += max(0.0, start - previous_end)
        previous_end = end if previous_end is None else max(previous_end, end)
        steps = sorted({int(r["step"]) for r in chain if r["phase"] == "step"})
        per_try.append({"try": t, "start_s": start - wall_start, "seconds": end - start,
                        "first_step": steps[0] if steps else None,
                        "last_step": steps[-1] if steps else None,
                        "compile_s": sum(r["end"] - r["start"] for r in chain
                                         if r["phase"] == "compile")})
    wall = wall_end - wall_start
    parts["unaccounted"] = wall - sum(v for k, v in parts.items() if k != "unaccounted")
    return {"wall_s": wall, "goodput": parts["training_steps"] / wall if wall > 0 else None,
            "parts_s": parts, "tries": per_try, "steps_kept": len(kept_steps),
            "steps_lost": len(lost_steps)}


def run_goodput(run_dir: str | Path) -> dict | None:
    """`goodput` of the run's timeline.jsonl; None when the run has none (an older run)."""
    path = Path(run_dir) / timeline.FILE
    return goodput(read_timeline(path)) if path.is_file() else None


def format_goodput(g: dict | None) -> list[str]:
    """summary.txt's lines for it."""
    if g is None:
        return ["goodput: n/a (no timeline.jsonl)"]
    share = "n/a" if g["goodput"] is None else f"{g['goodput']:.1%}"
    tries = f"{len(g['tries'])} {'try' if len(g['tries']) == 1 else 'tries'}"
    lines = [f"goodput: {share} of {_duration(g['wall_s'])} wall time trained ({tries}, "
             f"first start to last phase; {g['steps_kept']} steps kept, {g['steps_lost']} "
             "run again)"]
    width = max(len(label) for _, label in PARTS)
    for key, label in PARTS:
        seconds = g["parts_s"][key]
        share = seconds / g["wall_s"] if g["wall_s"] > 0 else math.nan
        lines.append(f"  {label:<{width}} {_duration(seconds):>10} {share:6.1%}")
    for t in g["tries"]:
        steps = ("no steps" if t["first_step"] is None
                 else f"steps {t['first_step']}–{t['last_step']}")
        lines.append(f"  try {t['try']}: at +{_duration(t['start_s'])}, "
                     f"{_duration(t['seconds'])}, {steps}, compile {_duration(t['compile_s'])}")
    return lines


def _duration(seconds: float) -> str:
    if abs(seconds) < 600:
        return f"{seconds:.1f} s"
    if abs(seconds) < 36000:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
