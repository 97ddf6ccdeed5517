"""Downstream evaluation: lm-eval-harness tasks scored with the run's own model and mesh.

The wing above interop (it needs the run's tokenizer and checkpoints) and below the CLI.
The training loop (run/) sits below it, so `europa-jax train` hands the loop a
`during_training.TaskEvaluation` for `train.eval_tasks`; `europa-jax eval` is
command.py. lm_eval (the `eval` extra) is imported only by the modules that need it,
and they only when an evaluation is asked for.
"""
