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
"""

from __future__ import annotations

import signal

from europa_jax.job import distributed, logs

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

    def _handle(self, signum, _frame) -> None:
        # Only a flag: the step in flight must finish, and the save must be collective.
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
