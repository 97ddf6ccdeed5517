"""A run's committed checkpoints on disk, read without devices and without Orbax's manager.

What the commands that only read a checkpoint need (export, sampling, evaluation, the
loop's resume decision): where the steps are, which are committed, a step's metadata, one
saved array as a lazy TensorStore, and the fingerprint of a host array to check it
against. The layout and the fingerprint are `checkpoint.py`'s, which writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tensorstore as ts

from europa_jax import param_table
from europa_jax.config import ConfigError
from europa_jax.config_loader import saved_config

CHECKPOINT_SUBDIR = "checkpoints"
CORRUPT_SUBDIR = "corrupt_checkpoints"


class CheckpointError(Exception):
    """A checkpoint problem a user must look at; the message is one line."""


class IncompatibleCheckpoint(CheckpointError):
    """The checkpoint is intact but was made for another model shape."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_SUBDIR


def leaf_key(path) -> str:
    """Orbax's name for a tree leaf ('params.moe_layers.moe.w_gate'): its storage key too."""
    return ".".join(param_table.key_names(path))


def host_bit_sum(x: np.ndarray) -> int:
    """`checkpoint.fingerprint` of one host array (or a slice of one: partial sums add mod
    2^32)."""
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    return int(np.ascontiguousarray(x).view(unsigned).sum(dtype=np.uint64) % 2**32)


def committed_steps(run_dir: str | Path) -> list[int]:
    """Committed steps, oldest first (temporary dirs of unfinished saves are not steps)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def step_dir_of(run_dir: str | Path, step: int | None, purpose: str,
                error: type[Exception] = ConfigError) -> Path:
    """The directory of committed checkpoint `step` of a run (None: the latest), for a
    command that reads one (`purpose`: "export", "sample from", "evaluate"); a missing run
    directory, no checkpoint or another step is one line, raised as `error`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise error(f"{run_dir}: no such run directory")
    steps = committed_steps(run_dir)
    if not steps:
        raise error(f"{checkpoint_dir(run_dir)}: no checkpoint to {purpose}")
    if step is not None and step not in steps:
        raise error(f"--step {step}: not a checkpoint of {run_dir} (have {steps})")
    return checkpoint_dir(run_dir) / str(steps[-1] if step is None else step)


def read_meta(step_dir: Path) -> dict:
    return in_this_layout(json.loads((step_dir / "meta" / "metadata").read_text()))


def in_this_layout(meta: dict) -> dict:
    """A checkpoint's metadata with its saved config in this version's layout: a run saved
    before a key moved (`model.remat` before `execution.remat`) reads, resumes, exports and
    samples as it was saved (config_loader.saved_config)."""
    if isinstance(meta.get("config"), dict):
        meta = {**meta, "config": saved_config(meta["config"])}
    return meta


def open_saved_array(step_dir: Path, key: str) -> ts.TensorStore:
    """One array of a saved `state` as a lazy TensorStore: slices read only their chunks.

    Export uses this to stream a checkpoint layer by layer on any host, without devices
    and without loading the model. The format (zarr inside OCDBT) is what Orbax declares
    in the item's `_METADATA`; anything else is refused rather than misread.
    """
    item = step_dir / "state"
    layout = json.loads((item / "_METADATA").read_text())
    if not layout.get("use_ocdbt", False):
        raise CheckpointError(f"{item}: expected an OCDBT checkpoint (Orbax default)")
    driver = "zarr3" if layout.get("use_zarr3") else "zarr"
    spec = {"driver": driver, "kvstore": {"driver": "ocdbt", "base": f"file://{item.absolute()}",
                                         "path": key}}
    return ts.open(spec, read=True).result()
