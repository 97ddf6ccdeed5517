"""Loss spikes: a finite step that trained on something it should not have.

A step whose loss or gradient norm is NaN/Inf never changes the state (train.py) and
guards.py decides whether the run goes on. A finite step can still wreck the weights — a
loss of 2e7 at a learning rate 10⁶ times too high, a bad batch — and once its update is
applied every later checkpoint holds the damage. `SpikeGuard` watches each step's loss and
gradient norm against the healthy steps before it (the last `checkpoint.spike_window`;
OLMo-core's SkipStepOptimizer: 128 steps, 6σ). With at least MIN_HISTORY of them, a step
rolls back when

- its loss exceeds their mean + `spike_sigmas`·σ (and by at least 10 % of the mean: a
  window of near-equal values would otherwise call any rise a spike); or
- its gradient norm does, and its loss is up too (over mean + LOSS_RISE_SIGMAS·σ), or
  nothing clips the update (optim.clip_grad_norm 0).

A gradient-norm excursion alone is a `grad_norm_spike` warning, not a rollback: under the
clip its update is no larger than any other step's, and the loss is what a damaging update
shows (a bad batch's own loss, or the next steps'). Measured on the README's default run
(configs/tiny-cpu.yaml, 200 steps, clip 1.0; tests/test_spikes.py keeps part of its
trace): against the 8 steps a new try had before its window was saved, step 166's gradient
norm stood 8.1σ out (1.30 against 0.86) with its loss 0.5σ *below* the mean — the old
rule's rollback (issue 61: "grad_norm 11.32 > 11.19" at step 118 on an earlier tree); the
loss never stood more than 2.7σ out with 14 steps or more (5.2σ with 8, under the 10 %
floor), none with 128. A bad batch's loss stands far out (the scrambled batch of the
tests: 6.2 where the steps before it were near 3.7). Before MIN_HISTORY steps a step rolls
back when its loss exceeds SPIKE_OVER_UNIFORM × ln(vocab): twice the loss of predicting
every token uniformly, which no healthy step of any model reaches.

The window survives tries: each checkpoint's meta keeps it (WINDOW_KEY), a resume and a
rollback take it back from there. (Without it a new try judged its first steps against
only its own: a resume with a new learning rate rolled back 15 steps later.)

The update of a spike has already been applied (the statistic lives on the host and the
step donates its input), so the loop rolls back: the last checkpoint is restored and
training goes on with the batches after the spike, which are never applied to the
restored weights (PaLM's remedy: restart before the spike and skip the batches around
it, arXiv 2204.02311 §5.1). The step count goes back with the weights; metrics.jsonl
keeps the spiking steps' records and the rerun's.

A checkpoint saved just before the damage shows holds it: the loss of step S+1 is the
first to see step S's update. So a checkpoint is provisional until SETTLE_STEPS healthy
steps follow it (≈ 1/(1 − adam_b1): a bad gradient's momentum acts on ~10 more updates). A
rollback may land on a provisional checkpoint once — a bad batch's spike costs no more
than the steps since it — but when the retry spikes again before it settles, the damage is
in its weights: it is set aside (corrupt_checkpoints/, kept) and the rollback goes one
further back. (The checkpoint a try resumes from counts as settled: a run that stopped
here set its provisional ones aside.) After `checkpoint.max_spike_rollbacks` rollbacks
with no checkpoint settling between them the run stops (exit 3), setting aside its
provisional checkpoints so that no resume starts from a blow-up, and names the way on:
`train --rollback-to STEP` (roll_back_to) resumes from an earlier checkpoint, e.g. with a
lower learning rate, or `--start-over` when none is left.
"""

from __future__ import annotations

import collections
import logging
import math
import shutil
from pathlib import Path
from typing import Callable

import jax

from europa_jax.config import CheckpointConfig, Config, ConfigError
from europa_jax.job import distributed
from europa_jax.run.step_hooks import Action, CONTINUE, StepTaken, Verdict
from europa_jax.store import saved_checkpoints

log = logging.getLogger(__name__)

MIN_HISTORY = 8  # healthy steps before the window's statistic is trusted
SPIKE_OVER_UNIFORM = 2.0
RELATIVE_FLOOR = 0.1
LOSS_RISE_SIGMAS = 3.0  # a grad-norm excursion rolls back when its loss is this far up
SETTLE_STEPS = 10  # ≈ 1/(1 − adam_b1): the steps a bad update's momentum still acts on
WINDOW_KEY = "spike_window"  # the checkpoint meta's copy of the window: [[step, loss, gn]]
ROLLED_BACK_SUBDIR = "rolled_back_checkpoints"  # where --rollback-to moves the later ones


class SpikeStop(Exception):
    """The run kept spiking after rolling back: it stops (exit 3) and says how to go on."""


class SpikeGuard:
    def __init__(self, cfg: CheckpointConfig, vocab_size: int, *, clipped: bool = True,
                 events: Callable | None = None, window: list | tuple = ()):
        self.cfg = cfg
        self.uniform_loss = math.log(vocab_size)
        self.clipped = clipped  # optim.clip_grad_norm > 0 bounds a large gradient's update
        self.events = events  # the run's EventLog, for the excursions it lets pass
        self.window: collections.deque = collections.deque(maxlen=max(cfg.spike_window, 1))
        self.window.extend(tuple(row) for row in window)
        self.rollbacks = 0  # since a checkpoint last settled
        self.provisional: list[int] = []  # saved by this try, not yet settled
        self.retried: set[int] = set()  # provisional checkpoints a rollback already restored

    @classmethod
    def for_run(cls, cfg: Config, restored_meta: dict | None,
                events: Callable | None = None) -> SpikeGuard:
        """The run's guard; a resumed run's window is the one saved with the checkpoint it
        restored (`restored_meta`; None for a fresh start), so a new try judges its first
        steps against the steps before them (every process restored the same: all decide
        alike). A checkpoint saved before the window was kept gives an empty one."""
        return cls(cfg.checkpoint, cfg.model.vocab_size, clipped=cfg.optim.clip_grad_norm > 0,
                   events=events, window=(restored_meta or {}).get(WINDOW_KEY) or ())

    @property
    def enabled(self) -> bool:
        return self.cfg.spike_window > 0

    def check(self, step: int, metrics: dict) -> str | None:
        """Why step `step` must be rolled back, or None: then it joins the window (a
        gradient-norm excursion the clip bounded too, said as a `grad_norm_spike` event:
        a lasting rise in the gradient norm widens the window instead of warning on every
        step). Non-finite steps are guards.py's and are not looked at."""
        if not self.enabled or not bool(metrics["finite"]):
            return None
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        why, excursion = self._why(loss, grad_norm)
        if why is not None:
            return why
        if excursion is not None and self.events is not None:  # a warning: shows under --quiet
            self.events("grad_norm_spike", f"step {step}: {excursion}: the clip bounds its "
                        "update and the loss did not rise: not rolled back",
                        level=logging.WARNING, step=step, reason=excursion, loss=loss,
                        grad_norm=grad_norm)
        self.window.append((step, loss, grad_norm))
        self._settle(step)
        return None

    def after_step(self, taken: StepTaken) -> Verdict:
        """A spike's update is in the state already: roll back (loop.py restores the last
        checkpoint; `rolled_back` and `restored` are told)."""
        why = self.check(taken.step, taken.metrics)
        return CONTINUE if why is None else Verdict(Action.ROLL_BACK, why)

    def _why(self, loss: float, grad_norm: float) -> tuple[str | None, str | None]:
        """(why the step rolls back, a gradient-norm excursion only to report)."""
        if len(self.window) < MIN_HISTORY:
            limit = SPIKE_OVER_UNIFORM * self.uniform_loss
            if loss > limit:
                return (f"loss {loss:.4g} > {SPIKE_OVER_UNIFORM:g} × ln(vocab) = {limit:.4g} "
                        "(twice a uniform prediction's loss)"), None
            return None, None
        n = len(self.window)
        loss_mean, loss_sigma = _stats(row[1] for row in self.window)
        limit = self._limit(loss_mean, loss_sigma, self.cfg.spike_sigmas)
        if loss > limit:
            return (f"loss {loss:.4g} > {limit:.4g} (mean {loss_mean:.4g} + "
                    f"{self.cfg.spike_sigmas:g}σ of the last {n} steps)"), None
        mean, sigma = _stats(row[2] for row in self.window)
        limit = self._limit(mean, sigma, self.cfg.spike_sigmas)
        if grad_norm <= limit:
            return None, None
        excursion = (f"grad_norm {grad_norm:.4g} > {limit:.4g} (mean {mean:.4g} + "
                     f"{self.cfg.spike_sigmas:g}σ of the last {n} steps)")
        if not self.clipped:
            return f"{excursion}, unclipped (optim.clip_grad_norm 0)", None
        rise = self._limit(loss_mean, loss_sigma, LOSS_RISE_SIGMAS)
        if loss > rise:
            return (f"{excursion} with loss {loss:.4g} > {rise:.4g} (mean + "
                    f"{LOSS_RISE_SIGMAS:g}σ)"), None
        return None, excursion

    @staticmethod
    def _limit(mean: float, sigma: float, sigmas: float) -> float:
        # at least RELATIVE_FLOOR above the mean: a window of near-equal values (σ ≈ 0)
        # would call any small rise a spike
        return mean + max(sigmas * sigma, RELATIVE_FLOOR * abs(mean))

    # ------------------------------------------------------------ checkpoints and rollbacks

    def saved(self, step: int) -> None:
        """A checkpoint of step `step` was saved: provisional until SETTLE_STEPS healthy
        steps follow it."""
        self.provisional.append(step)
        self.retried.discard(step)  # a new save of a step set aside before

    def _settle(self, step: int) -> None:
        settled = [s for s in self.provisional if step >= s + SETTLE_STEPS]
        if settled:  # the rollbacks before it are behind the run
            self.provisional = [s for s in self.provisional if s not in settled]
            self.retried -= set(settled)
            self.rollbacks = 0

    def window_to_save(self) -> list[list[float]]:
        """The window as a checkpoint's meta keeps it (WINDOW_KEY)."""
        return [list(row) for row in self.window]

    def rolled_back(self, step: int, why: str, committed: list[int],
                    set_aside: Callable[[int], None]) -> list[int]:
        """Count a rollback of the spike at `step` and set aside (`set_aside(step)`) the
        checkpoints it blames among `committed`; returns those left. Past
        `checkpoint.max_spike_rollbacks` since a checkpoint last settled, raises SpikeStop
        (naming the way on) after setting aside every provisional one: saved within
        SETTLE_STEPS of the spikes, a resume must not start there."""
        self.rollbacks += 1
        stopping = self.rollbacks > self.cfg.max_spike_rollbacks
        # a provisional checkpoint that a rollback already restored, whose retry spiked
        # again before it settled: the damage is in its weights, not in a batch
        blamed = [s for s in committed if s in self.retried
                  or (stopping and s in self.provisional)]
        for s in blamed:
            set_aside(s)
        kept = [s for s in committed if s not in blamed]
        self.provisional = [s for s in self.provisional if s not in blamed]
        self.retried -= set(blamed)
        if stopping:
            raise SpikeStop(f"step {step}: {why}; {self.rollbacks - 1} rollbacks did not "
                            f"help (checkpoint.max_spike_rollbacks="
                            f"{self.cfg.max_spike_rollbacks}): " + way_on(kept, blamed))
        return kept

    def restored(self, step: int, window: list | None = None) -> None:
        """The weights are step `step`'s again: the window is the one saved with them
        (`window`, from the checkpoint's meta), else the live window's steps up to `step`.
        The steps after it describe weights that no longer exist — after a rollback to the
        initial weights, a trained model's losses would call the first step's a spike."""
        kept = ([tuple(row) for row in window] if window is not None
                else [row for row in self.window if row[0] <= step])
        self.window.clear()
        self.window.extend(kept)
        self.provisional = [s for s in self.provisional if s <= step]
        if step in self.provisional:
            self.retried.add(step)  # a second spike before it settles blames it


def _stats(values) -> tuple[float, float]:
    values = list(values)
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def way_on(kept: list[int], set_aside: list[int]) -> str:
    """What a stopped run's user can do (SpikeStop's message)."""
    aside = (f"checkpoint(s) {', '.join(map(str, set_aside))} (saved just before the spikes) "
             f"set aside in {saved_checkpoints.CORRUPT_SUBDIR}/; " if set_aside else "")
    if not kept:
        return (aside + "no checkpoint is left: `europa-jax train … --start-over` begins again "
                "at step 0 (e.g. with a lower optim.learning_rate)")
    return (aside + f"the checkpoints left are steps {', '.join(map(str, kept))}: the same "
            f"command resumes from {kept[-1]}; `europa-jax train … --rollback-to STEP` "
            "resumes from an earlier one, setting the later ones aside (e.g. with a lower "
            "optim.learning_rate: --set optim.learning_rate=…)")


def roll_back_to(run_dir: str | Path, step: int, is_primary: bool) -> list[int]:
    """`train --rollback-to STEP`: the checkpoints after committed step `step` moved to
    ROLLED_BACK_SUBDIR (kept, out of the resume's way); returns their steps. The resume
    then starts at `step`, reading the data from its position. Call it on every process
    under the run lock, before the checkpoints are listed; process 0 moves."""
    committed = saved_checkpoints.committed_steps(run_dir)
    if step not in committed:
        raise ConfigError(f"--rollback-to {step}: not a checkpoint of {run_dir} (have "
                          f"{', '.join(map(str, committed)) or 'none'})")
    later = [s for s in committed if s > step]
    if is_primary and later:
        target = Path(run_dir) / ROLLED_BACK_SUBDIR
        target.mkdir(parents=True, exist_ok=True)
        for s in later:
            name, n = str(s), 0
            while (target / name).exists():  # rolled back past the same step before
                n += 1
                name = f"{s}.{n}"
            shutil.move(str(saved_checkpoints.checkpoint_dir(run_dir) / str(s)), target / name)
        log.warning(f"--rollback-to {step}: checkpoint(s) {', '.join(map(str, later))} moved "
                    f"to {target}; resuming from step {step}")
    if jax.process_count() > 1:
        distributed.all_processes(True)  # barrier: nobody lists steps before the move
    return later
