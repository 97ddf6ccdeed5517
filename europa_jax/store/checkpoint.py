"""Orbax checkpoints that survive the machine: async sharded saves, keep-K, validated resume.

Layout: `<run_dir>/checkpoints/<step>/` with three Orbax items,
- `state`: the `TrainState` (params, optimizer state, router bias, step), written by every
  process for its own shards (OCDBT/zarr). Scanned `[L, ...]` stacks are stored one layer
  per chunk, so export can read a layer without touching the others.
- `data`: each process's input-iterator state, `process_<i>-of-<n>.json`.
- `meta`: the resolved config, why and when it was saved, and a fingerprint per array.

Atomicity is Orbax's: a step is written into `<step>.orbax-checkpoint-tmp-*` and renamed
when every process has finished, so a save killed midway is never listed (and its temp dir
is removed when the next run opens the directory). What a rename cannot catch — a file
truncated or altered later, by a full disk or a bad node — the fingerprint does: a sum of
every array's bit patterns mod 2^32, exact and independent of sharding (integer addition
is associative), so it is recomputed after restore on any mesh. A checkpoint that fails to
restore or whose fingerprint differs is moved to `<run_dir>/corrupt_checkpoints/` and the
previous one is used.

A save that fails (a full disk: Orbax's background write raises) is not raised where it
happens: `outcome` reports it once every process knows, after removing its temporary
directory, and the loop applies `checkpoint.on_save_error` (loop.SaveGuard).

Restore targets the *current* trainer's shardings, so a run saved on a 2×4 mesh resumes on
4×2 or 1×8 (Orbax reads each device's slice from whatever chunks hold it). Commands that
only read a checkpoint (export, sample, eval) go through `saved_checkpoints.py` instead.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

from europa_jax import param_table
from europa_jax.config import Config
from europa_jax.config_loader import to_dict
from europa_jax.job import distributed
# the run's on-disk checkpoints as this module writes them (its API: `checkpoint.X`)
from europa_jax.store.saved_checkpoints import (CORRUPT_SUBDIR, CheckpointError,
                                              IncompatibleCheckpoint, checkpoint_dir,
                                              committed_steps, in_this_layout, leaf_key,
                                              open_saved_array)
from europa_jax.store.save_outcome import (DONE, FAILED, remove_failed_save, save_error,
                                         SaveFailed, SaveOutcome, WRITING)
from europa_jax.train.train import Trainer, TrainState

Log = Callable[..., None]


# ----------------------------------------------------------------------------- fingerprints


def _bit_sum(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return jnp.sum(x, dtype=jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jnp.sum(jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32), dtype=jnp.uint32)


_bit_sums = jax.jit(lambda tree: jax.tree.map(_bit_sum, tree))


def fingerprint(tree: Any) -> dict[str, int]:
    """Per-leaf sum of bit patterns mod 2^32: equal iff (almost surely) the bits are equal."""
    sums = jax.device_get(_bit_sums(tree))
    return {leaf_key(path): int(value)
            for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]}


# ----------------------------------------------------------------------------- per-process JSON


class ProcessJsonHandler(ocp.CheckpointHandler):
    """One JSON file per process (the input iterator's position is per process)."""

    def save(self, directory, args: "ProcessJsonSave"):
        directory.mkdir(parents=True, exist_ok=True)
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        (directory / name).write_text(json.dumps(args.state))

    def restore(self, directory, args: "ProcessJsonRestore" = None):
        own = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        if own.exists():
            return json.loads(own.read_text())
        # Saved with another process count: usable only if every process was at the same
        # position (true of a pipeline where each process reads the whole global stream).
        states = [json.loads(p.read_text()) for p in sorted(directory.glob("process_*.json"))]
        if states and all(s == states[0] for s in states):
            return states[0]
        raise CheckpointError(f"{directory}: input state saved by {len(states)} processes "
                              f"differs per process and cannot be mapped to "
                              f"{jax.process_count()} processes")

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
    state: Any


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
    pass


# ----------------------------------------------------------------------------- the manager


@dataclasses.dataclass
class Restored:
    step: int
    state: TrainState
    data_state: dict | None
    meta: dict


def unusable(error: Exception, step_dir: Path) -> str:
    """Why a checkpoint did not restore, in a line: the damaged file named (relative to the
    checkpoint) when the error names one — TensorStore's errors quote it deep inside a long
    repr — else the error's first line."""
    text = str(error)
    inside = str(step_dir)
    files = sorted({m.rstrip(".:") for m in re.findall(r"(/[^\s\"',;]+)", text)
                    if m.startswith(inside + "/")}, key=len)
    if files:  # the longest: the file itself rather than a folder above it
        named = Path(files[-1]).relative_to(step_dir.parent)
        return f"{type(error).__name__} reading {named} (damaged or unreadable)"
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


class Checkpointer:
    """Saves and restores one run's checkpoints; every process of the job makes one."""

    def __init__(self, cfg: Config, run_dir: str | Path, trainer: Trainer):
        self.cfg, self.trainer = cfg, trainer
        self.run_dir = Path(run_dir)
        self.directory = checkpoint_dir(run_dir)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=preservation_policy.LatestN(cfg.checkpoint.keep),
            enable_async_checkpointing=cfg.checkpoint.async_save,
            cleanup_tmp_directories=True)  # leftovers of saves killed midway
        self.manager = ocp.CheckpointManager(self.directory.absolute(), options=options)
        # The save being written (async) whose outcome nobody has asked for yet, and its
        # error if `manager.save` itself failed.
        self._pending: int | None = None
        self._error: str | None = None
        self._save_args = jax.tree_util.tree_map_with_path(
            lambda path, _: ocp.SaveArgs(shard_axes=(0,) if _is_stacked(path) else ()),
            trainer.state_shardings)

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every_steps
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def save(self, step: int, state: TrainState, data_state: dict | None, *, reason: str,
             extra: dict | None = None) -> None:
        """Start saving `state` as `step`; returns once the device→host copy is done.

        A write that fails, now or in the background, is reported by `outcome` (and
        `close`), not raised here: the caller decides what a failed save means. One save
        at a time: a previous one nobody asked about is waited for, and raises
        `SaveFailed` if it failed (never silent).
        """
        previous = self.outcome(wait=True)
        if previous is not None and previous.error:
            raise SaveFailed(previous)
        meta = {"step": step, "reason": reason, "config": to_dict(self.cfg),
                "fingerprint": fingerprint(state), "process_count": jax.process_count(),
                # a restore checks the input state is there: without it a resume would
                # silently read the data from another position
                "data_state_saved": data_state is not None,
                "mesh": {"data": self.cfg.mesh.data, "expert": self.cfg.mesh.expert},
                "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "versions": {"jax": jax.__version__, "orbax": ocp.__version__}, **(extra or {})}
        items = {"state": ocp.args.StandardSave(state, save_args=self._save_args),
                 "meta": ocp.args.JsonSave(meta)}
        if data_state is not None:
            items["data"] = ProcessJsonSave(data_state)
        self._pending, self._error = step, None
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - e.g. no room for the temporary directory
            self._error = save_error(e)

    def outcome(self, wait: bool = False) -> SaveOutcome | None:
        """The last save's outcome once every process knows it; None while it is still
        being written (without `wait`), or when there is no save to report.

        Every process says whether its own write is done, failed or still going, and all
        decide from the same list (a collective, so call it on every process at the same
        point), so the whole job learns of a failure after the same step. A failure on any
        process fails the save everywhere; a process whose write still goes on then waits
        for it (Orbax ends it at its barrier timeout). A failed save's temporary directory
        is removed, so what is on disk are committed checkpoints, the newest the last good.
        """
        if self._pending is None:
            return None
        if not wait:
            done = not self.manager.is_saving_in_progress()
            seen = distributed.every_process(FAILED if self._error else DONE if done
                                             else WRITING)
            if WRITING in seen and FAILED not in seen:
                return None
        finished = self._finish()  # also after a failed `manager.save`: what it started
        error = self._error or finished
        seen = distributed.every_process(FAILED if error else DONE)
        step, self._pending, self._error = self._pending, None, None
        if FAILED not in seen:
            return SaveOutcome(step)
        error = error or f"failed on process {seen.index(FAILED)}"
        self._discard(step)
        return SaveOutcome(step, error, self.directory,
                           max(committed_steps(self.run_dir), default=None))

    def _finish(self) -> str | None:
        """Wait for this process's write; its error as one line, None if it is on disk."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - whatever stopped the write
            return save_error(e)
        return None

    def _discard(self, step: int) -> None:
        """Remove a failed save's temporary directory (disk space, and no orphan to wonder
        about) and let the manager list the steps again: its own list dropped the steps
        this save would have deleted, which are still on disk. A step that got committed
        all the same (a write after the rename failed) is set aside: a resume must not
        pick a save that was reported failed."""
        if jax.process_index() == 0:
            remove_failed_save(self.directory, step)
            if (self.directory / str(step)).exists():
                self._move_to_corrupt(step)
        distributed.all_processes(True)  # barrier: nobody lists steps before it is gone
        self.manager.reload()

    def restore_latest(self, log: Log) -> Restored | None:
        """The newest checkpoint that restores and matches its fingerprint; None if none exist.

        Raises CheckpointError when checkpoints exist but none is usable (starting over
        silently would overwrite a run), IncompatibleCheckpoint for a different model.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        failures = []
        for step in steps:
            try:
                restored = self._restore(step)
                error = None
            except IncompatibleCheckpoint:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"
                restored, error = None, unusable(e, self.directory / str(step))
            if distributed.all_processes(error is None):
                log("checkpoint_restored", step=step)
                return restored
            error = error or "failed on another process"
            failures.append(f"step {step}: {error}")
            log("checkpoint_skipped", level=logging.WARNING, step=step, error=error)
            self.set_aside(step)
        if failures:
            raise CheckpointError(
                f"{self.directory}: no usable checkpoint ({'; '.join(failures)}); set aside in "
                f"{self.run_dir / CORRUPT_SUBDIR}: a retry refuses to start over by itself "
                "(`train --start-over` does, keeping the history)")
        return None

    def _restore(self, step: int) -> Restored:
        # a config saved before a key moved reads in this version's layout (resume_changes
        # then sees only what the user changed)
        meta = in_this_layout(self.manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        check_compatible(self.directory / str(step), meta, self.cfg,
                         self.trainer.abstract_state)
        items = {"state": ocp.args.StandardRestore(self.trainer.abstract_state)}
        if (self.directory / str(step) / "data").exists():
            items["data"] = ProcessJsonRestore()
        elif meta.get("data_state_saved"):
            raise CheckpointError("its input state (data/) is missing: resuming from it would "
                                  "read the data from another position")
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        state = restored["state"]
        actual = fingerprint(state)
        bad = [k for k, v in meta["fingerprint"].items() if actual.get(k) != v]
        if bad:
            raise CheckpointError(f"fingerprint mismatch in {len(bad)} arrays, e.g. {bad[0]}")
        return Restored(step, state, restored.get("data"), meta)

    def set_aside(self, step: int) -> None:
        """Keep an unusable checkpoint (damaged, or holding a blow-up: spikes.py) for
        inspection, out of the way of the step re-saved. Collective."""
        if jax.process_index() == 0:
            self._move_to_corrupt(step)
        distributed.all_processes(True)  # barrier: nobody lists steps before the move is done
        self.manager.reload()

    def _move_to_corrupt(self, step: int) -> None:
        target = self.run_dir / CORRUPT_SUBDIR / f"{step}-{datetime.datetime.now():%Y%m%d%H%M%S}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.directory / str(step)), target)

    def close(self) -> None:
        """Wait for the last save; raise `SaveFailed` if it failed and nobody asked."""
        try:
            outcome = self.outcome(wait=True)
        finally:
            self.manager.close()
        if outcome is not None and outcome.error:
            raise SaveFailed(outcome)


def _is_stacked(path) -> bool:
    """A leaf of a scanned layer stack (params or their optimizer state): `[L, ...]`."""
    return bool(set(param_table.key_names(path)) & set(param_table.STACKS))


# The execution settings that shape the stored state: the layers' parameter tree (scanned
# or not) and the stored shapes (storage padding).
STATE_SHAPING_EXECUTION = ("scan_layers", "param_pad_multiple")


def check_compatible(step_dir: Path, meta: dict, cfg: Config, abstract: TrainState) -> None:
    """Refuse a checkpoint of another model: its leaves (from its fingerprint) must be this
    model's train state's, and its parameters and router bias must have their shapes and
    dtypes (the optimizer state follows the parameters). A checkpoint of another model is
    a user error, not corruption to fall back from; the message names the config fields
    that differ (the model's, and the execution settings that shape the state)."""
    ours = {leaf_key(path): leaf for path, leaf in
            jax.tree_util.tree_flatten_with_path(abstract)[0]}
    saved = set(meta["fingerprint"])
    problem = None
    if set(ours) != saved:
        key = sorted(set(ours) ^ saved)[0]
        problem = (f"{key} is in this model but not in the checkpoint" if key in ours else
                   f"{key} is in the checkpoint but not in this model")
    else:
        for key, leaf in ours.items():
            if not key.startswith("params.") and key != param_table.ROUTER_BIAS.key:
                continue
            store = open_saved_array(step_dir, key)
            shape, dtype = tuple(store.shape), np.dtype(store.dtype.numpy_dtype)
            if shape != tuple(leaf.shape) or dtype != np.dtype(leaf.dtype):
                problem = (f"{key} is {dtype.name}{list(shape)} in the checkpoint but "
                           f"{np.dtype(leaf.dtype).name}{list(leaf.shape)} in this model")
                break
    if problem:
        execution = to_dict(cfg.execution)
        ours_by_section = {"model": to_dict(cfg.model),
                           "execution": {k: execution[k] for k in STATE_SHAPING_EXECUTION}}
        differ = [f"{section}.{k}={theirs.get(k)!r} but the config has {section}.{k}={v!r}"
                  for section, values in ours_by_section.items()
                  for theirs in [meta["config"].get(section, {})]
                  for k, v in values.items() if theirs.get(k) != v]
        raise IncompatibleCheckpoint(
            f"{step_dir}: {problem} (saved with {'; '.join(differ) or 'the same model config'}); "
            "use a new run directory for a new model")
