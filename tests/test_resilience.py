"""Surviving a shared machine: stragglers named, hangs broken, restarts cheap, goodput.

Unit tests of each part (a fake clock and exit for the watchdog), then two-process runs
through launch/local.sh with a fault injected into rank 1, and a run killed and resumed
twice whose report must account for its wall time. The compile-cache hit of a requeued
job is in test_slurm.py.
"""

import json
import logging
import math
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from europa_jax.config import ConfigError, TrainConfig
from europa_jax.store import compile_cache
from europa_jax.job import exit_codes, watchdog as watchdog_lib
from europa_jax.run import fault_injection
from europa_jax.records import goodput, report, run_log, timeline
from europa_jax.records.stragglers import StepTimes, StragglerMonitor
from test_checkpoint import cli_env, run_cli, start_cli, wait_for_step  # noqa: F401 (a fixture)
from test_launch_local import launch


class Events:
    """Stands in for run_log.EventLog: the records, in order."""

    def __init__(self):
        self.records = []

    def __call__(self, event, message=None, *, level=logging.INFO, **fields):
        self.records.append({"event": event, "message": message, **fields})


# ----------------------------------------------------------------------------- stragglers

def test_own_time_is_host_time_plus_the_shortest_device_time():
    # p1 drew its batch 0.5 s late; the others' devices waited for it in the collectives.
    times = StepTimes(host_s=np.array([0.01, 0.51, 0.02, 0.03]),
                      device_s=np.array([0.6, 0.1, 0.59, 0.58]))
    np.testing.assert_allclose(times.own_s, [0.11, 0.61, 0.12, 0.13])
    summary = times.summary({0: "n0", 1: "n1", 2: "n1", 3: "n1"})
    assert summary["slowest_process"] == 1 and summary["slowest_node"] == "n1"
    assert summary["own_time_s_median"] == pytest.approx(0.12)  # of two middles, the lower
    assert summary["slowest_lag_s"] == pytest.approx(0.49)
    line = run_log.step_line({"step": 3, "loss": 1.0, "grad_norm": 1.0, "lr": 0.0,
                              "step_time_s": 0.6, "tokens_per_s_per_device": 1.0, "mfu": 0.0,
                              **summary}, 10)
    assert line.endswith("slowest p1 (n1) +0.490 s over median")


def test_a_straggler_is_one_event_after_n_slow_steps_in_a_row_and_again_after_recovering():
    events = Events()
    monitor = StragglerMonitor(1.5, 3, {0: "a", 1: "b"}, events)
    slow = StepTimes(np.array([0.0, 0.2]), np.array([0.3, 0.1]))  # p1: 0.3 vs p0: 0.1
    fine = StepTimes(np.array([0.0, 0.01]), np.array([0.3, 0.3]))
    reported = [monitor.check(step, times) for step, times in
                enumerate([slow, slow, fine, slow, slow, slow, slow, fine, slow, slow, slow], 1)]
    assert reported == [[], [], [], [], [], [1], [], [], [], [], [1]]
    assert [(e["event"], e["step"], e["process"], e["node"]) for e in events.records] == [
        ("straggler", 6, 1, "b"), ("straggler", 11, 1, "b")]
    assert events.records[0]["own_time_s"] == pytest.approx(0.3)
    assert "3.00 × the median" in events.records[0]["message"]


def test_straggler_settings_are_checked():
    for fields, message in [({"straggler_factor": 1.0}, "train.straggler_factor: 1.0 must be > 1"),
                            ({"straggler_factor": -2}, "train.straggler_factor: -2 must be > 1"),
                            ({"straggler_steps": 0}, "train.straggler_steps"),
                            ({"hang_timeout_s": -1}, "train.hang_timeout_s: -1 must be >= 0")]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            TrainConfig(**fields)
    assert TrainConfig(straggler_factor=0).straggler_factor == 0  # off


# ----------------------------------------------------------------------------- faults

def test_fault_injection_reads_its_process_and_refuses_malformed_values():
    env = {fault_injection.ENV_DELAY: "1:0.25", fault_injection.ENV_HANG: "1:7"}
    assert (fault_injection.Faults(0, env).delay_s, fault_injection.Faults(0, env).hang_step) \
        == (0.0, None)
    assert (fault_injection.Faults(1, env).delay_s, fault_injection.Faults(1, env).hang_step) \
        == (0.25, 7)
    for key, raw in [(fault_injection.ENV_DELAY, "0.5"), (fault_injection.ENV_HANG, "1:x"),
                     (fault_injection.ENV_DELAY, "a:1")]:
        with pytest.raises(ConfigError, match=f"{key}: '{raw}' is not PROCESS:"):
            fault_injection.Faults(0, {key: raw})


# ----------------------------------------------------------------------------- watchdog

class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_watchdog(timeout_s, events=None):
    clock, exits, closed = FakeClock(), [], []
    dog = watchdog_lib.HangWatchdog(timeout_s, process_index=0, process_count=1, events=events,
                                    before_exit=lambda: closed.append(True), exit=exits.append,
                                    clock=clock)
    return dog, clock, exits, closed


def test_the_limit_is_fixed_or_ten_median_steps_with_floors_and_startup_gets_more():
    dog, clock, _, _ = make_watchdog(0)
    assert dog.timeout_s("step") == watchdog_lib.DERIVED_FLOOR_S  # no step time yet
    for seconds in [100.0, 90.0, 5000.0]:  # one outlier does not move the median
        dog.step_took(seconds)
    assert dog.timeout_s("step") == 1000.0
    assert dog.timeout_s("compile") == dog.timeout_s("startup") == watchdog_lib.STARTUP_FLOOR_S
    fixed, _, _, _ = make_watchdog(10)
    assert (fixed.timeout_s("step"), fixed.timeout_s("restore")) == (
        10, watchdog_lib.STARTUP_FLOOR_S)


def test_overdue_counts_from_the_phase_start_and_a_new_phase_resets_it():
    dog, clock, _, _ = make_watchdog(10)
    dog.on_phase("step", 5)
    clock.now += 9
    dog.note("on the devices")  # detail only: the clock goes on
    assert dog.overdue() is None
    clock.now += 2
    assert dog.overdue() == pytest.approx(1.0)
    dog.on_phase("step", 6)
    assert dog.overdue() is None


def test_firing_dumps_every_thread_records_the_hang_and_exits_for_requeue(capfd):
    events = Events()
    dog, clock, exits, closed = make_watchdog(10, events)
    dog.on_phase("step", 5)
    dog.note("waiting for its batch")
    clock.now += 12
    dog.fire()
    err = capfd.readouterr().err
    assert "thread 0x" in err and "test_firing_dumps_every_thread" in err  # this frame
    assert exits == [exit_codes.PREEMPTED] and closed == [True]
    (hang,) = events.records
    assert (hang["event"], hang["step"], hang["phase"], hang["missing"]) == (
        "hang", 5, "step", [])
    assert hang["processes"] == {"0": "step 5 (waiting for its batch)"}


def test_the_watchdog_thread_fires_on_its_own(capfd, caplog):
    exits = []
    dog = watchdog_lib.HangWatchdog(1, process_index=0, process_count=1, exit=exits.append)
    with dog:
        dog.on_phase("step", 1)
        deadline = time.monotonic() + 20
        while not exits and time.monotonic() < deadline:
            time.sleep(0.1)
    assert exits == [exit_codes.PREEMPTED]
    assert "hang: no progress for " in caplog.text and "in step 1;" in caplog.text
    assert "Thread 0x" in capfd.readouterr().err  # the main thread, from the watchdog


# ----------------------------------------------------------------------------- compile cache

def test_the_compile_is_announced_then_said_what_it_was():
    assert compile_cache.announcement(8, Path("/c")) == (
        "compiling the train step for 8 devices, or read from the compilation cache in /c if "
        "it holds it: the first step waits for it")
    assert "(the compilation cache is off)" in compile_cache.announcement(8, None)
    hit = compile_cache.Compiled(executable=None, cache_hit=True, waited_s=0.0)
    assert compile_cache.outcome(hit, 2.04) == "train step read from the compilation cache in 2.0 s"
    miss = compile_cache.Compiled(executable=None, cache_hit=False, waited_s=4.0)
    assert compile_cache.outcome(miss, 35.0) == (
        "train step compiled in 31.0 s, then 4.0 s waiting for the other processes")


def test_the_compile_cache_directory_setting_then_the_environment_then_the_run_dir(tmp_path):
    env = {compile_cache.ENV_CACHE_DIR: "/shared/cache"}
    assert compile_cache.cache_dir("", tmp_path, {}) == tmp_path / "compile_cache"
    assert compile_cache.cache_dir("", tmp_path, env) == Path("/shared/cache")
    assert compile_cache.cache_dir("/mine", tmp_path, env) == Path("/mine")
    assert compile_cache.cache_dir("none", tmp_path, env) is None


# ----------------------------------------------------------------------------- goodput

def phase(t, name, start, end, step=None):
    record = {"try": t, "phase": name, "start": start, "end": end}
    return record if step is None else {**record, "step": step}


def test_goodput_splits_the_wall_time_and_counts_steps_run_again_as_lost():
    records = [phase(0, "startup", 0, 5), phase(0, "restore", 5, 6), phase(0, "step", 6, 7, 1),
               phase(0, "compile", 7, 27), phase(0, "step", 27, 28, 1),
               phase(0, "step", 28, 29, 2), phase(0, "checkpoint", 29, 30),
               phase(0, "step", 30, 31, 3), phase(0, "step", 31, 32, 4),  # then kill -9
               phase(1, "startup", 40, 44), phase(1, "restore", 44, 46),
               phase(1, "step", 46, 46.5, 3), phase(1, "compile", 46.5, 48.5),
               phase(1, "step", 48.5, 49.5, 3), phase(1, "step", 49.5, 50.5, 4),
               phase(1, "validation", 50.5, 52), phase(1, "checkpoint", 52, 53)]
    g = goodput.goodput(records)
    parts = g["parts_s"]
    assert g["wall_s"] == 53
    assert parts["training_steps"] == 1 + 1 + 1 + 0.5 + 1 + 1  # steps 1, 2 of try 0; 3, 4 of 1
    assert parts["lost_work"] == 2  # steps 3 and 4 of try 0
    assert (parts["startup"], parts["restore"], parts["compile"]) == (9, 3, 22)
    assert (parts["checkpoint"], parts["validation"], parts["downtime"]) == (2, 1.5, 8)
    assert parts["unaccounted"] == 0
    assert g["goodput"] == pytest.approx(5.5 / 53)
    assert (g["steps_kept"], g["steps_lost"]) == (4, 2)
    assert [(t["try"], t["first_step"], t["last_step"], t["compile_s"]) for t in g["tries"]] == [
        (0, 1, 4, 20), (1, 3, 4, 2)]
    text = "\n".join(goodput.format_goodput(g))
    assert "goodput: 10.4% of 53.0 s wall time trained (2 tries" in text
    assert "downtime between tries" in text and "try 1: at +40.0 s" in text
    one = goodput.format_goodput(goodput.goodput(records[:9]))[0]
    assert "(1 try, first start" in one


def test_a_gap_inside_a_try_is_unaccounted_and_a_line_cut_by_a_kill_is_skipped(tmp_path):
    path = tmp_path / timeline.FILE
    path.write_text(json.dumps(phase(0, "startup", 0, 2)) + "\n"
                    + json.dumps(phase(0, "step", 3, 4, 1)) + "\n" + '{"try": 0, "pha')
    g = goodput.goodput(goodput.read_timeline(path))
    assert g["parts_s"]["unaccounted"] == 1 and g["wall_s"] == 4
    path.write_text(json.dumps({"try": 0, "phase": "nap", "start": 0, "end": 1}) + "\n")
    with pytest.raises(goodput.TimelineError, match=r"timeline.jsonl, line 1: expected a phase"):
        goodput.read_timeline(path)
    assert goodput.format_goodput(None) == ["goodput: n/a (no timeline.jsonl)"]


def test_the_timeline_chains_phases_and_numbers_tries(tmp_path):
    heard = []
    clock = timeline.Timeline(tmp_path, True, timeline.next_try(tmp_path), [
        lambda name, step: heard.append((name, step))])
    clock.phase("restore")
    clock.phase("step", 1)
    assert clock.phase("step", 1) >= 0  # the same phase goes on: no line
    clock.phase("step", 2)
    clock.close()
    records = goodput.read_timeline(tmp_path / timeline.FILE)
    assert [(r["try"], r["phase"], r.get("step")) for r in records] == [
        (0, "startup", None), (0, "restore", None), (0, "step", 1), (0, "step", 2)]
    assert all(a["end"] == b["start"] for a, b in zip(records, records[1:]))
    assert records[0]["start"] <= time.time() and records[0]["start"] > time.time() - 3600
    assert heard == [("restore", None), ("step", 1), ("step", 2)]
    assert timeline.next_try(tmp_path) == 1


# ----------------------------------------------------------------------------- two processes

TINY_TWO = ["--set", "model.d_model=32", "--set", "execution.remat=none",
            "--set", "data.max_documents=40", "--set", "data.global_batch_size=8",
            "--set", "train.eval_every=0", "--set", "train.log_every=1",
            "--set", "data.seq_len=64", "--set", "execution.attention_block_size=64",
            "--set", "checkpoint.every_steps=0"]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.slow
def test_a_rank_slowed_by_a_delay_is_named_in_the_log_metrics_and_events(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(tmp_path, 2, "--run-dir", str(run_dir), "--set", "train.steps=6", *TINY_TWO,
                  env={fault_injection.ENV_DELAY: "1:2.0"}, stand_in=False)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    records = read_jsonl(run_dir / "metrics.jsonl")
    # Step 1's delay came before the compile, which the processes meet after: not counted.
    assert [r["slowest_process"] for r in records[1:]] == [1] * 5, records
    assert all(r["slowest_lag_s"] > 1.5 for r in records[1:])  # of the 2 s asleep
    lines = log.splitlines()
    for record in records[1:]:
        (line,) = [line for line in lines if f" step {record['step']}/6 loss" in line]
        assert f"slowest p1 ({record['slowest_node']}) +" in line, line
    (event,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "straggler"]
    assert (event["process"], event["step"], event["logged_steps"]) == (1, 4, 3)
    assert event["node"] == records[0]["slowest_node"] and event["host_time_s"] > 1.9
    assert "straggler: process 1 on" in log


@pytest.mark.slow
def test_a_rank_blocked_before_a_collective_trips_every_watchdog_dumps_and_exits_75(tmp_path):
    run_dir = tmp_path / "run"
    started = time.time()
    # 10 s: under gloo's own 30 s timeout, which would otherwise end rank 0 with an error
    proc = launch(tmp_path, 2, "--run-dir", str(run_dir), "--set", "train.steps=8", *TINY_TWO,
                  "--set", "train.hang_timeout_s=10",
                  env={fault_injection.ENV_HANG: "1:3", "EUROPA_RANK_EXIT_WAIT_S": "30"},
                  stand_in=False)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == exit_codes.PREEMPTED, err[-3000:]
    logs = [(tmp_path / "logs" / f"rank-{i}.log").read_text() for i in range(2)]
    for log in logs:
        assert "hang: no progress for 1" in log and "in step 3 (" in log, log[-3000:]
        assert "Thread 0x" in log and "(most recent call first)" in log  # faulthandler's dump
    assert "fault_injection.py" in logs[1]  # rank 1's main thread: where it is stuck
    (hang,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "hang"]
    assert hang["step"] == 3 and hang["missing"] == [] and set(hang["processes"]) == {"0", "1"}
    assert hang["processes"]["1"].startswith("step 3 (")
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == [1, 2]
    last = read_jsonl(run_dir / timeline.FILE)[-1]
    assert (last["phase"], last["step"]) == ("step", 3) and last["end"] - last["start"] >= 10
    assert time.time() - started < 600


# ----------------------------------------------------------------------------- goodput, for real

@pytest.mark.slow
def test_a_run_killed_and_resumed_twice_reports_goodput_summing_to_its_wall_time(
        tmp_path, cli_env):
    pause = 3.0
    # try 0: killed without warning after step 3 (its save of step 2 may or may not be
    # done: under load the next try may start over from step 1)
    proc = start_cli(tmp_path, cli_env)
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(pause)
    # try 1: preempted after step 5 (saves the step in flight, exits for requeue)
    proc = start_cli(tmp_path, cli_env)
    wait_for_step(proc, tmp_path, 5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == exit_codes.PREEMPTED, err[-3000:]
    time.sleep(pause)
    # try 2: to the end (a process too: a try's startup phase begins when its process does)
    rc, _, err = run_cli(tmp_path, cli_env)
    assert rc == exit_codes.OK, err[-3000:]

    # what `europa-jax report RUN_DIR` writes and prints, in this process
    printed = report.format_summary(report.write_report(tmp_path))
    summary = goodput.run_goodput(tmp_path)
    assert "goodput: " in printed and "3 tries" in printed
    assert (tmp_path / "report" / "summary.txt").read_text().count("downtime between tries") == 1

    parts, wall = summary["parts_s"], summary["wall_s"]
    assert abs(sum(v for k, v in parts.items() if k != "unaccounted") - wall) < 0.01 * wall
    assert parts["downtime"] >= 2 * pause
    assert min(parts[k] for k in ("startup", "restore", "compile", "checkpoint",
                                  "training_steps")) > 0
    # Lost work: the steps a try ran past the checkpoint the next try restored.
    records = goodput.read_timeline(tmp_path / timeline.FILE)
    # Each try's first step follows the step it resumed from (0: none saved yet).
    first_steps = [e["step"] for e in read_jsonl(tmp_path / "events.jsonl")
                   if e["event"] == "start_phases"]
    restored = [step - 1 for step in first_steps[1:]]
    ran = [{r["step"] for r in records if r["phase"] == "step" and r["try"] == t} for t in (0, 1)]
    # (a step's phase is recorded when the next begins: the kill may leave step 3's out)
    assert len(first_steps) == 3 and max(ran[0]) >= 2 and max(ran[1]) >= 5
    lost = sum(s > r for steps, r in zip(ran, restored) for s in steps)
    assert summary["steps_lost"] == lost and (lost > 0) == (parts["lost_work"] > 0)
    assert not any(s > restored[1] for s in ran[1])  # a preemption saves the step it ran
    assert summary["steps_kept"] == 8 and [t["try"] for t in summary["tries"]] == [0, 1, 2]
    assert math.isclose(summary["goodput"], parts["training_steps"] / wall)


def test_firing_exits_even_when_logging_and_stderr_are_broken(monkeypatch):
    """A root log handler on a closed stream, a stderr with no file descriptor, events
    that raise: each part fails on its own and the exit still comes."""
    import io

    closed = io.StringIO()
    closed.close()
    handler = logging.StreamHandler(closed)
    logging.getLogger().addHandler(handler)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # faulthandler needs a fileno
    try:
        def broken_events(*args, **kwargs):
            raise OSError("disk gone")

        dog, clock, exits, closed_timeline = make_watchdog(10, broken_events)
        dog.on_phase("step", 2)
        clock.now += 11
        dog.fire()
    finally:
        logging.getLogger().removeHandler(handler)
    assert exits == [exit_codes.PREEMPTED] and closed_timeline == [True]
