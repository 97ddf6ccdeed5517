"""The training loop: data → sharded batches → `train_step`, metrics.jsonl, progress."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Iterator

import jax
import numpy as np

from europa_jax import data, distributed, flops
from europa_jax.config import Config, check_device_count, to_dict
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
    """Run `cfg.train.steps` steps; returns the logged metrics (also in metrics.jsonl)."""
    check_device_count(cfg, jax.device_count())
    host_batches = host_batch_iterator(cfg)  # corpus errors surface before any compile
    run_dir = Path(run_dir or cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    mesh = distributed.job_mesh(cfg.mesh)  # expert rows pinned to nodes, across processes
    trainer = build_trainer(cfg, mesh)
    state = init_state(trainer, cfg.train.seed)
    step_fn = jit_train_step(trainer)
    peak = cfg.train.peak_flops_per_device.get(jax.devices()[0].platform, float("nan"))
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    logged = []
    progress = _progress(cfg.train.steps)
    with (run_dir / "metrics.jsonl").open("w") as log, jax.set_mesh(mesh):
        batches = device_batches(trainer, host_batches)
        for step in range(cfg.train.steps):
            host_batch, batch = next(batches)
            start = time.perf_counter()
            state, metrics = step_fn(state, batch)
            metrics = jax.device_get(metrics)  # waits for the step: honest step time
            step_time = time.perf_counter() - start
            if step % cfg.train.log_every and step != cfg.train.steps - 1:
                progress(step, metrics)
                continue
            pairs = flops.causal_pairs(host_batch["segment_ids"]) * jax.process_count()
            step_flops = flops.train_flops(cfg.model, tokens_per_step, pairs)
            record = {"step": step + 1, **{k: float(v) for k, v in metrics.items()},
                      "step_time_s": step_time,
                      "tokens_per_s_per_device": tokens_per_step / step_time / jax.device_count(),
                      "mfu": step_flops / step_time / jax.device_count() / peak,
                      "attention_cost_max_over_mean":
                          host_batches.stats.attention_cost_max_over_mean,
                      "compiled": step == 0}
            log.write(json.dumps(record) + "\n")
            log.flush()
            logged.append(record)
            progress(step, metrics)
    progress(None, None)
    return logged


def _progress(total: int):
    """A tqdm bar on a terminal; plain lines (for Slurm logs) otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="step")

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
