"""What the loop does after each step: a fixed sequence of hooks, each answering a `Verdict`.

The loop draws a batch, takes the step, agrees with the other processes on stop requests,
then asks each hook in a fixed order (loop.after_step_hooks) what the step means —
continue, save, roll back or stop — and acts on the strongest answer. A resilience feature
is one more hook here (or an `after_step` method next to its logic: guards.py, spikes.py),
not another branch of the loop.

A stop that saves nothing (a non-finite step, a failed save, too many spikes) is not a
verdict but an exception, raised by the hook that finds it: the loop's `finally` and
outcome.py (the exit code) handle it like any other error.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import Callable, Protocol

import jax
import numpy as np

from europa_jax.config import Config
from europa_jax.data import pipeline
from europa_jax.model import flops
from europa_jax.records import run_log
from europa_jax.records.stragglers import StepTimes
from europa_jax.run.profiler import memory_report

# The loop's lines under the loop's name, as before the hooks left loop.py: a log filter
# or a grep for `europa_jax.run.loop` still finds them.
log = logging.getLogger("europa_jax.run.loop")


class Action(enum.IntEnum):
    """What a step means to the run; a larger value overrides a smaller one."""
    CONTINUE = 0
    SAVE = 1  # a checkpoint now (train.steps, checkpoint.every_steps)
    ROLL_BACK = 2  # the step's update must not stay (a loss spike): back to the last save
    STOP = 3  # save, then end the run (an agreed stop request: preemption, Ctrl-C)


@dataclasses.dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""  # a save's `reason` (checkpoint meta, events) or why a step is a spike

    @property
    def saves(self) -> bool:
        return self.action in (Action.SAVE, Action.STOP)


CONTINUE = Verdict(Action.CONTINUE)


@dataclasses.dataclass
class StepTaken:
    """One step as the hooks see it. Hooks must not keep it: it holds the train state,
    which a rollback frees before the restore allocates another."""
    step: int  # 1-based: the step just taken
    state: object
    metrics: dict  # on the host
    host_batch: dict  # this process's rows
    step_time_s: float  # dispatch to metrics on the host
    began: float  # time.perf_counter() at the batch draw (after the compile on the first)
    first: bool  # this try's first step: its compile is behind it
    stopping: bool  # a stop request, agreed on by every process after this same step
    times: StepTimes | None  # every process's host and device times, when compared


class AfterStep(Protocol):
    def after_step(self, taken: StepTaken) -> Verdict: ...


def judge(hooks: list[AfterStep], taken: StepTaken) -> Verdict:
    """Each hook in order; the strongest verdict. A rollback or a stop ends the sequence:
    the hooks after it would validate, evaluate or save a step that is being undone, or
    spend a stop signal's grace time."""
    verdict = CONTINUE
    for hook in hooks:
        answer = hook.after_step(taken)
        if answer.action > verdict.action:
            verdict = answer
        if answer.action >= Action.ROLL_BACK:
            break
    return verdict


class FirstStepReport:
    """After this try's first step: the devices' memory (to hold against `europa-jax plan`)
    and how long the try took to get there (the `start_phases` event)."""

    def __init__(self, events: run_log.EventLog, start):
        self.events, self.start = events, start

    def after_step(self, taken: StepTaken) -> Verdict:
        if taken.first:
            memory = memory_report(taken.state)
            self.events("memory", run_log.memory_line(taken.step, memory), step=taken.step,
                        **memory)
            self.start.first_step_s = time.perf_counter() - taken.began
            self.events("start_phases", self.start.line(taken.step), step=taken.step,
                        **self.start.fields())
        return CONTINUE


class StepRecords:
    """Every `train.log_every` steps and the last: the step's record in metrics.jsonl and
    the trackers, its log line, and stragglers named from the processes' timings; the
    progress bar every step. Before the guards: a step that stops the run is on record."""

    def __init__(self, cfg: Config, host_batches: pipeline.BatchIterator, metrics_log,
                 log_line: Callable[[dict], None], progress, monitor, logged: list[dict]):
        self.cfg, self.host_batches, self.metrics_log = cfg, host_batches, metrics_log
        self.log_line, self.progress, self.monitor = log_line, progress, monitor
        self.logged = logged  # what train() returns: this invocation's records

    def after_step(self, taken: StepTaken) -> Verdict:
        if (taken.step - 1) % self.cfg.train.log_every == 0 or taken.step == self.cfg.train.steps:
            record = step_record(self.cfg, taken.step, taken.metrics, taken.step_time_s,
                                 taken.host_batch, compiled=taken.first,
                                 stats=self.host_batches.stats)
            self.logged.append(record)
            if taken.times is not None:
                record.update(taken.times.summary(self.monitor.nodes))
                self.monitor.check(taken.step, taken.times)
            self.metrics_log(record)
            self.log_line(record)
        self.progress(taken.step - 1, taken.metrics)
        return CONTINUE


class HeldOutValidation:
    """Every `train.eval_every` steps: the held-out loss (loop.Validation)."""

    def __init__(self, validation, every: int, trainer, clock, metrics_log):
        self.validation, self.every, self.trainer = validation, every, trainer
        self.clock, self.metrics_log = clock, metrics_log

    def after_step(self, taken: StepTaken) -> Verdict:
        if taken.step % self.every == 0:
            self.clock.phase("validation")
            record = self.validation.evaluate(self.trainer, taken.state, taken.step)
            self.metrics_log(record)
            log.info(f"step {taken.step} val_loss {record['val_loss']:.4f} perplexity "
                     f"{record['val_perplexity']:.2f} ({record['val_tokens']:,} tokens)")
        return CONTINUE


class DownstreamTasks:
    """When due: the downstream tasks of `train.eval_tasks` (loop.PeriodicEvaluation)."""

    def __init__(self, tasks, last_step: int, trainer, clock, watchdog, metrics_log):
        self.tasks, self.last_step, self.trainer = tasks, last_step, trainer
        self.clock, self.watchdog, self.metrics_log = clock, watchdog, metrics_log

    def after_step(self, taken: StepTaken) -> Verdict:
        # not when preempted: the save must come within the signal's grace time
        if not taken.stopping and self.tasks.due(taken.step, self.last_step):
            self.clock.phase("validation")  # goodput counts it as evaluation time
            self.watchdog.note("downstream tasks")
            record = self.tasks.evaluate(self.trainer, taken.state, taken.step,
                                         progress=self.watchdog.progress)
            self.metrics_log(record)
            log.info(self.tasks.line(record))
        return CONTINUE


class AgreedStop:
    """A stop request (SIGTERM, SIGUSR1, Ctrl-C) that every process agreed on after this
    step: save it, then end the run for a requeue."""

    def after_step(self, taken: StepTaken) -> Verdict:
        return Verdict(Action.STOP, "preempted") if taken.stopping else CONTINUE


class DueSaves:
    """The periodic saves (`checkpoint.every_steps`) and the final one."""

    def __init__(self, ckpt, last_step: int):
        self.ckpt, self.last_step = ckpt, last_step

    def after_step(self, taken: StepTaken) -> Verdict:
        if not self.ckpt.due(taken.step):
            return CONTINUE
        return Verdict(Action.SAVE, "final" if taken.step == self.last_step else "periodic")


def step_record(cfg: Config, step: int, metrics: dict, step_time: float, host_batch,
                compiled: bool, stats: pipeline.BatchStats) -> dict:
    """A step's line of metrics.jsonl: its metrics, throughput and MFU, the batch's balance."""
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    peak = cfg.train.peak_flops_per_device.get(jax.devices()[0].platform, float("nan"))
    pairs = flops.causal_pairs(host_batch["segment_ids"]) * jax.process_count()
    step_flops = flops.train_flops(cfg.model, tokens_per_step, pairs)
    values = {k: np.asarray(v).tolist() if np.ndim(v) else float(v) for k, v in metrics.items()}
    record = {"step": step, **values, "step_time_s": step_time,
              "tokens_per_s_per_device": tokens_per_step / step_time / jax.device_count(),
              "mfu": step_flops / step_time / jax.device_count() / peak,
              "attention_cost_max_over_mean": stats.attention_cost_max_over_mean,
              "node_attention_cost_max_over_mean": stats.node_attention_cost_max_over_mean,
              "compiled": compiled}
    if len(stats.source_tokens_I) > 1:  # a mixture (data.sources): each source's share, epochs
        record["source_token_fraction"] = (stats.source_tokens_I / tokens_per_step).tolist()
        record["source_epochs"] = stats.source_epochs_I.tolist()
    return record
