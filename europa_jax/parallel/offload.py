"""Host-memory offload through XLA memory kinds: optimizer state, master weights, activations.

A GH200 reaches its Grace memory over NVLink-C2C (~450 GB/s per direction), fast enough
that the recipe keeps optimizer state and saved activations there instead of in HBM.

- State: leaves of the train state marked for offload have shardings with memory kind
  `pinned_host`. The jitted step receives them in host memory, moves each leaf to the
  device where the update needs it (`to_device`), and its `out_shardings` put the new
  values back on the host. Between steps the device holds none of it. (Transfers are per
  leaf; XLA schedules them. Streaming stacked layers one by one through the update is not
  done yet: during the update the state of one leaf — all layers of it — is on device.)
- Activations: the model tags what it saves with `checkpoint_name` (`layer_input`,
  `attention_out`, `moe_out`); a preset maps each name to save | offload | recompute and
  becomes a `jax.checkpoint` policy (`save_and_offload_only_these_names`, offload to
  `pinned_host`): moving saved activations instead of recomputing them.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal

import jax

from europa_jax.config import OffloadConfig

HOST = "pinned_host"
CHECKPOINT_NAMES = ("layer_input", "attention_out", "moe_out")
Action = Literal["save", "offload", "recompute"]

# Named presets: checkpoint name → what the backward pass does with it. Anything not
# listed is recomputed. `none` means "use execution.remat" and has no entry here.
PRESETS: dict[str, dict[str, Action]] = {
    "full_remat": {},
    "offload_layer_inputs": {"layer_input": "offload"},
    "offload_attention_moe": {"layer_input": "offload", "attention_out": "offload",
                              "moe_out": "offload"},
    "save_dots": {},  # XLA's dots-without-batch-dims policy (see remat_policy)
}


def remat_policy(cfg: OffloadConfig, *, less: tuple[str, ...] = ()) -> Callable | None:
    """The jax.checkpoint policy for `offload.activations`, or None to keep execution.remat;
    `less`: checkpoint names it recomputes whatever the preset says."""
    if cfg.activations == "none":
        return None
    if cfg.activations == "save_dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    actions = {n: a for n, a in PRESETS[cfg.activations].items() if n not in less}
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[n for n, a in actions.items() if a == "save"],
        names_which_can_be_offloaded=[n for n, a in actions.items() if a == "offload"],
        offload_src="device", offload_dst=HOST)


def row_trip_policy(cfg: OffloadConfig, remat: str) -> Callable | None:
    """The policy of one row's trip through a layer under `execution.row_loop` (row_loop.py):
    the activation policy less the layer input, which the layer names for all its rows
    outside the loop. None when nothing is rematerialized (`execution.remat: none`, no preset)."""
    if cfg.activations == "none":
        return jax.checkpoint_policies.nothing_saveable if remat == "full" else None
    return remat_policy(cfg, less=("layer_input",))


def place_state(state_shardings: Any, abstract_state: Any, cfg: OffloadConfig) -> Any:
    """Train-state shardings with offloaded leaves in host memory (scalars stay on device)."""
    def on_host(shardings, shapes):
        # Scalars (step counts) are tiny: moving them would cost more than they hold.
        return jax.tree.map(lambda s, x: s.with_memory_kind(HOST) if x.ndim else s,
                            shardings, shapes)

    replace = {}
    if cfg.optimizer_state:
        replace["opt_state"] = on_host(state_shardings.opt_state, abstract_state.opt_state)
    if cfg.master_params:
        replace["params"] = on_host(state_shardings.params, abstract_state.params)
    return state_shardings.replace(**replace) if replace else state_shardings


def to_device(tree: Any, shardings: Any) -> Any:
    """Inside the step: bring host-resident leaves to device memory, same layout."""
    def move(x, s):
        if s.memory_kind == HOST:
            return jax.device_put(x, s.with_memory_kind("device"))
        return x

    return jax.tree.map(move, tree, shardings)


def memory_kinds(tree: Any) -> dict[str, int]:
    """Bytes per memory kind of a tree of arrays or ShapeDtypeStructs with shardings."""
    totals: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        kind = getattr(leaf.sharding, "memory_kind", None) or "device"
        totals[kind] = totals.get(kind, 0) + leaf.size * leaf.dtype.itemsize
    return totals


def per_device_bytes(leaf) -> int:
    """Bytes of one device's shard of an array (abstract or real) with a sharding."""
    return math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def _kind(leaf) -> str:
    return getattr(leaf.sharding, "memory_kind", None) or "device"


def state_bytes(state) -> dict[str, dict[str, int]]:
    """Per-device bytes of each part of a train state (abstract or real), by memory kind."""
    parts = {"params": state.params, "optimizer_state": state.opt_state,
             "other_state": (state.step, state.router_bias_LE)}
    out = {}
    for name, tree in parts.items():
        kinds: dict[str, int] = {}
        for leaf in jax.tree.leaves(tree):
            kinds[_kind(leaf)] = kinds.get(_kind(leaf), 0) + per_device_bytes(leaf)
        out[name] = kinds
    return out
