"""How a training run ends, as the process's exit code: the contract with launch scripts
(exit_codes.py). Every ordinary ending is one line on stderr (`europa-jax: …`); the
summary of a finished run is one JSON line on stdout."""

from __future__ import annotations

import json
import logging
import sys

from europa_jax.config import ConfigError
from europa_jax.data.corpus import DataError
from europa_jax.job import exit_codes

log = logging.getLogger(__name__)


def train_to_exit_code(cfg, run_dir: str | None, *, tasks=None, start_over: bool = False
                       ) -> int:
    """Train (loop.train) and map the outcome to an `exit_codes` value."""
    from europa_jax.job import peer_lost
    from europa_jax.store.saved_checkpoints import CheckpointError
    from europa_jax.store.history import HistoryWouldBeLost
    from europa_jax.run.loop import NonFiniteStop, train
    from europa_jax.job.preemption import Preempted
    from europa_jax.records.run_log import RunLogFailed
    from europa_jax.store.save_outcome import SaveFailed
    from europa_jax.run.spikes import SpikeStop

    try:
        records = train(cfg, run_dir, tasks=tasks, start_over=start_over)
    except (SaveFailed, RunLogFailed) as e:  # a full disk, not the user's input: the last
        # good checkpoint is kept
        error(e)
        return exit_codes.CRASH
    except Preempted as e:
        print(f"europa-jax: {e}", file=sys.stderr)
        return exit_codes.INTERRUPTED if e.interrupted else exit_codes.PREEMPTED
    except KeyboardInterrupt:  # before the loop took Ctrl-C over, or a second Ctrl-C
        print("europa-jax: interrupted (Ctrl-C): nothing saved since the last checkpoint; "
              "the same command resumes from it", file=sys.stderr)
        return exit_codes.INTERRUPTED
    except (NonFiniteStop, SpikeStop) as e:
        print(f"europa-jax: stopped: {e}", file=sys.stderr)
        return exit_codes.NONFINITE
    except (CheckpointError, ConfigError, DataError, HistoryWouldBeLost) as e:  # e.g. the
        # run directory in use, or one whose checkpoints are gone
        error(e)
        return exit_codes.BAD_INPUT
    except Exception as e:
        import jax

        if jax.process_count() > 1 and peer_lost.is_peer_loss(e):  # a collective with the dead
            peer_lost.exit_requeue(str(e))
        raise
    where = str(run_dir or cfg.train.run_dir)
    summary = {"steps": cfg.train.steps, "run_dir": where}
    if records:
        summary.update(first_loss=records[0]["loss"], final_loss=records[-1]["loss"])
        summary.update(last_validation(where))
        import jax

        if jax.process_count() == 1:  # the newcomer's terminal: the line before the JSON
            print(f"europa-jax: {finished_line(summary)}", file=sys.stderr)
        elif jax.process_index() == 0:  # a job's rank logs: stamped like their other lines
            log.info(finished_line(summary))
    else:  # the run directory already held the final step
        print(f"europa-jax: {where} already holds step {cfg.train.steps}, the last: nothing "
              "to train (raise train.steps to go on; `europa-jax report` shows the run)",
              file=sys.stderr)
    print(json.dumps(summary))
    return exit_codes.OK


def last_validation(run_dir: str) -> dict:
    """{"val_loss", "val_step"} of the run's last held-out loss in metrics.jsonl (this try's
    or an earlier one's), or {} when it logged none."""
    from europa_jax.records import report

    try:
        validation = report.load_run(run_dir).validation
    except report.ReportError:  # another process's run directory, or none written here
        return {}
    return ({"val_loss": validation[-1]["val_loss"], "val_step": validation[-1]["step"]}
            if validation else {})


def finished_line(summary: dict) -> str:
    """What the run reached and the commands that read it next."""
    where = summary["run_dir"]
    loss = (f"validation loss {summary['val_loss']:.4g} at step {summary['val_step']}"
            if "val_loss" in summary else f"training loss {summary['final_loss']:.4g}")
    return (f"trained to step {summary['steps']}, {loss}, in {where}; next: "
            f"europa-jax report {where} | europa-jax sample {where} --prompt TEXT | "
            f"europa-jax export {where} --out DIR")


def error(e: Exception) -> None:
    """`europa-jax: error: ...` on stderr, once per line of the message."""
    for line in str(e).splitlines() or [type(e).__name__]:
        print(f"europa-jax: error: {line}", file=sys.stderr)
