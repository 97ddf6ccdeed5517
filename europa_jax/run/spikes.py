"""Loss spikes: a finite step that trained on something it should not have.

A step whose loss or gradient norm is NaN/Inf never changes the state (train.py) and
guards.py decides whether the run goes on. A finite step can still wreck the weights — a
loss of 2e7 at a learning rate 10⁶ times too high, a bad batch — and once its update is
applied every later checkpoint holds the damage. `SpikeGuard` watches each step's loss and
gradient norm against the steps before it:

- with at least MIN_HISTORY healthy steps in its window (the last `checkpoint.spike_window`),
  a step is a spike when its loss or gradient norm exceeds their mean + `spike_sigmas`·σ
  (OLMo-core's SkipStepOptimizer: 128 steps, 6σ), and by at least 10 % of the mean (ours:
  a window of near-equal values would otherwise call any rise a spike);
- before that, when its loss exceeds SPIKE_OVER_UNIFORM × ln(vocab): twice the loss of
  predicting every token uniformly, which no healthy step of any model reaches.

The update of a spike has already been applied (the statistic lives on the host and the
step donates its input), so the loop rolls back: the last checkpoint — saved before the
spike, since nothing is saved after one — is restored and training goes on with the
batches after the spike, which are never applied to the restored weights (PaLM's remedy:
restart before the spike and skip the batches around it, arXiv 2204.02311 §5.1). The
step count goes back with the weights; metrics.jsonl keeps the spiking steps' records and
the rerun's. After `checkpoint.max_spike_rollbacks` rollbacks with no checkpoint saved
between them the run stops (exit 3): it is not recovering.
"""

from __future__ import annotations

import collections
import math

from europa_jax.config import CheckpointConfig
from europa_jax.run.step_hooks import Action, CONTINUE, StepTaken, Verdict

MIN_HISTORY = 8  # healthy steps before the window's statistic is trusted
SPIKE_OVER_UNIFORM = 2.0
RELATIVE_FLOOR = 0.1


class SpikeStop(Exception):
    """The run kept spiking after rolling back; its last checkpoint is the last good state."""


class SpikeGuard:
    def __init__(self, cfg: CheckpointConfig, vocab_size: int):
        self.cfg = cfg
        self.uniform_loss = math.log(vocab_size)
        self.window: collections.deque = collections.deque(maxlen=max(cfg.spike_window, 1))
        self.rollbacks = 0  # since the last checkpoint saved

    @property
    def enabled(self) -> bool:
        return self.cfg.spike_window > 0

    def check(self, step: int, metrics: dict) -> str | None:
        """Why step `step` is a spike, or None (a healthy step joins the window). Non-finite
        steps are guards.py's and are not looked at."""
        if not self.enabled or not bool(metrics["finite"]):
            return None
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        why = self._why(loss, grad_norm)
        if why is None:
            self.window.append((step, loss, grad_norm))
        return why

    def after_step(self, taken: StepTaken) -> Verdict:
        """A spike's update is in the state already: roll back (loop.py restores the last
        checkpoint; `rolled_back` and `restored` are told)."""
        why = self.check(taken.step, taken.metrics)
        return CONTINUE if why is None else Verdict(Action.ROLL_BACK, why)

    def restored(self, step: int) -> None:
        """The weights are step `step`'s again: the steps after it leave the window. They
        describe weights that no longer exist — after a rollback to the initial weights,
        a trained model's losses would call the first step's a spike, and again after
        every rollback, until the run stopped."""
        kept = [row for row in self.window if row[0] <= step]
        self.window.clear()
        self.window.extend(kept)

    def _why(self, loss: float, grad_norm: float) -> str | None:
        if len(self.window) < MIN_HISTORY:
            limit = SPIKE_OVER_UNIFORM * self.uniform_loss
            if loss > limit:
                return (f"loss {loss:.4g} > {SPIKE_OVER_UNIFORM:g} × ln(vocab) = {limit:.4g} "
                        "(twice a uniform prediction's loss)")
            return None
        for name, value, column in (("loss", loss, 1), ("grad_norm", grad_norm, 2)):
            values = [row[column] for row in self.window]
            mean = sum(values) / len(values)
            sigma = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            # at least RELATIVE_FLOOR above the mean: a window of near-equal values (σ ≈ 0)
            # would call any small rise a spike
            limit = mean + max(self.cfg.spike_sigmas * sigma, RELATIVE_FLOOR * abs(mean))
            if value > limit:
                return (f"{name} {value:.4g} > {limit:.4g} (mean {mean:.4g} + "
                        f"{self.cfg.spike_sigmas:g}σ of the last {len(values)} steps)")
        return None

    def rolled_back(self, step: int, why: str, last_good: int | None) -> None:
        """Count a rollback; raise SpikeStop past the limit."""
        self.rollbacks += 1
        if self.rollbacks > self.cfg.max_spike_rollbacks:
            good = (f"the last checkpoint, step {last_good}, was saved before any spike (the "
                    "steps before a spike may have caused it: a learning rate too high)"
                    if last_good else "no checkpoint was saved before the spikes")
            raise SpikeStop(f"step {step}: {why}; {self.rollbacks - 1} rollbacks since the "
                            f"last checkpoint did not help (checkpoint.max_spike_rollbacks="
                            f"{self.cfg.max_spike_rollbacks}): {good}")

    def saved(self) -> None:
        """A checkpoint was saved: the rollbacks before it are behind the run."""
        self.rollbacks = 0
