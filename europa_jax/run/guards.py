"""What the loop does with a step's outcome: the non-finite policy and saves' results.

`NonFiniteGuard` applies `checkpoint.nan_policy` to each step's `finite` flag; `SaveGuard`
reports each background save once its outcome is known and applies
`checkpoint.on_save_error`. Both are hooks the loop asks after each step (step_hooks.py).
"""

from __future__ import annotations

import logging

from europa_jax.config import CheckpointConfig
from europa_jax.store import checkpoint
from europa_jax.records.run_log import EventLog
from europa_jax.run.step_hooks import CONTINUE, StepTaken, Verdict
from europa_jax.store.save_outcome import SaveFailed


class NonFiniteStop(Exception):
    """The run stopped on a non-finite step; the last good checkpoint is untouched."""


class NonFiniteGuard:
    """Applies `checkpoint.nan_policy` to the `finite` flag of each step's metrics.

    The step itself already left the state unchanged (train.revert_if_nonfinite); this decides
    whether to go on. Every process sees the same (global) loss, so all decide alike.
    """

    def __init__(self, cfg: CheckpointConfig, events: EventLog | None = None):
        self.cfg, self.events = cfg, events  # `events`: the run's, for `after_step`
        self.consecutive = 0

    def after_step(self, taken: StepTaken) -> Verdict:
        self.check(taken.step, taken.metrics, self.events)  # raises NonFiniteStop: nothing saved
        return CONTINUE

    def check(self, step: int, metrics: dict, events: "EventLog") -> None:
        if bool(metrics["finite"]):
            self.consecutive = 0
            return
        self.consecutive += 1
        stop = self.cfg.nan_policy == "stop" or self.consecutive > self.cfg.max_consecutive_skips
        # a warning: a skipped step must show under --quiet
        events("nonfinite", level=logging.WARNING, step=step, loss=float(metrics["loss"]),
               grad_norm=float(metrics["grad_norm"]), consecutive=self.consecutive,
               action="stop" if stop else "skip")
        if stop:
            raise NonFiniteStop(f"step {step}: loss {float(metrics['loss'])}, grad_norm "
                                f"{float(metrics['grad_norm'])} ({self.consecutive} consecutive "
                                f"non-finite, checkpoint.nan_policy={self.cfg.nan_policy}); "
                                "the last checkpoint is the last good state")


class SaveGuard:
    """Reports each save's outcome once it is known and applies `checkpoint.on_save_error`.

    Saves are written in the background while training goes on; a failed one (a full
    disk) would otherwise show only in Orbax's log, or as a traceback at the next save.
    Here it is an event (`checkpoint_failed`), one log line naming the error and the last
    good checkpoint, and a decision: `stop` raises `SaveFailed`, `continue` trains on to
    the next save. A run that is ending (the final or a preemption save) stops either way.
    """

    def __init__(self, ckpt: checkpoint.Checkpointer, cfg: CheckpointConfig, events: EventLog):
        self.ckpt, self.cfg, self.events = ckpt, cfg, events

    def after_step(self, taken: StepTaken) -> Verdict:
        # Every step, without waiting: a failed save is reported once it is known, not
        # only when the next save waits for it (raises SaveFailed under on_save_error: stop).
        self.check()
        return CONTINUE

    def check(self, *, wait: bool = False, ending: bool = False,
              raise_error: bool = True) -> None:
        outcome = self.ckpt.outcome(wait)  # a collective: every process calls it alike
        if outcome is None:
            return
        if outcome.error is None:
            self.events("checkpoint_saved", step=outcome.step)
            return
        stop = ending or self.cfg.on_save_error == "stop"
        failure = SaveFailed(outcome)
        self.events("checkpoint_failed", str(failure), level=logging.ERROR, step=outcome.step,
                    error=outcome.error, last_good=outcome.last_good,
                    action="stop" if stop else "continue")
        if stop and raise_error:
            raise failure
