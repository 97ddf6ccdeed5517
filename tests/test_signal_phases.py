"""A stop request in every phase of `europa-jax train` (job/preemption.py, run/outcome.py):
before the first step (starting, initializing, restoring, compiling) it ends the process at
once in one line, exit 75 (130 for Ctrl-C), leaving the run directory to the next try; in
a step it is saved; a second Ctrl-C during that save says which checkpoint is on disk.
Signals are sent at named phases by `EUROPA_JAX_INJECT_SIGNAL` (run/fault_injection.py)."""

import json
import os
import signal
import threading
import time

import pytest

from europa_jax.job import exit_codes, preemption
from europa_jax.run import fault_injection, outcome
from europa_jax.store import checkpoint, run_lock
from test_checkpoint import (assert_same_run, cli_env, events, metrics,  # noqa: F401
                             reference_run, run_cli, train_here)


def describe(signal_name, phase, run_dir):
    return f"stopped by {signal_name} in {phase}"


def test_a_request_before_the_first_step_is_raised_in_the_main_thread_then_said_once(capfd):
    before = {sig: signal.getsignal(sig) for sig in preemption.STOP_SIGNALS}
    with preemption.StopsFromTheStart(describe, exit=pytest.fail) as stops:
        assert preemption.current() is stops
        with pytest.raises(preemption.StopBeforeFirstStep) as raised:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert raised.value.signal_name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a second request waits for the first's exit
        assert stops.say("SIGUSR1") == exit_codes.PREEMPTED
        assert stops.say("SIGUSR1") == exit_codes.PREEMPTED  # once
    assert capfd.readouterr().err == "europa-jax: stopped by SIGUSR1 in startup\n"
    assert preemption.current() is None
    assert {sig: signal.getsignal(sig) for sig in preemption.STOP_SIGNALS} == before


def test_the_loops_handler_stops_at_once_before_the_first_step_and_saves_after_it():
    with preemption.StopsFromTheStart(describe, exit=pytest.fail) as stops:
        stops.on_phase("compile")
        with preemption.StopRequests():  # entered before the compile, as the loop does
            with pytest.raises(preemption.StopBeforeFirstStep):
                os.kill(os.getpid(), signal.SIGINT)
        stops.signal_name = None
        stops.first_step()
        with preemption.StopRequests() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signal_name == "SIGTERM"  # a flag: the step is finished and saved
        with pytest.raises(KeyboardInterrupt):  # after the loop: Python's Ctrl-C again
            os.kill(os.getpid(), signal.SIGINT)


def test_a_request_the_main_thread_cannot_handle_ends_the_process_from_the_watcher(capfd):
    """The main thread in native code (the compile) runs no Python handler: the thread the
    signal wakes says the line and exits after the grace. Blocking the signal in the main
    thread stands in for native code: the kernel hands it to another thread."""
    exits = []
    with preemption.StopsFromTheStart(describe, grace_s=0.2,
                                      exit=lambda code: exits.append((code, time.time()))
                                      ) as stops:
        stops.on_phase("compile")
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
        try:
            with pytest.raises(preemption.StopBeforeFirstStep):  # once back in Python
                threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
                back = time.time() + 1.0
                time.sleep(1.0)  # one call: not interrupted, another thread got the signal
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
    assert [code for code, _ in exits] == [exit_codes.PREEMPTED] and exits[0][1] < back
    assert capfd.readouterr().err == "europa-jax: stopped by SIGTERM in compile\n"


def test_after_the_first_step_the_watcher_leaves_the_request_to_the_loop():
    exits = []
    with preemption.StopsFromTheStart(describe, grace_s=0.05, exit=exits.append) as stops:
        stops.first_step()
        with preemption.StopRequests() as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.3)
            assert stop.signal_name == "SIGUSR1"
    assert exits == []


def test_the_lines_say_what_is_on_disk(tmp_path):
    line = outcome.stopped_line
    assert line("SIGTERM", "compile", str(tmp_path)) == (
        "stop requested (SIGTERM) during the compile, before the first step: nothing new to "
        "save (no checkpoint yet); exiting for requeue; the same command starts the run")
    assert line("SIGINT", "restore", str(tmp_path)) == (
        "interrupted (Ctrl-C) while initializing the parameters, before the first step: "
        "nothing new to save (no checkpoint yet); the same command starts the run")
    assert line("SIGUSR1", "startup", None) == (
        "stop requested (SIGUSR1) while starting, before the first step: nothing new to save "
        "(nothing written); exiting for requeue; the same command goes on")
    (checkpoint.checkpoint_dir(tmp_path) / "4").mkdir(parents=True)
    assert line("SIGTERM", "restore", str(tmp_path)) == (
        "stop requested (SIGTERM) while restoring a checkpoint, before the first step: "
        "nothing new to save (the checkpoint of step 4 is kept); exiting for requeue; the "
        "same command resumes from it")
    assert outcome.quit_line([2, 4]) == ("interrupted (Ctrl-C): quit at once; the last "
                                         "checkpoint saved is step 4; the same command "
                                         "resumes from it")
    assert "no checkpoint was saved" in outcome.quit_line([])


def test_a_stop_line_starts_a_line_of_its_own_at_a_terminal():
    class Terminal:
        def isatty(self):
            return True

    assert preemption.own_line(Terminal()) == "\n"  # ends the progress bar's line
    with open(os.devnull, "w") as devnull:
        assert preemption.own_line(devnull) == ""


def test_a_malformed_signal_fault_is_a_configuration_error():
    with pytest.raises(fault_injection.ConfigError, match="PHASE"):
        fault_injection.signal_at("compile", env={fault_injection.ENV_SIGNAL: "compile"})


def test_a_signal_fault_can_be_for_one_try_of_a_slurm_job(monkeypatch):
    sent = []
    monkeypatch.setattr(fault_injection.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(fault_injection, "_signals_sent", {})  # the entries fired: this test's
    env = {fault_injection.ENV_SIGNAL: "restore:SIGTERM", fault_injection.ENV_SIGNAL_TRY: "1"}
    fault_injection.signal_at("restore", env=env)  # try 0: no SLURM_RESTART_COUNT yet
    fault_injection.signal_at("restore", env={**env, "SLURM_RESTART_COUNT": "1"})
    assert sent == [signal.SIGTERM]
    with pytest.raises(fault_injection.ConfigError, match="not a try number"):
        fault_injection.signal_at("restore", env={**env, fault_injection.ENV_SIGNAL_TRY: "x"})


def stopped(run_dir, env, phase_signal, *overrides):
    """`europa-jax train` (the TINY config) signalled at a phase: (exit code, its
    `europa-jax:` lines, stderr)."""
    rc, _, err = run_cli(run_dir, {**env, fault_injection.ENV_SIGNAL: phase_signal},
                         *overrides)
    assert "Traceback" not in err, err[-3000:]
    return rc, [line for line in err.splitlines() if line.startswith("europa-jax:")], err


def stopped_here(run_dir, monkeypatch, capfd, phase_signal, *overrides):
    """The same in this process (cli.run_training): for the phases whose Python handler
    runs at once; the compile's can take the watcher's exit, hence a process of its own."""
    handlers = [signal.getsignal(sig) for sig in preemption.STOP_SIGNALS]
    monkeypatch.setenv(fault_injection.ENV_SIGNAL, phase_signal)
    capfd.readouterr()
    rc = train_here(run_dir, *overrides)
    monkeypatch.delenv(fault_injection.ENV_SIGNAL)
    err = capfd.readouterr().err
    assert preemption.current() is None  # this process's handlers are its own again
    assert [signal.getsignal(sig) for sig in preemption.STOP_SIGNALS] == handlers
    return rc, [line for line in err.splitlines() if line.startswith("europa-jax:")], err


def preempted_events(run_dir):
    return [e for e in events(run_dir) if e["event"] == "preempted"]


@pytest.mark.slow
def test_a_signal_in_every_phase_ends_in_one_line_and_the_resumes_equal_an_uninterrupted_run(
        tmp_path, cli_env, reference_run, monkeypatch, capfd):  # noqa: F811
    run_dir = tmp_path / "run"
    started = time.time()
    # starting: the handlers are in before jax; nothing is written
    rc, lines, _ = stopped(run_dir, cli_env, "startup:SIGTERM")
    assert (rc, lines) == (exit_codes.PREEMPTED, [
        f"europa-jax: {outcome.stopped_line('SIGTERM', 'startup', None)}"])
    assert not run_dir.exists()
    # initializing (a run with no checkpoint): Ctrl-C
    rc, lines, _ = stopped_here(run_dir, monkeypatch, capfd, "restore:SIGINT")
    assert (rc, lines) == (exit_codes.INTERRUPTED, [(
        "europa-jax: interrupted (Ctrl-C) while initializing the parameters, before the first "
        "step: nothing new to save (no checkpoint yet); the same command starts the run")])
    run_lock.check_free(run_dir)
    # compiling, in native code where no Python handler runs: the watcher thread ends the
    # process within Slurm's KillWait (30 s); nothing trained, nothing saved
    rc, lines, _ = stopped(run_dir, cli_env, "compile:SIGUSR1:stall")
    ended = time.time()
    assert (rc, lines) == (exit_codes.PREEMPTED, [
        f"europa-jax: {outcome.stopped_line('SIGUSR1', 'compile', str(run_dir))}"])
    assert "during the compile" in lines[0]
    timeline = (run_dir / "timeline.jsonl").read_text().splitlines()
    (compiling,) = [r for r in map(json.loads, timeline)
                    if r["phase"] == "compile"]  # its line written on the watcher's way out
    assert preemption.GRACE_S <= compiling["end"] - compiling["start"] < ended - \
        compiling["start"] < 30
    assert not checkpoint.committed_steps(run_dir)
    assert not (run_dir / "metrics.jsonl").exists() or not metrics(run_dir)
    assert [(e["signal"], e["phase"], e["saved"]) for e in preempted_events(run_dir)] == [
        ("SIGINT", "restore", False), ("SIGUSR1", "compile", False)]
    # a step, then its save: Ctrl-C in step 3 asks for a save, a second one as it begins
    # quits; the periodic checkpoint of step 2 is what is on disk, and the line says so
    rc, lines, err = stopped(run_dir, cli_env, "step@3:SIGINT,checkpoint:SIGINT")
    assert rc == exit_codes.INTERRUPTED and "Ctrl-C again to quit without saving" in err
    assert lines == [("europa-jax: interrupted (Ctrl-C): quit at once; the last "
                      "checkpoint saved is step 2; the same command resumes from it")]
    assert checkpoint.committed_steps(run_dir) == [2]
    # restoring step 2
    rc, lines, _ = stopped_here(run_dir, monkeypatch, capfd, "restore:SIGTERM")
    assert (rc, lines) == (exit_codes.PREEMPTED, [(
        "europa-jax: stop requested (SIGTERM) while restoring a checkpoint, before the first "
        "step: nothing new to save (the checkpoint of step 2 is kept); exiting for requeue; "
        "the same command resumes from it")])
    # a step: finished, saved, exit for requeue
    rc, lines, _ = stopped_here(run_dir, monkeypatch, capfd, "step@5:SIGTERM")
    assert (rc, lines) == (exit_codes.PREEMPTED, [
        "europa-jax: stop requested (SIGTERM): saved step 5, exiting for requeue"])
    assert checkpoint.committed_steps(run_dir)[-1] == 5
    print(f"six stops in {time.time() - started:.1f} s")
    # the requeue resumes from step 5 and ends bitwise where an uninterrupted run does
    assert train_here(run_dir) == exit_codes.OK
    assert_same_run(run_dir, reference_run)


def test_the_watcher_thread_ends_with_its_block():
    with preemption.StopsFromTheStart(describe):
        pass
    assert not [t for t in threading.enumerate() if t.name == "stop-before-first-step"]
