"""The training loop: data → sharded batches → `train_step`, metrics.jsonl, progress.

Around the step: resume from the run directory's checkpoints, periodic/final/preemption
saves (checkpoint.py), agreed stop requests (preemption.py), the non-finite policy.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import jax
import numpy as np

from europa_jax import checkpoint, data, distributed, flops
from europa_jax.config import CheckpointConfig, Config, check_device_count
from europa_jax.config_loader import to_dict
from europa_jax.preemption import Preempted, StopRequests
from europa_jax.train import Trainer, build_trainer, init_state, jit_train_step


def device_batches(trainer: Trainer, host_batches: Iterator[dict[str, np.ndarray]]):
    """Each process's rows → one global array sharded over the mesh (no host gathers).

    Pulls exactly one host batch per yield (the host iterator prefetches in its own
    thread), so `host_batches.get_state()` always names the batch after the last yielded.
    """
    for host_batch in host_batches:
        yield host_batch, {k: jax.make_array_from_process_local_data(trainer.batch_sharding, v)
                           for k, v in host_batch.items()}


def host_batch_iterator(cfg: Config) -> data.BatchIterator:
    """This process's rows of each balanced global batch; checkpoint it with get/set_state."""
    return data.batch_iterator_for(cfg, process_index=jax.process_index(),
                                   process_count=jax.process_count())


def train(cfg: Config, run_dir: str | Path | None = None) -> list[dict]:
    """Run to `cfg.train.steps`, resuming from the run directory's latest valid checkpoint.

    Returns the metrics logged by this invocation (metrics.jsonl holds the whole run).
    Raises `Preempted` after saving on SIGTERM/SIGUSR1, `NonFiniteStop` on a non-finite
    step under `checkpoint.nan_policy`.
    """
    check_device_count(cfg.mesh, jax.device_count())
    host_batches = host_batch_iterator(cfg)  # corpus errors surface before any compile
    run_dir = Path(run_dir or cfg.train.run_dir)
    is_primary = jax.process_index() == 0
    if is_primary:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    mesh = distributed.job_mesh(cfg.mesh)  # expert rows pinned to nodes, across processes
    trainer = build_trainer(cfg, mesh)
    events = EventLog(run_dir, is_primary)
    ckpt = checkpoint.Checkpointer(cfg, run_dir, trainer)
    restored = ckpt.restore_latest(events)
    state = restored.state if restored else init_state(trainer, cfg.train.seed)
    start_step = restored.step if restored else 0
    if restored and restored.data_state is not None:
        host_batches.set_state(restored.data_state)
    step_fn = jit_train_step(trainer)
    guard = NonFiniteGuard(cfg.checkpoint)
    logged = []
    progress = _progress(cfg.train.steps, start_step)
    try:
        with _metrics_file(run_dir, start_step, is_primary) as log, jax.set_mesh(mesh), \
                StopRequests() as stop:
            batches = device_batches(trainer, host_batches)
            for step in range(start_step, cfg.train.steps):
                host_batch, batch = next(batches)
                # Taken right after the batch is drawn: the position a resume starts from.
                data_state = host_batches.get_state()
                start = time.perf_counter()
                state, metrics = step_fn(state, batch)
                metrics = jax.device_get(metrics)  # waits for the step: honest step time
                done = step + 1
                if step % cfg.train.log_every == 0 or done == cfg.train.steps:
                    logged.append(_record(
                        cfg, done, metrics, time.perf_counter() - start, host_batch,
                        compiled=step == start_step,
                        attention_cost_max_over_mean=host_batches.stats.attention_cost_max_over_mean))
                    log(logged[-1])
                progress(step, metrics)
                guard.check(done, metrics, events)  # raises NonFiniteStop: nothing saved
                stopping = stop.agreed()  # same answer on every process, after the same step
                if stopping or ckpt.due(done):
                    reason = ("preempted" if stopping else
                              "final" if done == cfg.train.steps else "periodic")
                    ckpt.save(done, state, data_state, reason=reason)
                    events("checkpoint_saving", step=done, reason=reason)
                if stopping:
                    events("preempted", step=done, signal=stop.signal_name)
                    raise Preempted(done, stop.signal_name)
    finally:
        ckpt.close()  # waits for the last async write, also when stopping
    progress(None, None)
    return logged


def _record(cfg: Config, step: int, metrics: dict, step_time: float, host_batch,
            compiled: bool, attention_cost_max_over_mean: float) -> dict:
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    peak = cfg.train.peak_flops_per_device.get(jax.devices()[0].platform, float("nan"))
    pairs = flops.causal_pairs(host_batch["segment_ids"]) * jax.process_count()
    step_flops = flops.train_flops(cfg.model, tokens_per_step, pairs)
    return {"step": step, **{k: float(v) for k, v in metrics.items()}, "step_time_s": step_time,
            "tokens_per_s_per_device": tokens_per_step / step_time / jax.device_count(),
            "mfu": step_flops / step_time / jax.device_count() / peak,
            "attention_cost_max_over_mean": attention_cost_max_over_mean, "compiled": compiled}


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


class EventLog:
    """Checkpoint, resume, preemption and non-finite events: stderr and events.jsonl."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path, self.enabled = run_dir / "events.jsonl", enabled

    def __call__(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        record = {"event": event, **fields, "time": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"europa-jax: {event} {details}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _metrics_file(run_dir: Path, start_step: int, enabled: bool):
    """metrics.jsonl keeps the records up to the resumed step, so it reads as one run."""
    if not enabled:
        yield lambda record: None
        return
    path = run_dir / "metrics.jsonl"
    kept = []
    if start_step and path.exists():
        kept = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= start_step]
    with path.open("w") as f:
        f.writelines(line + "\n" for line in kept)
        f.flush()

        def write(record):
            f.write(json.dumps(record) + "\n")
            f.flush()

        yield write


def _progress(total: int, initial: int = 0):
    """A tqdm bar on a terminal; plain lines (for Slurm logs) otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=initial, unit="step")

        def update(step, metrics):
            if step is None:
                return bar.close()
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", refresh=False)
            bar.update(1)

        return update

    def line(step, metrics):
        if step is not None and (step % 10 == 0 or step == total - 1):
            print(f"step {step + 1}/{total} loss {float(metrics['loss']):.4f} "
                  f"grad_norm {float(metrics['grad_norm']):.3f}", flush=True)

    return line
