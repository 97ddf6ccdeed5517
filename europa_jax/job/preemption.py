"""Stop requests from the scheduler, agreed on by every process of the job.

Slurm sends SIGTERM at a time limit or preemption (then SIGKILL after `KillWait`), and
SIGUSR1 earlier when the job asks for it with `--signal=USR1@SECONDS`. A signal may reach
only some processes, or reach them during different steps; if each process stopped on
its own, one would enter a save (a collective) while another entered the next train step
(another collective) and the job would hang. So the handler only sets a flag, and after
every step all processes combine their flags with a tiny all-gather: they see the same
answer after the same step, save that step together and exit with `exit_codes.PREEMPTED`.

Ctrl-C (SIGINT) at a terminal is the same request from a user: the step finishes, is saved,
and the run exits with `exit_codes.INTERRUPTED`; a second Ctrl-C quits at once without
saving (KeyboardInterrupt), for a user who will not wait.

Before the first step (`StopsFromTheStart`, entered by the CLI before jax starts) there is
nothing new to save: a request ends the process at once, in one line, with the same exit
codes. The main thread's handler raises `StopBeforeFirstStep` at its next Python
instruction, which unwinds through the run lock (released) like any error. Inside native
code (the compile: tens of seconds to minutes, longer than Slurm's `KillWait` of 30 s
before its SIGKILL) no Python handler runs, so a thread woken by the signal itself
(`signal.set_wakeup_fd`) ends the process if the main thread has not within `GRACE_S`:
the line, the event, `os._exit` — the restored checkpoint is on disk already and the
kernel drops the run lock with the process. In a job each process that gets the request
leaves on its own: no collective save is pending before the first step, and the others
follow (srun's `--wait` signals them, which they honour the same way, or they find the
peer gone: peer_lost.py); every process exits 75 and the job is requeued whole.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Callable

from europa_jax.job import distributed, exit_codes, logs

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preempted(Exception):
    """Raised by the loop after the state of `step` has been saved because of a stop request."""

    def __init__(self, step: int, signal_name: str | None):
        self.interrupted = signal_name == "SIGINT"  # by a user at a terminal, not a scheduler
        if self.interrupted:
            message = (f"interrupted (Ctrl-C): saved step {step}; the same command resumes "
                       "from it")
        else:
            message = (f"stop requested ({signal_name or 'by another process'}): saved step "
                       f"{step}, exiting for requeue")
        super().__init__(message)
        self.step = step


class StopRequests:
    """Context manager: catches STOP_SIGNALS while the loop runs; `agree_with` after each
    step."""

    def __init__(self):
        self.signal_name: str | None = None
        self._interrupted = False  # a first Ctrl-C seen
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequests":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        # Only a flag: the step in flight must finish, and the save must be collective.
        start = current()
        if start is not None and start.before_first_step:  # the compile: nothing to save
            return start._handle(signum, frame)
        name = signal.Signals(signum).name
        if name == "SIGINT" and self._interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # a second Ctrl-C: quit now, nothing more saved
        self._interrupted = self._interrupted or name == "SIGINT"
        self.signal_name = self.signal_name or name  # the first request names the stop
        again = " (Ctrl-C again to quit without saving)" if name == "SIGINT" else ""
        logs.signal_safe_line("WARNING", __name__, f"{name} received: finishing the current "
                              f"step, then saving{again}")

    def agree_with(self, values) -> tuple[bool, "np.ndarray"]:
        """(True on every process iff any process has been asked to stop, `values`
        (floats) of every process [processes, len(values)]), by one gather (a collective).
        The loop's per-step timings travel this way (stragglers.py), so measuring them
        adds no collective."""
        rows = distributed.gather_floats([float(self.signal_name is not None), *values])
        return bool(rows[:, 0].any()), rows[:, 1:]


GRACE_S = 5.0  # the main thread handles a request within this unless it is in native code
_SENTINEL = b"\0"  # not a signal number: the watching thread's cue to end
_current: list["StopsFromTheStart"] = []


def current() -> "StopsFromTheStart | None":
    """The process's `StopsFromTheStart`, if one is entered (the CLI's `train`)."""
    return _current[-1] if _current else None


class StopBeforeFirstStep(BaseException):
    """A stop request before the first step, raised by the handler in the main thread. A
    BaseException like KeyboardInterrupt: no `except Exception` on its way out (a library's
    retry, a cleanup that logs and goes on) may swallow it."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def exit_code(signal_name: str | None) -> int:
    return exit_codes.INTERRUPTED if signal_name == "SIGINT" else exit_codes.PREEMPTED


class StopsFromTheStart:
    """Context manager: from its entry to `first_step()`, a stop request ends the process
    in one line (`describe(signal name, phase, run_dir)`, made by the run's wing: it reads
    the run directory's checkpoints) with `exit_code`. `phase` follows the run's timeline (a
    listener: `on_phase`); `events`, once set (process 0), records the stop."""

    def __init__(self, describe: Callable[[str, str, str | None], str], *,
                 grace_s: float = GRACE_S, exit: Callable[[int], None] = os._exit):
        self.describe, self.grace_s, self._exit = describe, grace_s, exit
        self.run_dir: str | None = None  # for `describe`, once the config has said it
        self.phase, self.signal_name, self.before_first_step = "startup", None, True
        self.events = None
        self.before_exit: Callable[[], None] = lambda: None  # the watcher's exit: the timeline
        self._said = False
        self._lock = threading.RLock()  # the watcher's exit against first_step and say
        self._handled = threading.Event()  # the main thread said it, or the block ended
        self._previous: dict[int, object] = {}
        self._wakeup, self._thread = None, None

    def __enter__(self) -> "StopsFromTheStart":
        if threading.current_thread() is not threading.main_thread():
            return self  # handlers are the main thread's to set: no early stops here
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block on it
        self._wakeup = (read_fd, write_fd,
                        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False))
        self._thread = threading.Thread(target=self._watch, name="stop-before-first-step",
                                        daemon=True)
        self._thread.start()
        _current.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        _current.remove(self)
        read_fd, write_fd, previous_fd = self._wakeup
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._handled.set()
        os.write(write_fd, _SENTINEL)
        self._thread.join()
        os.close(read_fd)
        os.close(write_fd)

    def reclaim(self) -> None:
        """Set the handlers again after a library took the signals: jax.distributed's
        preemption notifier catches SIGTERM in C++ when a job's process joins, and a
        request would then be swallowed until the loop's own handlers (distributed.py)."""
        if self._thread is not None:
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)

    def on_phase(self, phase: str, _step: int | None = None) -> None:
        """A Timeline listener: the phase a stop is said to come in."""
        self.phase = phase

    def first_step(self) -> None:
        """The first step is dispatched: from now on the loop's agreed stop saves it."""
        with self._lock:
            self.before_first_step = False

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.before_first_step:
            if self.signal_name is None:  # a second request waits for the first's exit
                self.signal_name = name
                raise StopBeforeFirstStep(name)
            return
        # after the loop (its own handlers are gone again): the final save ends the run
        if name == "SIGINT":
            raise KeyboardInterrupt
        logs.signal_safe_line("WARNING", __name__, f"{name} received after the last step: "
                              "the run ends once its final save is written")

    def record(self, signal_name: str | None = None) -> None:
        """The `preempted` event of a stop before the first step (once; process 0), while
        the run lock is held: nothing saved, `saved` false."""
        events, self.events = self.events, None
        name = signal_name or self.signal_name
        if events is not None:
            try:  # at debug level: the one line on stderr is `say`'s
                events("preempted", self._describe(name), level=logging.DEBUG,
                       step=None, signal=name, phase=self.phase, saved=False)
            except Exception:  # noqa: BLE001 (a full disk must not stop the exit)
                pass

    def say(self, signal_name: str) -> int:
        """The one line (once) and the exit code of a stop before the first step; in a job
        the process leaves at once (a normal exit would wait in jax's shutdown barrier for
        processes that may still be compiling)."""
        code = exit_code(signal_name)
        with self._lock:
            if self._said:
                return code
            self._said = True
        self.record(signal_name)
        line = f"europa-jax: {self._describe(signal_name)}\n"
        _write_stderr(own_line() + line)
        self._handled.set()
        if distributed.join_seconds() is not None:
            _leave(self._exit, code)
        return code

    def _describe(self, signal_name: str) -> str:
        try:
            return self.describe(signal_name, self.phase, self.run_dir)
        except Exception:  # noqa: BLE001 (a line that cannot be made must not stop the exit)
            return (f"stop requested ({signal_name}) before the first step: nothing new to "
                    "save; the same command resumes")

    def _watch(self) -> None:
        """The thread: woken by every signal's byte; a stop request the main thread has
        not handled within `grace_s` (it is in native code) ends the process here."""
        read_fd = self._wakeup[0]
        stops = {int(sig) for sig in STOP_SIGNALS}
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data or _SENTINEL[0] in data:
                return
            caught = [b for b in data if b in stops]
            if not caught or not self.before_first_step:
                continue
            if self._handled.wait(self.grace_s):
                return
            with self._lock:
                if not self.before_first_step or self._said:
                    continue
                name = self.signal_name or signal.Signals(caught[0]).name
                try:
                    try:
                        self.before_exit()  # the timeline's last line: the phase it ends
                    except Exception:  # noqa: BLE001 (nothing may stop the exit)
                        pass
                    self.say(name)
                finally:
                    _leave(self._exit, exit_code(name))
                return


def own_line(stream=None) -> str:
    """"\n" when `stream` (stderr) is a terminal: a line written now starts on a line of
    its own, not after the progress bar (drawn with "\r", no newline) or a `^C`."""
    stream = stream or sys.stderr
    try:
        return "\n" if stream.isatty() else ""
    except (AttributeError, ValueError):  # no file behind it, or closed
        return ""


def _write_stderr(text: str) -> None:
    """One os.write: the main thread may be anywhere (inside a print, in native code)."""
    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 (another thread inside it: the line still goes out)
        pass
    try:
        os.write(logs.stderr_fd(), text.encode())
    except OSError:
        pass


def _leave(exit: Callable[[int], None], code: int) -> None:
    """End the process now (a job's process, or one stuck in native code), the logs
    flushed. Not `peer_lost.leaving()`: the others should find this one lost and leave
    for requeue too (peer_lost.py), not wait for it."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 (nothing may stop the exit)
        pass
    exit(code)
