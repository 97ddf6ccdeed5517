"""report.py on synthetic run directories: plots, deduplication, summary, errors."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from matplotlib.image import imread

from europa_jax.records.report import (ReportError, format_summary, load_run, summarize,
                                       write_report)
from europa_jax.records.report_plots import PLOTS, _plot_loss

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SEQ_LEN, BATCH = 64, 4


def _train_record(step: int, loss: float, step_time: float, compiled: bool,
                  per_layer: bool = True) -> dict:
    record = {"step": step, "loss": loss, "grad_norm": 1.0 / step, "finite": 1.0,
              "lr": 1e-3 * min(1.0, step / 10), "expert_load_max_over_mean": 1.2 + 0.01 * step,
              "moe_dropped_fraction": 0.0, "step_time_s": step_time,
              "tokens_per_s_per_device": SEQ_LEN * BATCH / step_time / 8,
              "mfu": 0.001 / step_time, "attention_cost_max_over_mean": 1.0 + 0.002 * step,
              "attention_logit_max": 2.0 + step, "qk_clip_heads_clipped": step % 3,
              "compiled": compiled}
    if per_layer:
        record["expert_load_max_over_mean_per_layer"] = [1.1 + 0.01 * step, 1.5 - 0.005 * step]
        record["router_bias_spread_per_layer"] = [0.001 * step, 0.002 * step]
        record["attention_logit_max_per_layer"] = [2.0 + step, 1.0 + 0.5 * step]
    return record


def _step_time(step: int) -> float:
    # Compiled steps take far longer: a median that counted them would shift.
    return 30.0 if step in (1, 21) else 0.01 * step


def _write_lines(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def make_run(tmp_path, validation: bool = True, per_layer: bool = True, extras: bool = True):
    """30 steps; a resume from step 20 logs 21–30 again (lower loss); a truncated last line."""
    run = tmp_path / "run"
    run.mkdir()
    first = [_train_record(s, 5.0 - 0.05 * s, 1.0 if s > 20 else _step_time(s), s == 1,
                           per_layer) for s in range(1, 31)]
    first[4].update(loss=float("nan"), grad_norm=float("nan"), finite=0.0)  # step 5
    resumed = [_train_record(s, 4.0 - 0.05 * s, _step_time(s), s == 21, per_layer)
               for s in range(21, 31)]
    val = [{"step": s, "val_loss": v, "val_perplexity": math.exp(v), "val_tokens": 4096}
           for s, v in ((10, 4.6), (20, 4.2), (30, 4.4))] if validation else []
    # The stale validation at step 30 (before the resume) was better: the later one wins.
    stale_val = [{"step": 30, "val_loss": 1.0, "val_perplexity": 2.7, "val_tokens": 4096}]
    # train.eval_tasks' records: a task with two metrics and one with a filtered metric
    tasks = [{"step": s, "eval/tiny_choice/acc": a, "eval/tiny_choice/acc_norm": a + 0.125,
              "eval/tiny_gen/exact_match/strict": a / 2, "eval_tasks_time_s": 1.5}
             for s, a in ((10, 0.25), (20, 0.5), (30, 0.625))] if validation else []
    records = (first[:20] + val[:2] + tasks[:2] + first[20:] + (stale_val if validation else [])
               + resumed)
    _write_lines(run / "metrics.jsonl", records + val[2:] + tasks[2:],
                 tail='{"step": 31, "loss": 3.')
    if extras:
        _write_lines(run / "events.jsonl", [
            {"event": "checkpoint_saving", "step": 10, "reason": "periodic", "time": 1.7e9},
            {"event": "checkpoint_saving", "step": 20, "reason": "preempted", "time": 1.7e9 + 9},
            {"event": "preempted", "step": 20, "signal": "SIGTERM", "time": 1.7e9 + 10},
            {"event": "checkpoint_restored", "step": 20, "time": 1.7e9 + 60},
            {"event": "checkpoint_saving", "step": 30, "reason": "final", "time": 1.7e9 + 99},
            {"event": "checkpoint_failed", "step": 30, "error": "No space left on device",
             "last_good": 20, "action": "stop", "time": 1.7e9 + 100}])
        (run / "config.json").write_text(json.dumps(
            {"data": {"seq_len": SEQ_LEN, "global_batch_size": BATCH}, "train": {"steps": 30}}))
    return run


def test_writes_real_nontrivial_pngs(tmp_path):
    run = make_run(tmp_path)
    summary = write_report(run)
    out = run / "report"
    assert summary["plots"] == list(PLOTS) and summary["skipped_plots"] == []
    for name in PLOTS:
        path = out / name
        assert path.read_bytes()[:8] == PNG_MAGIC, name
        assert path.stat().st_size > 5_000, name
        assert imread(path).std() > 0.01, name
    assert (out / "summary.txt").read_text() == format_summary(summary)


def _labels(fig, panel: int) -> list[str]:
    return [line.get_label() for line in fig.axes[panel].lines]


def test_plots_number_layers_as_the_model_does_and_give_mfu_in_percent(tmp_path):
    """MoE layers' lists start after the dense layers and end with the MTP modules'
    blocks; attention's covers every layer: one numbering in both plots."""
    run = load_run(make_run(tmp_path))
    run.config["model"] = {"n_layers": 2, "n_dense_layers": 1}
    run.config["optim"] = {"qk_clip_threshold": 100.0}
    experts = PLOTS["experts.png"](run)
    assert _labels(experts, 0) == _labels(experts, 1) == ["layer 1", "MTP 1"]
    logits = PLOTS["attention_logits.png"](run)
    assert _labels(logits, 0) == ["layer 0", "layer 1"]
    throughput = PLOTS["throughput.png"](run)
    assert throughput.axes[1].get_ylabel() == "MFU (%)"
    timed = [r for r in run.train if not r.get("compiled")]
    assert list(throughput.axes[1].lines[0].get_ydata()) == pytest.approx(
        [100 * r["mfu"] for r in timed])
    assert len(logits.axes) == 2  # QK-clip on: the heads clipped panel


def test_without_qk_clip_the_heads_clipped_panel_is_left_out(tmp_path):
    run = load_run(make_run(tmp_path))
    run.config["optim"] = {"qk_clip_threshold": None}
    logits = PLOTS["attention_logits.png"](run)
    assert len(logits.axes) == 1 and "QK-clip off" in logits.axes[0].get_title()


def test_deduplicates_keeping_the_last_record_per_step(tmp_path):
    run = load_run(make_run(tmp_path))
    assert [r["step"] for r in run.train] == list(range(1, 31))
    by_step = {r["step"]: r for r in run.train}
    assert by_step[20]["loss"] == pytest.approx(5.0 - 0.05 * 20)  # before the resume
    assert by_step[25]["loss"] == pytest.approx(4.0 - 0.05 * 25)  # the resumed invocation's
    assert by_step[21]["compiled"] is True
    assert [(r["step"], r["val_loss"]) for r in run.validation] == [(10, 4.6), (20, 4.2),
                                                                    (30, 4.4)]
    assert [(r["step"], r["eval/tiny_choice/acc"]) for r in run.tasks] == [
        (10, 0.25), (20, 0.5), (30, 0.625)]
    assert all("loss" in r for r in run.train)  # neither kind of evaluation record
    assert len(run.events) == 6 and run.config["data"]["seq_len"] == SEQ_LEN
    # The loss plot draws one point per unique finite step (step 5 is NaN).
    train_line, val_line = _plot_loss(run).axes[0].lines
    assert len(train_line.get_xdata()) == 29
    assert list(val_line.get_xdata()) == [10, 20, 30]


def test_summary_fields(tmp_path):
    s = write_report(make_run(tmp_path), tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "summary.txt").is_file()
    assert (s["first_step"], s["last_step"], s["steps_logged"]) == (1, 30, 30)
    assert s["tokens_seen"] == 30 * BATCH * SEQ_LEN
    assert s["last_loss"] == pytest.approx(4.0 - 0.05 * 30) and s["last_loss_step"] == 30
    assert (s["best_val_loss"], s["best_val_step"]) == (4.2, 20)
    timed = [_step_time(step) for step in range(1, 31) if step not in (1, 21)]
    assert s["median_step_time_s"] == pytest.approx(statistics.median(timed))
    assert s["median_step_time_s"] != pytest.approx(
        statistics.median(_step_time(step) for step in range(1, 31)))
    assert s["median_mfu"] == pytest.approx(statistics.median(0.001 / t for t in timed))
    assert s["checkpoints_saved"] == [10, 20]  # step 30's save started but failed
    assert s["checkpoints_failed"] == [30]
    assert (s["restarts"], s["preemptions"]) == (1, 1)
    assert s["nonfinite_steps"] == [5]
    text = format_summary(s)
    assert "best val loss: 4.2 (step 20)" in text and "restarts: 1" in text
    assert "checkpoints saved: 10, 20" in text and "tokens seen: 7,680" in text
    assert "checkpoints failed: 30" in text
    assert s["eval_tasks_step"] == 30 and s["eval_tasks"] == {
        "tiny_choice/acc": 0.625, "tiny_choice/acc_norm": 0.75, "tiny_gen/exact_match/strict":
        0.3125}
    assert ("downstream tasks (step 30): tiny_choice/acc 0.625, tiny_choice/acc_norm 0.75, "
            "tiny_gen/exact_match/strict 0.3125") in text


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    run = make_run(tmp_path)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:15]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"metrics\.jsonl, line 3: "):
        load_run(run)


def test_missing_run_dir_or_metrics(tmp_path):
    with pytest.raises(ReportError, match="no such run directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(ReportError, match=r"metrics\.jsonl: not found"):
        write_report(tmp_path)


def test_a_run_before_its_first_step_reports_what_it_has(tmp_path):
    """Started (its config written, a checkpoint restored), no step logged yet: the summary
    says n/a where there is nothing and counts what there is; no plot is drawn."""
    (tmp_path / "config.json").write_text(json.dumps({"data": {"seq_len": 64}}))
    _write_lines(tmp_path / "events.jsonl", [{"event": "checkpoint_restored", "step": 4}])
    s = write_report(tmp_path)
    assert s["steps_logged"] == 0 and s["restarts"] == 1 and s["plots"] == []
    text = (tmp_path / "report" / "summary.txt").read_text()
    assert "steps logged: n/a–n/a (0 records, 0 validation)" in text
    assert "last loss: n/a" in text


def test_minimal_run_without_validation_layers_events_or_config(tmp_path):
    run = make_run(tmp_path, validation=False, per_layer=False, extras=False)
    path = run / "metrics.jsonl"
    # An older run: no attention balance or logits logged, and the MFU is NaN (unknown
    # peak FLOPs).
    records = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    for r in records:
        for key in ("attention_cost_max_over_mean", "attention_logit_max",
                    "qk_clip_heads_clipped"):
            r.pop(key, None)
        r["mfu"] = float("nan")
    _write_lines(path, records)
    s = write_report(run)
    assert "loss.png" in s["plots"] and "experts.png" in s["plots"]
    assert s["skipped_plots"] == ["attention_logits.png", "attention_balance.png",
                                  "eval_tasks.png"]
    assert not (run / "report" / "attention_balance.png").exists()
    experts = imread(run / "report" / "experts.png")
    assert experts.std() > 0.01
    assert s["tokens_seen"] is None and s["best_val_loss"] is None and s["median_mfu"] is None
    assert (s["restarts"], s["checkpoints_saved"]) == (0, [])
    text = (run / "report" / "summary.txt").read_text()
    assert "tokens seen: n/a" in text and "median MFU: n/a" in text
    assert ("skipped plots (no data): attention_logits.png, attention_balance.png, "
            "eval_tasks.png") in text and "downstream tasks: n/a" in text


def test_tries_restarts_and_spike_rollbacks_are_counted_apart(tmp_path):
    """3 tries are 2 restarts; a spike's rollback restores a checkpoint within its try (a
    `checkpoint_restored` event like a resume's) and is counted with the steps it ran
    again, not as a restart (issue 61: "restarts: 3" for 3 tries, no rollback said)."""
    run = make_run(tmp_path, extras=False)
    _write_lines(run / "events.jsonl", [
        {"event": "checkpoint_restored", "step": 10, "time": 1.7e9},  # try 2's resume
        {"event": "checkpoint_restored", "step": 20, "time": 1.7e9 + 50},  # a rollback
        {"event": "loss_spike", "step": 28, "rolled_back_to": 20, "time": 1.7e9 + 51},
        {"event": "loss_spike", "step": 3, "rolled_back_to": 0, "time": 1.7e9 + 52},
        {"event": "grad_norm_spike", "step": 25, "time": 1.7e9 + 53},
        {"event": "checkpoint_restored", "step": 20, "time": 1.7e9 + 90}])  # try 3's
    s = summarize(load_run(run))
    assert s["restarts"] == 2 and s["tries"] is None  # no timeline: the resumes
    assert s["rollbacks"] == [{"step": 28, "to": 20, "steps_lost": 8},
                              {"step": 3, "to": 0, "steps_lost": 3}]
    assert s["grad_norm_excursions"] == [25]
    text = format_summary(s)
    assert "restarts: 2\n" in text
    assert "spike rollbacks: 2, 11 steps run again (step 28 → 20, step 3 → 0)" in text
    assert "gradient-norm excursions (logged, not rolled back): 25" in text
    # with the timeline, its tries: a try that restored nothing (killed before it) counts
    _write_lines(run / "timeline.jsonl", [
        {"try": t, "phase": "step", "step": 1, "start": 100.0 * t, "end": 100.0 * t + 1}
        for t in range(3)])
    s = summarize(load_run(run))
    assert (s["tries"], s["restarts"]) == (3, 2)
    assert "restarts: 2 (3 tries)" in format_summary(s)
    (run / "events.jsonl").unlink()
    assert "spike rollbacks: none" in format_summary(summarize(load_run(run)))
