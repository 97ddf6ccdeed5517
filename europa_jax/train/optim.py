"""Muon for hidden matrices, AdamW for the rest; warmup-stable-decay; global-norm clipping.

Muon (Jordan 2024; Liu et al. 2025 "Muon is Scalable for LLM Training", arXiv:2502.16982)
orthogonalizes each matrix's momentum with Newton–Schulz. Which axes form "the matrix"
matters for our stacked, multi-axis weights, so every Muon parameter's row in the table
(param_table.py, `muon_axes`) says: leading `layers` (scan) and `experts` axes are batch
axes (one orthogonalization per layer, per expert); the trailing axes split into
reduction (input) and output groups, e.g. `w_q_b[Q, H, K]` is one `Q × (H·K)` matrix
exactly like DeepSeek's `q_b_proj`.

AdamW keeps the embedding, LM head and router gate (decayed) and norm scales (not
decayed), as the table's `optimizer` says. The router gate stays on AdamW on purpose:
its columns are per-expert classifier directions whose *individual* scales decide
routing; orthogonalizing the update would equalize its singular values and move all
experts' logits in lockstep, the same reason Muon excludes the LM head. It is < 0.05 %
of parameters.

With `consistent_rms=0.2` Muon's update RMS matches AdamW's (Moonlight/Kimi), so one
learning rate and schedule serve both groups.

Given the trainer's mesh, Newton–Schulz runs on whole matrices spread over the devices
(muon_sharded.py) instead of on stacks GSPMD would gather onto every device.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh
from optax.contrib import MuonDimensionNumbers

from europa_jax import param_table
from europa_jax.config import ModelConfig, OptimConfig
from europa_jax.train import muon_sharded


def labels(params: Any) -> Any:
    """'muon' | 'adamw' | 'adamw_no_decay' per parameter, from its row in the parameter
    table (param_table.py); an undeclared parameter is an error."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: param_table.row_of_path(path).optimizer, params)


def muon_dimension_numbers(params: Any) -> Any:
    """Reduction/output axes of each Muon matrix (leading axes are batch axes); None else."""
    def dims(path, leaf):
        row = param_table.row_of_path(path)
        if row.muon_axes is None:
            return None
        n_reduce, n_out = row.muon_axes
        ndim = len(leaf.shape)
        reduce_axes = tuple(range(ndim - n_reduce - n_out, ndim - n_out))
        return MuonDimensionNumbers(reduction_axis=reduce_axes,
                                    output_axis=tuple(range(ndim - n_out, ndim)))

    return jax.tree_util.tree_map_with_path(dims, params)


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Warmup-stable-decay: linear warmup, constant plateau, linear decay in the last fraction."""
    decay_steps = max(1, int(round(cfg.decay_fraction * total_steps)))
    stable_steps = max(0, total_steps - cfg.warmup_steps - decay_steps)
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    return optax.join_schedules(
        [optax.linear_schedule(0.0 if cfg.warmup_steps else peak, peak, max(cfg.warmup_steps, 1)),
         optax.constant_schedule(peak),
         optax.linear_schedule(peak, floor, decay_steps)],
        boundaries=[cfg.warmup_steps, cfg.warmup_steps + stable_steps])


def build_optimizer(cfg: OptimConfig, total_steps: int, mesh: Mesh | None = None,
                    param_specs: Any = None, model_shapes: Any = None
                    ) -> optax.GradientTransformation:
    """The optimizer; with `mesh` and the parameters' PartitionSpecs, Muon orthogonalizes
    each matrix whole on one device, the matrices spread over the mesh (muon_sharded.py),
    instead of letting GSPMD gather every stack. Without a mesh: optax.contrib.muon's math.
    `model_shapes` (a tree of shape tuples like the parameters) gives Muon's scaling the
    shapes without storage padding; by default the parameters' own."""
    if (mesh is None) != (param_specs is None):
        raise ValueError("build_optimizer: pass both mesh and param_specs, or neither")
    lr = schedule(cfg, total_steps)
    muon = muon_sharded.muon(
        lr, ns_steps=cfg.muon_ns_steps, beta=cfg.muon_beta, eps=cfg.adam_eps,
        ns_dtype=cfg.muon_ns_dtype,
        weight_decay=cfg.weight_decay, consistent_rms=cfg.muon_consistent_rms,
        dims_fn=muon_dimension_numbers, mesh=mesh,
        specs_fn=None if mesh is None else muon_sharded.specs_by_path(param_specs),
        shapes_fn=None if model_shapes is None else muon_sharded.shapes_by_path(model_shapes))

    def adamw(weight_decay: float) -> optax.GradientTransformation:
        return optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                           weight_decay=weight_decay)

    partitioned = optax.partition(
        {"muon": muon, "adamw": adamw(cfg.weight_decay), "adamw_no_decay": adamw(0.0)}, labels)
    clip = optax.clip_by_global_norm(cfg.clip_grad_norm) if cfg.clip_grad_norm else optax.identity()
    return optax.chain(clip, partitioned)


def muon_fraction(cfg: ModelConfig) -> float:
    """Share of the model's parameters (by count, without storage padding, the MTP
    modules' included) that Muon updates."""
    count = lambda rows: sum((param_table.layer_count(p, cfg) + param_table.mtp_count(p, cfg))
                             * param_table.size(p, cfg) for p in rows)
    rows = param_table.ROWS.values()
    return count(p for p in rows if p.optimizer == "muon") / count(rows)
