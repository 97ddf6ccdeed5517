"""Where logged scalars go besides metrics.jsonl: TensorBoard and Weights & Biases.

`train.trackers` names them; MetricsLog (run_log.py) hands every record to each, on process
0 only (the other processes never import tensorboardX or wandb). Both see the same scalars:
every finite number of a record, a per-layer list as `name/layer_i`, at the record's step.

- TensorBoard: event files in the run directory (tensorboardX), the config as text. After a
  resume the writer purges what an earlier try logged past the checkpoint.
- W&B: a run in `<run_dir>/wandb/`, offline unless WANDB_MODE says otherwise (compute nodes
  have no internet: `wandb sync <run_dir>/wandb/offline-run-*` from a login node uploads
  it). Its id is kept in `<run_dir>/wandb_run_id`, so every try of the run directory (a
  resume, a Slurm requeue) continues the same W&B run; the config is the run's config.

A tracker failing (say wandb's service process killed by the scheduler) logs one warning
and stops tracking: metrics.jsonl stays the run's record, and the step never waits on it.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import secrets
import string
from pathlib import Path
from typing import Iterator

from europa_jax.config import ConfigError
from europa_jax.job.preemption import Preempted, StopBeforeFirstStep

log = logging.getLogger(__name__)

WANDB_MISSING = ("train.trackers: wandb needs the wandb package: "
                 "pip install -e '.[wandb]'")
RUN_ID_FILE = "wandb_run_id"
# wandb.Settings.mode's values ("dryrun" and "run" are its old names for offline/online).
WANDB_MODES = ("offline", "online", "shared", "disabled", "dryrun", "run")


def check_trackers(names: tuple[str, ...], primary: bool) -> None:
    """Refuse, before the run directory is touched, a tracker this process cannot start.

    Process 0 imports wandb (a broken install fails here, not after the first step); the
    others only look for it, so that every process of the job stops alike.
    """
    if "wandb" not in names:
        return
    mode = os.environ.get("WANDB_MODE")
    if mode and mode not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE: {mode!r} is not one of: {', '.join(WANDB_MODES)}")
    try:
        if primary:
            import wandb  # noqa: F401
        elif importlib.util.find_spec("wandb") is None:
            raise ImportError("wandb")
    except ImportError:
        raise ConfigError(WANDB_MISSING) from None


def scalars(record: dict) -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number of `record`; a list is one value per layer.

    `step` is where they go, not a value; `compiled` is a flag. A NaN/Inf step is kept in
    metrics.jsonl (with `finite` 0) but would break a tracker's plot scale.
    """
    for key, value in record.items():
        if key in ("step", "compiled"):
            continue
        items = ([(f"{key}/layer_{i}", v) for i, v in enumerate(value)]
                 if isinstance(value, list) else [(key, value)])
        for tag, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                yield tag, v


class TensorBoard:
    """tensorboardX event files in the run directory."""

    def __init__(self, run_dir: Path, start_step: int, config: dict):
        import json

        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard drops what an earlier invocation logged past the resume
        self._writer = SummaryWriter(str(run_dir),
                                     purge_step=start_step + 1 if start_step else None)
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```",
                              global_step=start_step)

    def log(self, record: dict) -> None:
        step = int(record["step"])
        for tag, value in scalars(record):
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self, exc: BaseException | None = None) -> None:
        self._writer.close()


class WandB:
    """A Weights & Biases run, offline by default, one per run directory across resumes."""

    def __init__(self, run_dir: Path, start_step: int, config: dict):
        import wandb

        env = os.environ
        mode = env.get("WANDB_MODE") or "offline"
        # Steps a resumed try does not log: those up to its checkpoint are in the W&B run
        # already, and W&B drops a step lower than the last (with a warning per record).
        self._resumed_from, self._last_step = start_step, 0
        self._wandb, self._run = wandb, None
        wandb_dir = Path(env.get("WANDB_DIR") or run_dir)
        try:
            wandb_dir.mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(
                mode=mode, dir=str(wandb_dir),
                project=env.get("WANDB_PROJECT") or "europa-jax",
                name=env.get("WANDB_NAME") or Path(run_dir).resolve().name,
                id=None if mode == "disabled" else run_id(run_dir),
                resume="allow", config=config)
        except Exception as e:  # e.g. online without a key: the run goes on without W&B
            self._failed("wandb.init", e)

    def log(self, record: dict) -> None:
        step = int(record["step"])
        # The same step again is fine (a validation record joins its step's row).
        if self._run is None or step <= self._resumed_from or step < self._last_step:
            return
        try:
            self._run.log(dict(scalars(record)), step=step)
        except Exception as e:
            self._failed("wandb log", e)
            return
        self._last_step = step

    def close(self, exc: BaseException | None = None) -> None:
        if self._run is None:
            return
        try:
            # W&B shows "preempted", not "failed" (also when stopped during the compile)
            if isinstance(exc, (Preempted, StopBeforeFirstStep)):
                self._run.mark_preempting()
            self._run.finish(exit_code=0 if exc is None else 1)
            # finish can return before wandb's service process has written the run's
            # records (wandb 0.31 offline: 1 of 6 runs in a row left only the file's header,
            # and the in-process tests failed 3 times in 4); teardown waits for it, so the
            # files are whole before the process goes on (a later run starts a new service).
            self._wandb.teardown()
        except Exception as e:
            self._failed("wandb finish", e)

    def _failed(self, what: str, e: Exception) -> None:
        first = (str(e).strip().splitlines() or [""])[0]
        log.warning(f"{what} failed ({type(e).__name__}: {first}); W&B tracking stops here, "
                    "metrics.jsonl goes on")
        self._run = None


def run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory: read from `wandb_run_id`, else made once.

    WANDB_RUN_ID names it the first time; otherwise 8 base-36 characters, as wandb makes
    them. Written to a temporary file and renamed, so a kill mid-write leaves no empty id.
    """
    path = Path(run_dir) / RUN_ID_FILE
    if path.exists():
        return path.read_text().strip()
    alphabet = string.ascii_lowercase + string.digits
    new = os.environ.get("WANDB_RUN_ID") or "".join(secrets.choice(alphabet) for _ in range(8))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new + "\n")
    tmp.replace(path)
    return new


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB}
