"""`europa-jax eval RUN_DIR --tasks a,b`: lm-eval tasks scored on a run's checkpoint.

The same evaluation as `train.eval_tasks` during training (eval/forward.py, lm.py,
harness.py), on a checkpoint: its config (with `--set` for the layout only: `mesh.*`,
`train.eval_tasks_seq_len`) gives the mesh, which the job's devices must fill as for
`train` (on a CPU host, `distributed.start` makes that many CPU devices; several
processes under Slurm or launch/local.sh work alike); the parameters and router bias are
read straight into their shards (eval/weights.py), the optimizer state never. The
tasks are found and loaded and the tokenizer resolved before any device is touched, so
bad input is one line and exit code 2 within seconds.

Prints (process 0) and, with `--output`, writes one JSON object: the run, step, tasks,
limit, `scores` `{"eval/<task>/<metric>": value}`, `documents` per task, forward passes
and seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from europa_jax.config import Config, ConfigError
from europa_jax.config_loader import apply_overrides, from_dict
from europa_jax.data.corpus import DataError
from europa_jax.job import exit_codes
from europa_jax.store import saved_checkpoints

# what --set may change: where and how wide the forward runs, never the model
LAYOUT_KEYS = ("mesh.", "train.eval_tasks_seq_len")


def task_names(spec: str) -> list[str]:
    """`--tasks a,b` → ["a", "b"]."""
    names = [n.strip() for n in (spec or "").split(",")]
    if not names or not all(names) or len(set(names)) != len(names):
        raise ConfigError(f"--tasks {spec!r}: expected distinct comma-separated task names, "
                          "e.g. europa_tiny_choice,europa_tiny_gen")
    return names


def checkpoint_config(run_dir: str | Path, step: int | None, overrides: list[str]
                      ) -> tuple[Path, dict, Config]:
    """(the step's directory, its metadata, the run's config with `overrides`)."""
    step_dir = saved_checkpoints.step_dir_of(run_dir, step, "evaluate")
    meta = saved_checkpoints.read_meta(step_dir)
    for item in overrides:
        if not item.split("=", 1)[0].strip().startswith(LAYOUT_KEYS):
            raise ConfigError(f"--set {item}: only the layout may change for an evaluation "
                              "(mesh.*, train.eval_tasks_seq_len)")
    raw = apply_overrides(json.loads(json.dumps(meta["config"])), overrides)
    try:
        return step_dir, meta, from_dict(Config, raw)
    except ConfigError as e:
        raise ConfigError(f"{step_dir}: {e}") from None


def evaluate_checkpoint(run_dir: str | Path, tasks: list[str], *, step: int | None = None,
                        tasks_dir: str | Path | None = None, limit: int | None = None,
                        tokenizer: str | Path | None = None,
                        overrides: list[str] = ()) -> dict:
    """Score `tasks` on the checkpoint of `run_dir` (the latest, or `step`)."""
    from europa_jax.eval.task_files import load_tasks
    from europa_jax.interop.hf_tokenizer_files import run_tokenizer

    if limit is not None and limit < 1:
        raise ConfigError(f"--limit {limit}: must be >= 1 (documents per task)")
    step_dir, meta, cfg = checkpoint_config(run_dir, step, list(overrides))
    loaded = load_tasks(tasks, tasks_dir, key="--tasks", dir_key="--tasks-dir")
    run_tok, why = run_tokenizer(cfg, tokenizer)
    if run_tok is None:
        raise ConfigError(f"{run_dir}: the run's tokenizer is unknown ({why})")

    from europa_jax.eval import harness
    from europa_jax.eval.forward import EvalForward
    from europa_jax.eval.lm import EuropaLM
    from europa_jax.eval.weights import read_weights
    from europa_jax.job import distributed
    from europa_jax.train.train import build_trainer

    start = time.perf_counter()
    distributed.start(cfg.mesh)  # the run's mesh over this job's devices
    trainer = build_trainer(cfg, distributed.job_mesh(cfg.mesh))
    params, router_bias_LE = read_weights(step_dir, trainer, meta)
    lm = EuropaLM(EvalForward(trainer, run_tok.vocab_size).use(params, router_bias_LE), run_tok)
    scores, documents = harness.evaluate_tasks(lm, loaded, limit)
    return {"run_dir": str(run_dir), "step": int(meta["step"]), "tasks": list(tasks),
            "limit": limit, "scores": scores, "documents": documents,
            "forwards": lm.forwards, "seconds": round(time.perf_counter() - start, 2)}


def run(args) -> int:
    """The `eval` command (args: run_dir, tasks, step, tasks_dir, limit, output, tokenizer,
    set): the JSON on stdout; bad input is one line on stderr and exit code 2."""
    try:
        result = evaluate_checkpoint(
            args.run_dir, task_names(args.tasks), step=args.step, tasks_dir=args.tasks_dir,
            limit=args.limit, tokenizer=args.tokenizer, overrides=args.set)
    except (ConfigError, DataError, saved_checkpoints.CheckpointError) as e:
        print(f"europa-jax: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return exit_codes.BAD_INPUT
    import jax

    if jax.process_index() == 0:
        text = json.dumps(result, indent=2)
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(text + "\n")
        print(text)
    return exit_codes.OK
