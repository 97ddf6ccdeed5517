"""The training loop: data → sharded batches → `train_step`, metrics.jsonl, progress.

Around the step: the run directory's lock (run_lock.py), resume from its checkpoints,
periodic/final/preemption saves and what a failed one means (checkpoint.py, SaveGuard),
agreed stop requests (preemption.py), the non-finite policy.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Iterator

import jax
import numpy as np

from europa_jax.config import check_device_count, CheckpointConfig, Config
from europa_jax.config_loader import to_dict
from europa_jax.data import pipeline, sources as data_sources
from europa_jax.model import flops
from europa_jax.parallel import offload
from europa_jax.run import checkpoint, distributed, logs, run_lock, run_log, trackers
from europa_jax.run.preemption import Preempted, StopRequests
from europa_jax.run.run_log import EventLog, MetricsLog
from europa_jax.run.save_outcome import SaveFailed
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


def train(cfg: Config, run_dir: str | Path | None = None) -> list[dict]:
    """Run to `cfg.train.steps`, resuming from the run directory's latest valid checkpoint.

    Returns the metrics logged by this invocation (metrics.jsonl holds the whole run).
    Raises `RunDirInUse` when another command holds the run directory, `Preempted` after
    saving on SIGTERM/SIGUSR1, `NonFiniteStop` on a non-finite step under
    `checkpoint.nan_policy`, `SaveFailed` on a failed save under `checkpoint.on_save_error`.
    """
    logs.ensure_configured()
    check_device_count(cfg.mesh, jax.device_count())
    is_primary = jax.process_index() == 0
    trackers.check_trackers(cfg.train.trackers, is_primary)  # before the run dir is touched
    host_batches = host_batch_iterator(cfg)  # corpus errors surface before any compile
    validation = Validation(cfg) if cfg.train.eval_every else None
    run_dir = Path(run_dir or cfg.train.run_dir)
    with run_lock.hold(run_dir, "train"):  # before anything is written there
        return _train(cfg, run_dir, host_batches, validation)


def _train(cfg: Config, run_dir: Path, host_batches: pipeline.BatchIterator,
           validation: Validation | None) -> list[dict]:
    is_primary = jax.process_index() == 0
    if is_primary:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    mesh = distributed.job_mesh(cfg.mesh)  # expert rows pinned to nodes, across processes
    trainer = build_trainer(cfg, mesh)
    events = EventLog(run_dir, is_primary)
    ckpt = checkpoint.Checkpointer(cfg, run_dir, trainer)
    saves = SaveGuard(ckpt, cfg.checkpoint, events)
    restored = ckpt.restore_latest(events)
    state = restored.state if restored else init_state(trainer, cfg.train.seed)
    start_step = restored.step if restored else 0
    if restored and restored.data_state is not None:
        host_batches.set_state(restored.data_state)
    step_fn = jit_train_step(trainer)
    guard = NonFiniteGuard(cfg.checkpoint)
    profiler = Profiler(cfg, run_dir)
    logged = []
    progress, log_line = run_log.progress(cfg.train.steps, start_step)
    try:
        with MetricsLog(run_dir, start_step, is_primary, to_dict(cfg),
                        cfg.train.trackers) as metrics_log, \
                jax.set_mesh(mesh), StopRequests() as stop:
            batches = device_batches(trainer, host_batches)
            for step in range(start_step, cfg.train.steps):
                host_batch, batch = next(batches)
                # Taken right after the batch is drawn: the position a resume starts from.
                data_state = host_batches.get_state()
                done = step + 1
                profiler.before(done)
                start = time.perf_counter()
                state, metrics = step_fn(state, batch)
                metrics = jax.device_get(metrics)  # waits for the step: honest step time
                step_time = time.perf_counter() - start
                profiler.after(done)
                if step == start_step:
                    memory = memory_report(state)
                    events("memory", run_log.memory_line(done, memory), step=done, **memory)
                if step % cfg.train.log_every == 0 or done == cfg.train.steps:
                    logged.append(_record(cfg, done, metrics, step_time, host_batch,
                                          compiled=step == start_step,
                                          stats=host_batches.stats))
                    metrics_log(logged[-1])
                    log_line(logged[-1])
                progress(step, metrics)
                guard.check(done, metrics, events)  # raises NonFiniteStop: nothing saved
                if validation and done % cfg.train.eval_every == 0:
                    record = validation.evaluate(trainer, state, done)
                    metrics_log(record)
                    log.info(f"step {done} val_loss {record['val_loss']:.4f} perplexity "
                             f"{record['val_perplexity']:.2f} ({record['val_tokens']:,} tokens)")
                stopping = stop.agreed()  # same answer on every process, after the same step
                saves.check()  # the last save's outcome, once it is known (raises SaveFailed)
                if stopping or ckpt.due(done):
                    reason = ("preempted" if stopping else
                              "final" if done == cfg.train.steps else "periodic")
                    saves.check(wait=True)  # one save at a time: the one before must be done
                    ckpt.save(done, state, data_state, reason=reason)
                    events("checkpoint_saving", step=done, reason=reason)
                if stopping:
                    saves.check(wait=True, ending=True)  # exit for requeue only once saved
                    events("preempted", step=done, signal=stop.signal_name)
                    raise Preempted(done, stop.signal_name)
        saves.check(wait=True, ending=True)  # the final save is the run's result
    finally:
        profiler.close()
        # On the way out for another reason (an error, NonFiniteStop): the last save is
        # still waited for and reported, and that reason is the one raised.
        saves.check(wait=True, ending=True, raise_error=False)
        ckpt.close()
    progress(None, None)
    return logged


def _record(cfg: Config, step: int, metrics: dict, step_time: float, host_batch,
            compiled: bool, stats: pipeline.BatchStats) -> dict:
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


class NonFiniteStop(Exception):
    """The run stopped on a non-finite step; the last good checkpoint is untouched."""


class NonFiniteGuard:
    """Applies `checkpoint.nan_policy` to the `finite` flag of each step's metrics.

    The step itself already left the state unchanged (train.revert_if_nonfinite); this decides
    whether to go on. Every process sees the same (global) loss, so all decide alike.
    """

    def __init__(self, cfg: CheckpointConfig):
        self.cfg = cfg
        self.consecutive = 0

    def check(self, step: int, metrics: dict, events: "EventLog") -> None:
        if bool(metrics["finite"]):
            self.consecutive = 0
            return
        self.consecutive += 1
        stop = self.cfg.nan_policy == "stop" or self.consecutive > self.cfg.max_consecutive_skips
        events("nonfinite", step=step, loss=float(metrics["loss"]),
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


class Profiler:
    """A jax.profiler trace of steps [a, b] (train.profile_steps) into <run_dir>/profile.

    TensorBoard's profile plugin, XProf and Perfetto read it; each process that traces
    writes its own subdirectory, so two processes on one host do not collide.
    """

    def __init__(self, cfg: Config, run_dir: Path):
        steps = cfg.train.profile_steps
        traced = jax.process_index() == 0 or cfg.train.profile_all_processes
        self.first, self.last = steps if steps and traced else (0, -1)
        self.dir = run_dir / "profile" / f"process-{jax.process_index()}"
        self.active = False

    def before(self, step: int) -> None:
        if step == self.first:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir))
            self.active = True
            log.info(f"profiling steps {self.first}-{self.last} into {self.dir}")

    def after(self, step: int) -> None:
        if self.active and step == self.last:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            log.info(f"profile written to {self.dir}")


def memory_report(state) -> dict:
    """Device memory in use and at peak (where the backend reports it) and the train
    state's bytes per device by memory kind, to hold a run against `europa-jax plan`."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    in_use = [s.get("bytes_in_use") for s in stats]
    peak = [s.get("peak_bytes_in_use") for s in stats]
    kinds: dict[str, int] = {}
    for part in offload.state_bytes(state).values():
        for kind, n in part.items():
            kinds[kind] = kinds.get(kind, 0) + n
    return {"state_bytes_per_device": kinds,
            "device_bytes_in_use_max": max(in_use) if None not in in_use else None,
            "device_peak_bytes_max": max(peak) if None not in peak else None,
            "device_bytes_limit": stats[0].get("bytes_limit")}
