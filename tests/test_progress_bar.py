"""The terminal's progress bar: log lines above it, not glued to its end, and an ETA from
the steps' rate, not the compile's."""

import io
import logging
import sys
import time

from europa_jax.job import logs
from europa_jax.records import run_log


class Terminal(io.StringIO):
    def isatty(self):
        return True


def at_terminal(monkeypatch, columns=120):
    """stderr a terminal `columns` wide."""
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(run_log, "terminal_columns", lambda: columns)
    return term


def test_log_lines_go_above_the_bar_and_the_handler_is_restored(monkeypatch):
    term = at_terminal(monkeypatch)
    logs.configure("normal", stream=sys.stderr)
    try:
        update, _ = run_log.progress(10)
        update(0, {"loss": 2.5})
        logging.getLogger("europa_jax.test").warning("a line of its own")
        update(1, {"loss": 2.4})
        update(None, None)
        logging.getLogger("europa_jax.test").warning("after the bar")
    finally:
        logs.configure("normal")
    out = term.getvalue()
    line = next(l for l in out.replace("\r", "\n").split("\n") if "a line of its own" in l)
    assert line.endswith("a line of its own") and "step" not in line.split("WARNING")[0]
    assert "]" not in line  # nothing of the bar before it on its line
    assert out.rstrip("\n").endswith("after the bar")  # the handler writes plainly again
    assert "2/10" in out


def test_the_bar_starts_after_the_first_step_so_the_compile_is_not_in_its_rate(monkeypatch):
    term = at_terminal(monkeypatch)
    update, _ = run_log.progress(100)
    time.sleep(1.2)  # the compile: before any step is reported
    update(5, {"loss": 1.0})  # a resumed run's first step: step 6 of 100
    update(None, None)
    # the bar's clock started at the first step, with 5 done before it: the 1.2 s before
    # it are not in its elapsed time (a bar made at the start would show 00:01)
    assert term.getvalue().rstrip().split("\r")[-1].split("|")[-1].startswith(" 6/100 [00:00<")


def test_a_terminal_without_width_gets_the_step_lines_instead_of_a_bar(monkeypatch):
    """A pseudo-terminal nobody sized (0 columns) draws an empty bar: the step lines
    are logged as they are into a file."""
    term = at_terminal(monkeypatch, columns=0)
    logs.configure("normal", stream=sys.stderr)
    try:
        update, logged = run_log.progress(10)
        update(0, {"loss": 2.5})
        logged({"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.5,
                "tokens_per_s_per_device": 1000.0, "mfu": 0.01})
        update(None, None)
    finally:
        logs.configure("normal")
    out = term.getvalue()
    assert "\r" not in out and "|" not in out  # no bar
    assert "step 1/10 loss 2.5000" in out


def test_the_bar_goes_back_with_a_spike_s_rollback(monkeypatch):
    term = at_terminal(monkeypatch)
    update, _ = run_log.progress(36)
    for done in range(30):  # `update` is given the steps done before the step
        update(done, {"loss": 3.0})
    update(24, {"loss": 3.0})  # the first step after a rollback to step 24
    update(None, None)
    assert "25/36" in term.getvalue().split("\r")[-1]  # not 31/36
