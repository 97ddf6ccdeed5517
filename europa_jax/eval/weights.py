"""A checkpoint's weights read straight into a mesh's shards, without its optimizer state.

`europa-jax eval` needs the parameters and the router bias only: Orbax's restore of the
whole train state would also read the optimizer's moments (twice the parameters under
AdamW, as much under Muon) onto the devices. Each saved array is opened lazily
(store/saved_checkpoints.py `open_saved_array`: zarr in OCDBT) and every process reads only the
blocks of its own devices' shards (`jax.make_array_from_callback`), in the shardings the
trainer lays them out in on this mesh, which may differ from the one that saved them. The
arrays are then checked against the fingerprints saved with them, as a resume checks.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from europa_jax.store import checkpoint
from europa_jax.train.train import Trainer


def read_weights(step_dir: Path, trainer: Trainer, meta: dict) -> tuple[object, jax.Array]:
    """(parameters, router bias [L, E]) of the checkpoint at `step_dir`, sharded as
    `trainer.state_shardings` says; CheckpointError when an array is not as saved."""
    wanted = trainer.abstract_state.replace(step=None, opt_state=None)

    def read(path, leaf):
        key = checkpoint.leaf_key(path)
        if key not in meta["fingerprint"]:
            raise checkpoint.IncompatibleCheckpoint(f"{step_dir}: no {key} in the checkpoint")
        store = checkpoint.open_saved_array(step_dir, key)
        if tuple(store.shape) != tuple(leaf.shape):
            raise checkpoint.IncompatibleCheckpoint(
                f"{step_dir}: {key} is {list(store.shape)} in the checkpoint but "
                f"{list(leaf.shape)} in this model")
        return jax.make_array_from_callback(
            leaf.shape, leaf.sharding,
            lambda index: np.asarray(store[index].read().result(), dtype=leaf.dtype))

    weights = jax.tree_util.tree_map_with_path(read, wanted)
    found = checkpoint.fingerprint(weights)
    bad = [key for key, value in found.items() if meta["fingerprint"][key] != value]
    if bad:
        raise checkpoint.CheckpointError(
            f"{step_dir}: {bad[0]} does not match its saved fingerprint ({len(bad)} arrays "
            "differ: a corrupted checkpoint); evaluate another --step")
    return weights.params, weights.router_bias_LE
