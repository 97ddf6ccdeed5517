"""An offline report of a training run directory: PNG plots and a text summary.

Reads `<run_dir>/metrics.jsonl` (training records, `val_*` validation records and
`eval/<task>/<metric>` downstream-task records, as loop.py writes them), and, when
present, `events.jsonl` (checkpoint, resume, preemption, non-finite events), `config.json`
and `timeline.jsonl` (the goodput, goodput.py). Writes to `<run_dir>/report/` (or
`out_dir`): loss.png, lr.png, grad_norm.png, throughput.png, experts.png,
attention_balance.png, eval_tasks.png — each skipped when the run has none of its data —
and summary.txt.

The plots are report_plots.py's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from europa_jax.records import goodput

# metrics.jsonl keys of the downstream tasks (europa_jax/eval/harness.py writes them)
TASK_PREFIX = "eval/"
# What a run writes before its first step: its report then says n/a where it has no steps
RUN_STARTED_FILES = ("config.json", "events.jsonl", "timeline.jsonl")
# (label, steps, values) of one plotted line; only finite points.
Line = tuple[str, list[int], list[float]]
# (y label, lines, log y scale when every value is positive)
Panel = tuple[str, list[Line], bool]


class ReportError(Exception):
    """The run directory or one of its files cannot be read as a run."""


@dataclass(frozen=True)
class Run:
    train: list[dict]
    validation: list[dict]
    events: list[dict]
    config: dict | None
    goodput: dict | None = None  # goodput.py's breakdown of timeline.jsonl
    tasks: list[dict] = dataclasses.field(default_factory=list)  # train.eval_tasks' records


# ----------------------------------------------------------------------------- reading

def _read_jsonl(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)  # accepts the NaN/Infinity that json.dumps writes
        except json.JSONDecodeError as e:
            record, error = None, e.msg
        else:
            error = "not a JSON object"
        if not isinstance(record, dict):
            if i == last:  # a live run may be mid-write on its last line
                break
            raise ReportError(f"{path}, line {i + 1}: {error}")
        records.append(record)
    return records


def _step(record: dict) -> int | None:
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return int(step)


def _last_per_step(records: list[dict]) -> list[dict]:
    """After a resume, steps are logged again: the later record is the one the run kept."""
    by_step = {step: r for r in records if (step := _step(r)) is not None}
    return [by_step[step] for step in sorted(by_step)]


def load_run(run_dir: str | Path) -> Run:
    """The run's records, one per (kind, step) — the last logged — sorted by step."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory (expected one with metrics.jsonl)")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() and not any((run_dir / f).is_file() for f in RUN_STARTED_FILES):
        raise ReportError(f"{metrics}: not found (expected the run's training metrics)")
    records = _read_jsonl(metrics) if metrics.is_file() else []  # before its first step
    is_task = [any(k.startswith(TASK_PREFIX) for k in r) for r in records]
    is_val = [any(k.startswith("val_") for k in r) and not t for r, t in zip(records, is_task)]
    events_path, config_path = run_dir / "events.jsonl", run_dir / "config.json"
    config = None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ReportError(f"{config_path}: not valid JSON ({e})") from None
    kinds = list(zip(records, is_val, is_task))
    return Run(train=_last_per_step([r for r, v, t in kinds if not (v or t)]),
               validation=_last_per_step([r for r, v, _ in kinds if v]),
               events=_read_jsonl(events_path) if events_path.is_file() else [],
               config=config if isinstance(config, dict) else None,
               goodput=_goodput(run_dir),
               tasks=_last_per_step([r for r, _, t in kinds if t]))


def _goodput(run_dir: Path) -> dict | None:
    try:
        return goodput.run_goodput(run_dir)
    except goodput.TimelineError as e:
        raise ReportError(str(e)) from None


# ----------------------------------------------------------------------------- values

def _num(value: Any) -> float | None:
    """A finite float, or None for a missing, NaN or non-numeric value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _line(records: list[dict], key: str, label: str = "",
          get: Callable[[dict], Any] | None = None) -> Line:
    points = [(_step(r), v) for r in records
              if (v := _num(get(r) if get else r.get(key))) is not None]
    return label or key, [s for s, _ in points], [v for _, v in points]


def _layer_lines(records: list[dict], key: str, names: Callable[[int], str] | None = None
                 ) -> list[Line]:
    """One line per entry of the per-layer list `key`, labelled `names(i)`."""
    lists = [r[key] for r in records if isinstance(r.get(key), list)]
    layers = max(map(len, lists), default=0)
    return [_line(records, key, (names or _layer_name(None, 0))(i),
                  lambda r, i=i: r[key][i] if isinstance(r.get(key), list) and len(r[key]) > i
                  else None)
            for i in range(layers)]


def _config_section(run: Run, name: str) -> dict:
    section = (run.config or {}).get(name)
    return section if isinstance(section, dict) else {}


def _layer_name(model: dict | None, first: int) -> Callable[[int], str]:
    """Entry i of a per-layer list that starts at model layer `first` (the MoE layers'
    lists start after the dense ones) and ends with the MTP modules' blocks: the same
    numbers in every plot, the model's own (`layer 0` is the first decoder layer)."""
    n_layers = (model or {}).get("n_layers")

    def name(i: int) -> str:
        layer = first + i
        if isinstance(n_layers, int) and layer >= n_layers:
            return f"MTP {layer - n_layers + 1}"
        return f"layer {layer}"

    return name


def _moe_layer_name(run: Run) -> Callable[[int], str]:
    model = _config_section(run, "model")
    dense = model.get("n_dense_layers")
    return _layer_name(model, dense if isinstance(dense, int) else 0)


def _timed(run: Run) -> list[dict]:
    """The first step of each try (its records say `compiled`) warms up: not a step time."""
    return [r for r in run.train if not r.get("compiled")]


def _median(records: list[dict], key: str) -> float | None:
    values = _line(records, key)[2]
    return statistics.median(values) if values else None


def _task_scores(record: dict) -> dict[str, float]:
    """`{"task/metric": value}` of a downstream-task record."""
    return {k[len(TASK_PREFIX):]: v for k, v in record.items()
            if k.startswith(TASK_PREFIX) and _num(v) is not None}


# ----------------------------------------------------------------------------- summary

def summarize(run: Run) -> dict:
    """The summary fields of `write_report`, without the plot lists."""
    steps = [r["step"] for r in run.train]
    losses, mtp = _line(run.train, "loss"), _line(run.train, "mtp_loss")
    val = _line(run.validation, "val_loss")
    best = min(zip(val[2], val[1]), default=(None, None))  # ties: the earlier step
    data = (run.config or {}).get("data") or {}
    batch, seq_len = _num(data.get("global_batch_size")), _num(data.get("seq_len"))
    nonfinite = {r["step"] for r in run.train
                 if r.get("finite") == 0 or ("loss" in r and _num(r["loss"]) is None)}
    nonfinite |= {s for e in run.events if e.get("event") == "nonfinite"
                  and (s := _step(e)) is not None}
    saved, failed = set(), set()  # a failed save is not a checkpoint, even if started
    for e in run.events:
        if (step := _step(e)) is not None and e.get("event") == "checkpoint_saving":
            saved.add(step)
        elif step is not None and e.get("event") == "checkpoint_failed":
            saved.discard(step)
            failed.add(step)
    return {
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "steps_logged": len(steps),
        "validation_records": len(run.validation),
        "tokens_seen": int(steps[-1] * batch * seq_len) if steps and batch and seq_len else None,
        "last_loss": losses[2][-1] if losses[1] else None,
        "last_loss_step": losses[1][-1] if losses[1] else None,
        "last_mtp_loss": mtp[2][-1] if mtp[1] else None,
        "best_val_loss": best[0],
        "best_val_step": best[1],
        "median_step_time_s": _median(_timed(run), "step_time_s"),
        "median_tokens_per_s_per_device": _median(_timed(run), "tokens_per_s_per_device"),
        "median_mfu": _median(_timed(run), "mfu"),
        "checkpoints_saved": sorted(saved),
        "checkpoints_failed": sorted(failed),
        **_tries(run),
        "preemptions": sum(e.get("event") == "preempted" for e in run.events),
        "nonfinite_steps": sorted(nonfinite),
        "eval_tasks_step": _step(run.tasks[-1]) if run.tasks else None,
        "eval_tasks": _task_scores(run.tasks[-1]) if run.tasks else {},
        "goodput": run.goodput,
    }


def _tries(run: Run) -> dict:
    """Tries, restarts (tries after the first) and spike rollbacks (spikes.py).

    A rollback restores a checkpoint within its try (a `checkpoint_restored` event like a
    resume's) and runs the steps after it again: counted as a rollback and the steps it
    cost, not as a restart. The tries are the timeline's; without one, the resumes."""
    rollbacks = [{"step": step, "to": int(to), "steps_lost": step - int(to)}
                 for e in run.events if e.get("event") == "loss_spike"
                 and (step := _step(e)) is not None
                 and _num(to := e.get("rolled_back_to")) is not None]
    restored = sum(e.get("event") == "checkpoint_restored" for e in run.events)
    resumes = max(0, restored - sum(r["to"] > 0 for r in rollbacks))  # to 0: no restore
    tries = len(run.goodput["tries"]) if run.goodput and run.goodput.get("tries") else None
    excursions = sorted({s for e in run.events if e.get("event") == "grad_norm_spike"
                         and (s := _step(e)) is not None})
    return {"tries": tries, "restarts": tries - 1 if tries else resumes,
            "rollbacks": rollbacks, "grad_norm_excursions": excursions}


def _rollbacks_line(rollbacks: list[dict]) -> str:
    if not rollbacks:
        return "spike rollbacks: none"
    lost = sum(r["steps_lost"] for r in rollbacks)
    return (f"spike rollbacks: {len(rollbacks)}, {lost} steps run again ("
            + ", ".join(f"step {r['step']} → {r['to']}" for r in rollbacks) + ")")


def _fmt(value: Any, spec: str = ".4g", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) or "none"


def format_summary(summary: dict) -> str:
    """summary.txt: one `name: value` line per field, n/a where the run has no data."""
    s = summary
    lines = [
        f"steps logged: {_fmt(s['first_step'], 'd')}–{_fmt(s['last_step'], 'd')} "
        f"({s['steps_logged']} records, {s['validation_records']} validation)",
        f"tokens seen: {_fmt(s['tokens_seen'], ',d')}",
        f"last loss: {_fmt(s['last_loss'])} (step {_fmt(s['last_loss_step'], 'd')})"
        + (f", MTP loss {_fmt(s['last_mtp_loss'])}" if s.get("last_mtp_loss") is not None
           else ""),
        f"best val loss: {_fmt(s['best_val_loss'])} (step {_fmt(s['best_val_step'], 'd')})",
        f"median step time: {_fmt(s['median_step_time_s'], '.4g', ' s')} (compiled steps excluded)",
        f"median tokens/s/device: {_fmt(s['median_tokens_per_s_per_device'], ',.0f')}",
        f"median MFU: {_fmt(s['median_mfu'], '.2%')}",
        f"checkpoints saved: {_steps(s['checkpoints_saved'])}",
        f"checkpoints failed: {_steps(s['checkpoints_failed'])}",
        f"restarts: {s['restarts']}"
        + (f" ({s['tries']} {'try' if s['tries'] == 1 else 'tries'})" if s.get("tries") else ""),
        _rollbacks_line(s.get("rollbacks", [])),
        "gradient-norm excursions (logged, not rolled back): "
        + _steps(s.get("grad_norm_excursions", [])),
        f"preemptions: {s['preemptions']}",
        f"non-finite steps: {_steps(s['nonfinite_steps'])}",
        _tasks_line(s),
        *goodput.format_goodput(s.get("goodput")),
    ]
    if "plots" in s:
        lines.append(f"plots: {', '.join(s['plots']) or 'none'}")
    if s.get("skipped_plots"):
        lines.append(f"skipped plots (no data): {', '.join(s['skipped_plots'])}")
    return "\n".join(lines) + "\n"


def _tasks_line(summary: dict) -> str:
    scores = summary.get("eval_tasks") or {}
    if not scores:
        return "downstream tasks: n/a"
    return (f"downstream tasks (step {summary['eval_tasks_step']}): "
            + ", ".join(f"{name} {value:.4g}" for name, value in scores.items()))


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict:
    """Write the plots and summary.txt; return the summary with `plots`, `skipped_plots`."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    from europa_jax.records.report_plots import PLOTS  # matplotlib: only to draw

    plots, skipped = [], []
    for name, plot in PLOTS.items():
        fig = plot(run)
        if fig is None:
            skipped.append(name)
            (out / name).unlink(missing_ok=True)  # an earlier report's plot would mislead
            continue
        fig.savefig(out / name)
        plots.append(name)
    summary = {**summarize(run), "plots": plots, "skipped_plots": skipped}
    (out / "summary.txt").write_text(format_summary(summary))
    return summary
