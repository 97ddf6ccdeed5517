"""The training loop: data → sharded batches → `train_step`, metrics.jsonl, progress.

Around the step: the run directory's lock (run_lock.py), resume from its checkpoints, the
compile, the profiler window and agreed stop requests (preemption.py). After it, a fixed
sequence of hooks (`after_step_hooks`, step_hooks.py) says whether to continue, save, roll
back or stop: the step's records, the non-finite policy, loss spikes, validation and the
downstream tasks (`train.eval_tasks`, given by the caller: europa_jax/eval/), what a failed
save means (SaveGuard), periodic/final/preemption saves; the loop acts on the answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Callable, Iterator, Protocol

import jax
import numpy as np

from europa_jax.config import check_device_count, Config, ConfigError
from europa_jax.config_loader import to_dict
from europa_jax.data import pipeline, sources as data_sources
from europa_jax.data.corpus import DataError
from europa_jax.store import checkpoint, compile_cache, history, resume_changes, run_lock
from europa_jax.job import distributed, logs, peer_lost, preemption
from europa_jax.run import fault_injection, spikes as spike_guard, step_hooks
from europa_jax.records import run_log, timeline, trackers
from europa_jax.run.guards import NonFiniteGuard, NonFiniteStop, SaveGuard  # noqa: F401
from europa_jax.job.preemption import Preempted, StopBeforeFirstStep, StopRequests
from europa_jax.run.profiler import Profiler
from europa_jax.run.start_phases import StartPhases
from europa_jax.records.run_log import EventLog, MetricsLog
from europa_jax.run.spikes import SpikeGuard
from europa_jax.run.step_hooks import Action, StepRecords, StepTaken
from europa_jax.records.stragglers import StepTimes, StragglerMonitor
from europa_jax.job.watchdog import HangWatchdog
from europa_jax.train.train import (build_trainer, init_state, jit_eval_step, jit_train_step,
                                    Trainer)

log = logging.getLogger(__name__)


def device_batches(trainer: Trainer, host_batches: Iterator[dict[str, np.ndarray]]):
    """Each process's rows → one global array sharded over the mesh (no host gathers).

    Pulls exactly one host batch per yield (the host iterator prefetches in its own
    thread), so `host_batches.get_state()` always names the batch after the last yielded.
    """
    for host_batch in host_batches:
        yield host_batch, {k: jax.make_array_from_process_local_data(trainer.batch_sharding, v)
                           for k, v in host_batch.items()}


def host_batch_iterator(cfg: Config) -> pipeline.BatchIterator:
    """This process's rows of each balanced global batch; checkpoint it with get/set_state."""
    return data_sources.batch_iterator_for(cfg, process_index=jax.process_index(),
                                   process_count=jax.process_count())


class PeriodicEvaluation(Protocol):
    """An evaluation the loop runs after some steps with the live train state: the
    downstream tasks of `train.eval_tasks` (eval/during_training.py, a wing above this
    one, hence handed in by the caller). Its record goes to metrics.jsonl and the
    trackers; `progress` is to be called as its work advances (the hang watchdog)."""

    def due(self, step: int, last_step: int) -> bool: ...

    def evaluate(self, trainer: Trainer, state, step: int,
                 progress: Callable[[], None]) -> dict: ...

    def line(self, record: dict) -> str: ...


def train(cfg: Config, run_dir: str | Path | None = None, *,
          tasks: PeriodicEvaluation | None = None, start_over: bool = False,
          rollback_to: int | None = None) -> list[dict]:
    """Run to `cfg.train.steps`, resuming from the run directory's latest valid checkpoint.

    `tasks` runs `train.eval_tasks` (cli.py makes it: eval/during_training.py); a config
    that names tasks without it is refused. Returns the metrics logged by this
    invocation (metrics.jsonl holds the whole run).
    A directory that once saved a checkpoint and has none left is refused
    (`history.HistoryWouldBeLost`) unless `start_over` (history.py).
    Raises `RunDirInUse` when another command holds the run directory, `Preempted` after
    saving on SIGTERM/SIGUSR1, `NonFiniteStop` on a non-finite step under
    `checkpoint.nan_policy`, `SaveFailed` on a failed save under `checkpoint.on_save_error`.
    """
    logs.ensure_configured()
    if cfg.train.eval_tasks and tasks is None:
        raise ConfigError(f"train.eval_tasks: {list(cfg.train.eval_tasks)} but no task "
                          "evaluation was given to the loop (europa_jax.eval.during_training."
                          "TaskEvaluation, as `europa-jax train` makes it)")
    check_device_count(cfg.mesh, jax.device_count())
    is_primary = jax.process_index() == 0
    trackers.check_trackers(cfg.train.trackers, is_primary)  # before the run dir is touched
    host_batches = host_batch_iterator(cfg)  # corpus errors surface before any compile
    validation = Validation(cfg) if cfg.train.eval_every else None
    run_dir = Path(run_dir or cfg.train.run_dir)
    if jax.process_count() > 1:
        peer_lost.watch(run_dir, jax.process_index())  # where a lost peer is reported
    with run_lock.hold(run_dir, "train"):  # before anything is written there
        if rollback_to is not None:  # `train --rollback-to STEP` (spikes.py)
            spike_guard.roll_back_to(run_dir, rollback_to, is_primary)
        # checkpoints set aside by an earlier try leave none: a requeue must not start over
        found = ([] if checkpoint.committed_steps(run_dir)
                 else history.check_start(run_dir, start_over))
        return _train(cfg, run_dir, host_batches, validation, tasks, found)


def _train(cfg: Config, run_dir: Path, host_batches: pipeline.BatchIterator,
           validation: Validation | None, tasks: PeriodicEvaluation | None,
           starting_over: list[str]) -> list[dict]:
    is_primary = jax.process_index() == 0
    if is_primary:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    compile_cache.use_cache(cfg.train.compile_cache_dir, run_dir)  # before any compile
    events = EventLog(run_dir, is_primary)
    clock = timeline.Timeline(run_dir, is_primary,
                              timeline.next_try(run_dir) if is_primary else 0)
    watchdog = HangWatchdog(cfg.train.hang_timeout_s, process_index=jax.process_index(),
                            process_count=jax.process_count(),
                            events=events if is_primary else None, before_exit=clock.close)
    clock.listeners.append(watchdog.on_phase)
    stops = preemption.current()  # the CLI's: a stop before the first step ends the run
    if stops is not None:
        clock.listeners.append(stops.on_phase)  # the phase its line names
        stops.events, stops.before_exit = (events if is_primary else None), clock.close
    clock.listeners.append(fault_injection.signal_at)  # a test's signal at a phase
    with watchdog if cfg.train.hang_watchdog else contextlib.nullcontext():
        try:
            return _steps(cfg, run_dir, host_batches, validation, tasks, events, clock,
                          watchdog, starting_over)
        except StopBeforeFirstStep:
            if stops is not None:
                stops.record()  # while the run lock is held
            raise
        finally:
            clock.close()


def _steps(cfg: Config, run_dir: Path, host_batches: pipeline.BatchIterator,
           validation: Validation | None, tasks: PeriodicEvaluation | None, events: EventLog,
           clock: timeline.Timeline, watchdog: HangWatchdog,
           starting_over: list[str]) -> list[dict]:
    is_primary = jax.process_index() == 0
    mesh = distributed.job_mesh(cfg.mesh)  # expert rows pinned to nodes, across processes
    trainer = build_trainer(cfg, mesh)
    ckpt = checkpoint.Checkpointer(cfg, run_dir, trainer)
    if cfg.checkpoint.keep == 1 and is_primary:
        log.warning("checkpoint.keep: 1 keeps a single checkpoint: if it is damaged (a kill "
                    "during its write, a bad disk) nothing is left to resume from; 2 or more "
                    "keep a fallback")
    saves = SaveGuard(ckpt, cfg.checkpoint, events)
    start = StartPhases(startup_s=clock.phase("restore"))
    state, start_step, restored_meta = _resume(cfg, run_dir, ckpt, trainer, events,
                                               host_batches, starting_over, start)
    step_fn, executable = jit_train_step(trainer), None
    spikes = SpikeGuard.for_run(cfg, restored_meta, events)  # the window saved with it
    profiler = Profiler(cfg, run_dir)
    faults = fault_injection.Faults(jax.process_index())
    # one process has no one to straggle behind
    timed = cfg.train.straggler_factor > 0 and jax.process_count() > 1
    monitor = StragglerMonitor(cfg.train.straggler_factor, cfg.train.straggler_steps,
                               distributed.nodes(), events if is_primary else None)
    logged = []
    progress, log_line = run_log.progress(cfg.train.steps)
    try:
        with MetricsLog(run_dir, start_step, is_primary, to_dict(cfg),
                        cfg.train.trackers) as metrics_log, \
                jax.set_mesh(mesh), StopRequests() as stop:
            records = StepRecords(cfg, host_batches, metrics_log, log_line, progress, monitor,
                                  logged)
            hooks = after_step_hooks(cfg, trainer, events, clock, watchdog, start, records,
                                     metrics_log, saves, spikes, ckpt, validation, tasks)
            batches = device_batches(trainer, host_batches)
            step, first = start_step, True
            while step < cfg.train.steps:
                done = step + 1
                phase_s = clock.phase("step", done)  # the previous step's or the restore's
                if first:
                    start.restore_s = phase_s
                watchdog.note("waiting for its batch")
                began = time.perf_counter()
                try:
                    host_batch, batch = next(batches)
                except DataError as e:  # a shard changed under the run: say so in the record
                    events("data_error", str(e), level=logging.ERROR, step=done, error=str(e))
                    raise
                # Taken right after the batch is drawn: the position a resume starts from.
                data_state = host_batches.get_state()
                faults.before_step(done)
                batch = faults.bad_batch(done, batch)
                if executable is None:  # compiled here, with the batch's shapes, then met
                    executable = _compile(cfg, run_dir, step_fn, state, batch, clock, start,
                                          done)
                    began = time.perf_counter()
                profiler.before(done)
                watchdog.note("on the devices")
                dispatched = time.perf_counter()
                state, metrics = executable(state, batch)
                metrics = jax.device_get(metrics)  # waits for the step: honest step time
                step_time = time.perf_counter() - dispatched
                profiler.after(done)
                watchdog.note("agreeing on stop requests and timings")
                # same answer on every process, after the same step; the timings ride along
                stopping, rows = stop.agree_with(
                    [dispatched - began, step_time] if timed else [])
                watchdog.step_took(time.perf_counter() - began)
                taken = StepTaken(done, state, metrics, host_batch, step_time, began, first,
                                  stopping, StepTimes(rows[:, 0], rows[:, 1]) if timed else None)
                first = False
                verdict = step_hooks.judge(hooks, taken)
                taken = None  # holds the state, which a rollback frees
                if verdict.action is Action.ROLL_BACK:  # its update is in `state`
                    state = None  # freed before the restore allocates another
                    state, step = _roll_back(ckpt, saves, spikes, trainer, cfg, events,
                                             done, verdict.reason)
                    continue
                if verdict.saves:
                    _save(ckpt, saves, spikes, clock, events, done, state, data_state,
                          verdict.reason)
                if verdict.action is Action.STOP:
                    saves.check(wait=True, ending=True)  # exit for requeue only once saved
                    events("preempted", step=done, signal=stop.signal_name)
                    raise Preempted(done, stop.signal_name)
                step += 1
        clock.phase("checkpoint")
        saves.check(wait=True, ending=True)  # the final save is the run's result
    finally:
        profiler.close()
        # On the way out for another reason (an error, NonFiniteStop): the last save is
        # still waited for and reported, and that reason is the one raised.
        saves.check(wait=True, ending=True, raise_error=False)
        ckpt.close()
    progress(None, None)
    return logged


def after_step_hooks(cfg: Config, trainer: Trainer, events: EventLog, clock: timeline.Timeline,
                     watchdog: HangWatchdog, start: StartPhases, records: StepRecords,
                     metrics_log: MetricsLog, saves: SaveGuard, spikes: SpikeGuard,
                     ckpt: checkpoint.Checkpointer, validation: Validation | None,
                     tasks: PeriodicEvaluation | None) -> list[step_hooks.AfterStep]:
    """What the loop asks after each step, in this order (step_hooks.judge)."""
    return [
        step_hooks.FirstStepReport(events, start),
        records,  # before the guards: a step that stops the run is on record
        NonFiniteGuard(cfg.checkpoint, events),  # raises NonFiniteStop: nothing saved
        spikes,  # a spike rolls back: nothing after it judges the undone step
        *([step_hooks.HeldOutValidation(validation, cfg.train.eval_every, trainer, clock,
                                        metrics_log)] if validation else []),
        *([step_hooks.DownstreamTasks(tasks, cfg.train.steps, trainer, clock, watchdog,
                                      metrics_log)] if tasks is not None else []),
        saves,  # the last save's outcome, once it is known (raises SaveFailed)
        step_hooks.AgreedStop(),  # a stop saves whether or not a save is due
        step_hooks.DueSaves(ckpt, cfg.train.steps),
    ]


def _resume(cfg: Config, run_dir: Path, ckpt: checkpoint.Checkpointer, trainer: Trainer,
            events: EventLog, host_batches: pipeline.BatchIterator, starting_over: list[str],
            start: StartPhases):
    """The latest valid checkpoint's state, step (the data stream set to its position) and
    meta, or the initial state at step 0 and None; what changed since the save is said
    before it acts."""
    is_primary = jax.process_index() == 0
    restored = ckpt.restore_latest(events)
    if restored is None and is_primary:
        if not starting_over:  # say so: a resume that found nothing is a fresh run
            log.info(f"no checkpoint in {checkpoint.checkpoint_dir(run_dir)}: starting at step 0")
        # init compiles and runs a program of its own: without this line the wait after
        # the mesh line says nothing
        log.info(f"initializing the parameters and their optimizer state (train.seed "
                 f"{cfg.train.seed})")
    state = restored.state if restored else init_state(trainer, cfg.train.seed)
    start.restored = restored is not None
    if restored is None and is_primary and starting_over:  # asked for: history kept aside
        kept = history.keep_old_metrics(run_dir)
        events("started_over", f"starting over at step 0 ({history.START_OVER_FLAG}) after "
               f"{'; '.join(starting_over)}"
               + (f"; the old records are in {kept.name}" if kept else ""),
               level=logging.WARNING, found=starting_over, kept=kept and kept.name)
    if restored and is_primary:  # settings changed since the save, said before they act
        saved = restored.meta.get("config", {})
        changed = resume_changes.describe(saved, cfg, restored.step)
        for line in changed[:-1]:
            log.warning(line)
        if changed:  # the last line with the event
            values = resume_changes.changed_keys(saved, cfg)  # (key, saved, now)
            events("config_changed", changed[-1], level=logging.WARNING, step=restored.step,
                   keys=[k for k, _, _ in values],
                   changes={k: {"saved": old, "now": new} for k, old, new in values})
    if restored and restored.data_state is not None:
        host_batches.set_state(restored.data_state)
    return state, restored.step if restored else 0, restored.meta if restored else None


def _compile(cfg: Config, run_dir: Path, step_fn, state, batch, clock: timeline.Timeline,
             start: StartPhases, done: int):
    """The step compiled for the first batch's shapes (or read from the compile cache), once
    every process has it; the clock is in step `done`'s phase again after it."""
    is_primary = jax.process_index() == 0
    clock.phase("compile")
    if is_primary:  # the longest silence of a start otherwise
        log.info(compile_cache.announcement(
            jax.device_count(), compile_cache.cache_dir(cfg.train.compile_cache_dir, run_dir)))
    compiled = compile_cache.compile_step(step_fn, state, batch,
                                          barrier_timeout_s=distributed.init_timeout_s())
    if preemption.current() is not None:  # from here a stop saves the first step (the loop)
        preemption.current().first_step()
    start.compile(compiled, clock.phase("step", done))
    if is_primary:
        log.info(compile_cache.outcome(compiled, start.compile_s))
    return compiled.executable


def _save(ckpt: checkpoint.Checkpointer, saves: SaveGuard, spikes: SpikeGuard,
          clock: timeline.Timeline, events: EventLog, done: int, state, data_state,
          reason: str) -> None:
    """A save verdict's save: "periodic", "final" or "preempted"."""
    clock.phase("checkpoint")
    saves.check(wait=True)  # one save at a time: the one before must be done
    # the spike window goes with the weights: a resume or a rollback judges by it
    ckpt.save(done, state, data_state, reason=reason,
              extra={spike_guard.WINDOW_KEY: spikes.window_to_save()})
    events("checkpoint_saving", step=done, reason=reason)
    spikes.saved(done)


def _roll_back(ckpt, saves, spikes: SpikeGuard, trainer, cfg: Config, events: EventLog,
               done: int, why: str):
    """After a spike at step `done`: the last checkpoint's state (or the initial one if
    none is left) and its step; the data stream goes on after the spiking batch. A
    checkpoint the guard blames (spikes.py: its retry spiked again) is set aside first."""
    saves.check(wait=True)  # a save in flight is of a state before the spike: let it land
    committed = checkpoint.committed_steps(ckpt.run_dir)
    # raises SpikeStop past the limit, after setting aside the provisional checkpoints
    kept = spikes.rolled_back(done, why, committed, ckpt.set_aside)
    restored = ckpt.restore_latest(events) if kept else None
    target = restored.step if restored else 0
    aside = sorted(set(committed) - set(kept))
    events("loss_spike", f"step {done}: {why}: rolled back to "
           + (f"the checkpoint of step {target}" if restored else "the initial weights")
           + (f" (checkpoint(s) {', '.join(map(str, aside))} set aside: restored once "
              "already, they spiked again before settling)" if aside else "")
           + f"; training goes on with the batches after step {done}'s",
           level=logging.WARNING, step=done, reason=why, rolled_back_to=target,
           set_aside=aside)
    spikes.restored(target, restored.meta.get(spike_guard.WINDOW_KEY) if restored else [])
    state = restored.state if restored else init_state(trainer, cfg.train.seed)
    return state, target


class Validation:
    """Held-out loss on the first `train.eval_batches` batches of the validation documents.

    The batches are drawn once and kept on the devices (a few rows per device), so every
    evaluation sees exactly the same tokens; the forward is the training step's, sharded the
    same way, with no update.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Opened now, so that a bad validation corpus fails before any compile.
        self._host = data_sources.validation_iterator_for(cfg, process_index=jax.process_index(),
                                                  process_count=jax.process_count())
        self._batches = None
        self._step_fn = None

    def evaluate(self, trainer: Trainer, state, step: int) -> dict:
        if self._batches is None:
            drawn = zip(range(self.cfg.train.eval_batches), device_batches(trainer, self._host))
            self._batches = [device_batch for _, (_, device_batch) in drawn]
            self._host.close()
            self._step_fn = jit_eval_step(trainer)
        results = [self._step_fn(state, batch) for batch in self._batches]
        losses, counts = (np.array(x, dtype=np.float64) for x in zip(*jax.device_get(results)))
        loss = float((losses * counts).sum() / max(counts.sum(), 1.0))
        return {"step": step, "val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
                "val_tokens": int(counts.sum())}
