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


def test_log_lines_go_above_the_bar_and_the_handler_is_restored(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
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
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    update, _ = run_log.progress(100)
    time.sleep(1.2)  # the compile: before any step is reported
    update(5, {"loss": 1.0})  # a resumed run's first step: step 6 of 100
    update(None, None)
    # the bar's clock started at the first step, with 5 done before it: the 1.2 s before
    # it are not in its elapsed time (a bar made at the start would show 00:01)
    assert term.getvalue().rstrip().split("\r")[-1].split("|")[-1].startswith(" 6/100 [00:00<")
