"""How a training run ends, as the process's exit code: the contract with launch scripts
(exit_codes.py). Every ordinary ending is one line on stderr (`europa-jax: …`); the
summary of a finished run is one JSON line on stdout."""

from __future__ import annotations

import json
import logging
import sys
from typing import Callable

from europa_jax.config import ConfigError
from europa_jax.data.corpus import DataError
from europa_jax.job import exit_codes, preemption

log = logging.getLogger(__name__)


def stoppable(work: Callable[[], int], run_dir: str | None = None) -> int:
    """`work()`'s exit code, with stop requests honoured from now on: one that comes
    before the first step ends it in one line (`stopped_line`), exit 75 (130 for Ctrl-C).
    The CLI enters this before jax starts; within it (train_to_exit_code) it only learns
    the run directory."""
    stops = preemption.current()
    if stops is not None:
        stops.run_dir = stops.run_dir or run_dir
        return work()
    with preemption.StopsFromTheStart(stopped_line) as stops:
        stops.run_dir = run_dir
        try:
            return work()
        except preemption.StopBeforeFirstStep as e:
            return stops.say(e.signal_name)


def run_dir_known(run_dir: str) -> None:
    """The run directory a stop before the first step speaks of (the CLI, once the config
    is read)."""
    stops = preemption.current()
    if stops is not None:
        stops.run_dir = str(run_dir)


def stopped_line(signal_name: str, phase: str, run_dir: str | None) -> str:
    """What a stop before the first step left: nothing new, and the checkpoint on disk."""
    steps = committed(run_dir)
    what = ("interrupted (Ctrl-C)" if signal_name == "SIGINT"
            else f"stop requested ({signal_name})")
    when = {"startup": "while starting", "compile": "during the compile",
            "restore": "while restoring a checkpoint" if steps
            else "while initializing the parameters"}.get(phase)
    if run_dir is None:  # the config not read yet
        kept, then = "nothing written", "the same command goes on"
    elif steps:
        kept = f"the checkpoint of step {steps[-1]} is kept"
        then = "the same command resumes from it"
    else:
        kept, then = "no checkpoint yet", "the same command starts the run"
    requeue = "" if signal_name == "SIGINT" else "exiting for requeue; "
    return (f"{what} {when + ', ' if when else ''}before the first step: nothing new to save "
            f"({kept}); {requeue}{then}")


def committed(run_dir: str | None) -> list[int]:
    """The run directory's committed checkpoint steps, oldest first ([] without one)."""
    if run_dir is None:
        return []
    from europa_jax.store.saved_checkpoints import committed_steps

    try:
        return committed_steps(run_dir)
    except (OSError, ValueError):
        return []


def train_to_exit_code(cfg, run_dir: str | None, *, tasks=None, start_over: bool = False,
                       rollback_to: int | None = None) -> int:
    """Train (loop.train) and map the outcome to an `exit_codes` value; stop requests are
    honoured from the start (`stoppable`)."""
    return stoppable(lambda: _train_to_exit_code(cfg, run_dir, tasks=tasks,
                                                 start_over=start_over,
                                                 rollback_to=rollback_to),
                     str(run_dir or cfg.train.run_dir))


def _train_to_exit_code(cfg, run_dir: str | None, *, tasks=None, start_over: bool = False,
                        rollback_to: int | None = None) -> int:
    from europa_jax.job import peer_lost
    from europa_jax.store.saved_checkpoints import CheckpointError
    from europa_jax.store.history import HistoryWouldBeLost
    from europa_jax.run.loop import NonFiniteStop, train
    from europa_jax.job.preemption import Preempted
    from europa_jax.records.run_log import RunLogFailed
    from europa_jax.store.save_outcome import SaveFailed
    from europa_jax.run.spikes import SpikeStop

    try:
        records = train(cfg, run_dir, tasks=tasks, start_over=start_over,
                        rollback_to=rollback_to)
    except (SaveFailed, RunLogFailed) as e:  # a full disk, not the user's input: the last
        # good checkpoint is kept
        error(e)
        return exit_codes.CRASH
    except Preempted as e:
        print(f"{preemption.own_line()}europa-jax: {e}", file=sys.stderr)
        return exit_codes.INTERRUPTED if e.interrupted else exit_codes.PREEMPTED
    except KeyboardInterrupt:  # a second Ctrl-C (or one after the loop): a save in flight
        # was waited for on the way out, so the checkpoints on disk are the truth
        print(f"{preemption.own_line()}europa-jax: "
              f"{quit_line(committed(str(run_dir or cfg.train.run_dir)))}", file=sys.stderr)
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


def quit_line(steps: list[int]) -> str:
    """A second Ctrl-C's line: the checkpoint on disk now (a save the first one started
    was waited for on the way out, so it is among `steps` if it was written)."""
    if not steps:
        return ("interrupted (Ctrl-C): quit at once; no checkpoint was saved; the same "
                "command starts the run")
    return (f"interrupted (Ctrl-C): quit at once; the last checkpoint saved is step "
            f"{steps[-1]}; the same command resumes from it")


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
