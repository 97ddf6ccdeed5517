"""Run loaded tasks through lm-eval with our model and flatten its results into scores.

`lm_eval.evaluator.evaluate` does the work: it builds each task's requests, hands all
requests of one kind (from every task together) to the model in one call — so the
packed forwards fill up across tasks — then applies the tasks' filters and metrics.
`simple_evaluate` is not used: besides what task_files.py already does (few-shot
defaults), it reseeds Python's, NumPy's and torch's global generators and records git
and environment facts, which has no place inside a training run.

Scores are flat `{"eval/<task>/<metric>": value}`: a metric under a filter other than
lm-eval's default `none` is `<metric>/<filter>`; standard errors are left out
(`bootstrap_iters=0`: they cost more than the tiny forward, and a run's curve over steps
says more).
"""

from __future__ import annotations

import functools
from unittest import mock

from tqdm import tqdm

from europa_jax.eval.task_files import TaskSet

PREFIX = "eval/"


def evaluate_tasks(lm, tasks: TaskSet, limit: int | None = None
                   ) -> tuple[dict[str, float], dict[str, int]]:
    """(`{"eval/<task>/<metric>": value}` of every task and group in `tasks`, the number
    of documents each task scored)."""
    from lm_eval.api import task as lm_eval_task
    from lm_eval.evaluator import evaluate

    # lm-eval draws a progress bar over each task's documents with no switch to turn it
    # off; on every process of a job, at every evaluation, it is only noise in the logs.
    with mock.patch.object(lm_eval_task, "tqdm", functools.partial(tqdm, disable=True)):
        results = evaluate(lm=lm, task_dict=tasks.task_dict, limit=limit, bootstrap_iters=0,
                           log_samples=False)
    documents = {task: int(n["effective"]) for task, n in results.get("n-samples", {}).items()}
    return flat_scores(results), documents


def flat_scores(results: dict) -> dict[str, float]:
    """lm-eval's results (`{"results": {task: {"acc,none": 0.5, ...}}}`) as flat scores."""
    scores = {}
    for task, metrics in sorted(results["results"].items()):
        for key, value in metrics.items():
            metric, _, filtered = key.partition(",")
            if (key in ("alias", "sample_len") or metric.endswith("_stderr")
                    or isinstance(value, bool) or not isinstance(value, (int, float))):
                continue
            name = metric if filtered in ("", "none") else f"{metric}/{filtered}"
            scores[f"{PREFIX}{task}/{name}"] = float(value)
    return scores


def scores_line(scores: dict[str, float]) -> str:
    """`task/metric value` pairs for a log line."""
    return ", ".join(f"{key[len(PREFIX):]} {value:.4g}" for key, value in scores.items())

