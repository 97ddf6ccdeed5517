"""`train.eval_tasks`: downstream tasks scored while a run trains.

Made before the run starts (cli.py `run_training`, on every process): the tasks are
found and built, their documents read, and the run's tokenizer resolved, so an unknown
task or a missing file is a one-line error before the run directory is touched. The loop
(run/loop.py) then calls `evaluate` every `train.eval_tasks_every` steps and after the
last step, with the live train state: the forward programs (eval/forward.py) are
compiled at the first evaluation, on the trainer's mesh, and every process takes part.
The record — `{"step", "eval/<task>/<metric>": value, ..., "eval_tasks_time_s"}` — goes
to metrics.jsonl and the trackers like validation's, from process 0.
"""

from __future__ import annotations

import time
from typing import Callable

from europa_jax.config import Config, ConfigError
from europa_jax.eval import harness
from europa_jax.eval.task_files import load_tasks
from europa_jax.interop.hf_tokenizer_files import run_tokenizer


class TaskEvaluation:
    """The loop's periodic downstream evaluation (run/loop.py `PeriodicEvaluation`)."""

    def __init__(self, cfg: Config):
        train = cfg.train
        self.every, self.limit = train.eval_tasks_every, train.eval_tasks_limit
        self.tasks = load_tasks(train.eval_tasks, train.eval_tasks_dir)
        self.tokenizer, why = run_tokenizer(cfg)
        if self.tokenizer is None:
            raise ConfigError(f"train.eval_tasks: the run's tokenizer is unknown ({why})")
        self._lm = None

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    def evaluate(self, trainer, state, step: int,
                 progress: Callable[[], None] = lambda: None) -> dict:
        """The tasks' scores for `state`; `progress` is called after every forward pass
        (the hang watchdog's sign of life)."""
        if self._lm is None:
            from europa_jax.eval.forward import EvalForward
            from europa_jax.eval.lm import EuropaLM

            self._lm = EuropaLM(EvalForward(trainer, self.tokenizer.vocab_size),
                                self.tokenizer)
        self._lm.on_forward = progress
        self._lm.forward.use(state.params, state.router_bias_LE)
        start = time.perf_counter()
        scores, _ = harness.evaluate_tasks(self._lm, self.tasks, self.limit)
        return {"step": step, **scores, "eval_tasks_time_s": time.perf_counter() - start}

    @staticmethod
    def line(record: dict) -> str:
        scores = {k: v for k, v in record.items() if k.startswith(harness.PREFIX)}
        return (f"step {record['step']} eval tasks ({record['eval_tasks_time_s']:.1f} s): "
                f"{harness.scores_line(scores)}")
