"""QK-clip, the "Clip" of MuonClip (Kimi K2, arXiv:2507.20534 §2.1), for MLA attention.

Muon at scale lets attention logits grow until training diverges. After each optimizer
step, every layer and head whose largest pre-softmax logit S_max of the step (measured
in its forward pass, attention.row_max_per_head) exceeded τ = `optim.qk_clip_threshold`
gets γ = τ / S_max folded into its query/key projections. MLA's logit is
q_nope·k_nope + q_rope·k_rope, with the RoPE key shared by all heads, so (as in K2):
- the head's no-RoPE query columns (w_q_b[..., h, :N]) and no-RoPE key columns
  (w_kv_b[..., h, :N]) are scaled by √γ — their product by γ;
- the head's RoPE query columns (w_q_b[..., h, N:N+P]) by γ;
- the shared RoPE key (part of w_kv_a) and the values (w_kv_b[..., h, N:]) are untouched.
Logits are bilinear in q and k, so given the same layer input the head's new max is
exactly τ (later layers see changed inputs, and the step's own update is clipped with the
max measured before it, as in K2: the next forward can exceed τ again). Heads at or under
τ are multiplied by exactly 1.0: bit-identical.

Shape suffixes (europa_jax/__init__.py): L layers, H heads, K head dims (the stored
width, padding included).

Cost: the factor multiplies the float32 master shards of w_q_b and w_kv_b elementwise
(one multiply per stored element per step, `cost`); the factor is pinned replicated and
only sliced on each shard, so the clip adds no collective; the measurement is one max over [L, H] floats
across devices (`global_max`) and, per layer, a max over the rows' softmax maxima that
the attention kernels compute anyway.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from europa_jax import param_table
from europa_jax.config import ModelConfig
from europa_jax.parallel import comm, layout


# The head-specific up-projections QK-clip scales along their `heads` axis.
W_Q_B, W_KV_B = param_table.row("attention.w_q_b"), param_table.row("attention.w_kv_b")


def global_max(x: jax.Array) -> jax.Array:
    """Max over every mesh axis (each device saw different rows); identity outside SPMD."""
    x = jax.lax.stop_gradient(x)
    ctx = comm.current()
    return x if ctx is None else jax.lax.pmax(x, tuple(ctx.mesh_shape))


def head_factors(logit_max_LH: jax.Array, threshold: float) -> tuple[jax.Array, jax.Array]:
    """γ [L, H] (τ / S_max where S_max > τ, exactly 1.0 elsewhere) and which heads clip."""
    over_LH = logit_max_LH > threshold  # False for NaN and -inf (no real row): no clip
    return jnp.where(over_LH, threshold / jnp.where(over_LH, logit_max_LH, 1.0), 1.0), over_LH


def layer_stacks(cfg: ModelConfig, scanned: bool) -> list[tuple[str, slice | int]]:
    """(parameter key, its layers in the [L, ...] stats: dense, MoE, then the MTP modules'
    blocks): the scanned stacks (`execution.scan_layers`) hold a slice of the layers on a
    leading axis, unrolled layers one each."""
    out, first = [], 0
    for stack, n in zip(param_table.STACKS,
                        (cfg.n_dense_layers, cfg.n_moe_layers, cfg.mtp_layers)):
        if scanned and n:
            out.append((stack, slice(first, first + n)))
        elif not scanned:
            out += [(param_table.stack_key(stack, i, scanned=False)[0], first + i)
                    for i in range(n)]
        first += n
    return out


def scale_heads(w: jax.Array, axes: tuple[str, ...], sqrt_gamma_LH: jax.Array,
                gamma_LH: jax.Array, n_sqrt: int, n_gamma: int,
                replicated: jax.sharding.Sharding | None = None) -> jax.Array:
    """`w` with head h's first `n_sqrt` head_dim columns × √γ[h], the next `n_gamma` × γ[h],
    the rest (and storage padding of heads or head_dim) × 1.

    `w` is the stored parameter (sharding.storage_shape), with `axes` its logical axes and
    [L, H] factors if `axes` starts with `layers`, [H] ones otherwise. The factor is built
    in the shape of the (layers, heads, head_dim) axes and broadcast over the others, so
    the multiply is elementwise on each shard. `replicated` (the step's mesh, P()) pins
    the factor replicated: each shard then slices it locally. Left to itself the SPMD
    partitioner computes the factors sharded like one weight's heads (europa-952b's
    w_kv_b shards heads over `expert`, w_q_b does not) and all-gathers them for the other.
    """
    heads, head_dim = axes.index("heads"), axes.index("head_dim")
    assert heads < head_dim and axes.count("heads") == 1, axes
    h_stored, k_stored = w.shape[heads], w.shape[head_dim]
    k_K = jnp.arange(k_stored)
    factor_LHK = jnp.where(k_K < n_sqrt, sqrt_gamma_LH[..., None],
                           jnp.where(k_K < n_sqrt + n_gamma, gamma_LH[..., None], 1.0))
    pad = h_stored - factor_LHK.shape[-2]  # storage padding of the heads axis: zeros, × 1
    factor_LHK = jnp.pad(factor_LHK, [(0, 0)] * (factor_LHK.ndim - 2) + [(0, pad), (0, 0)],
                         constant_values=1.0)
    kept = [d for d, name in enumerate(axes) if name in ("layers", "heads", "head_dim")]
    assert len(kept) == factor_LHK.ndim and (len(kept) == 2 or kept[0] == 0), axes
    shape = [w.shape[d] if d in kept else 1 for d in range(w.ndim)]
    return w * _pinned(factor_LHK.reshape(shape).astype(w.dtype), replicated)


def _pinned(x: jax.Array, replicated: jax.sharding.Sharding | None) -> jax.Array:
    return x if replicated is None else jax.lax.with_sharding_constraint(x, replicated)


def clip(params: Any, logit_max_LH: jax.Array, threshold: float | None, cfg: ModelConfig,
         replicated: jax.sharding.Sharding | None = None, *,
         scanned: bool) -> tuple[Any, jax.Array]:
    """(params with every head over `threshold` clipped, number of heads clipped).

    `logit_max_LH` is the step's global per-layer, per-head max logit, layers in model
    order (dense first, Transformer's stats). `threshold` None or 0: params unchanged.
    Inside a sharded step pass `replicated` (a replicated sharding of its mesh): the
    factors are then computed whole on every device and the clip needs no collective.
    """
    if not threshold:
        return params, jnp.zeros((), jnp.int32)
    logit_max_LH = _pinned(logit_max_LH.astype(jnp.float32), replicated)
    gamma_LH, over_LH = head_factors(logit_max_LH, float(threshold))
    gamma_LH, over_LH = _pinned(gamma_LH, replicated), _pinned(over_LH, replicated)
    sqrt_gamma_LH = jnp.sqrt(gamma_LH)  # √1 = 1 exactly: unclipped heads stay bit-identical
    n, p = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    params = dict(params)
    for key, layers in layer_stacks(cfg, scanned):
        lead = ("layers",) if isinstance(layers, slice) else ()
        attention = dict(params[key]["attention"])
        attention["w_q_b"] = scale_heads(attention["w_q_b"], lead + W_Q_B.axes,
                                         sqrt_gamma_LH[layers], gamma_LH[layers], n, p,
                                         replicated)
        attention["w_kv_b"] = scale_heads(attention["w_kv_b"], lead + W_KV_B.axes,
                                          sqrt_gamma_LH[layers], gamma_LH[layers], n, 0,
                                          replicated)
        params[key] = {**params[key], "attention": attention}
    return params, over_LH.sum().astype(jnp.int32)


def cost(cfg: ModelConfig, threshold: float | None, n_devices: int,
         tokens_per_device: float, *, pad_multiple: int) -> dict[str, Any]:
    """What QK-clip adds to a step per device: analytic, each formula stated beside it.

    The measurement (max logits, one all-reduce) runs whether or not the clip is on; the
    clip itself only when `threshold` is set.
    """
    unsharded = layout.for_mesh(cfg, pad_multiple=pad_multiple)
    stored = lambda role: math.prod(unsharded[role].stored_shape)
    h, layers = cfg.n_heads, cfg.n_layers
    clipped = layers * (stored("attention.w_q_b") + stored("attention.w_kv_b"))
    on = bool(threshold)
    return {
        "threshold": threshold if on else None,
        "clip_flops": clipped / n_devices if on else 0.0,
        "clip_hbm_bytes": 2 * 4 * clipped / n_devices if on else 0.0,
        "measure_flops": layers * h * tokens_per_device,
        "residual_bytes_per_layer": 2 * 4 * h * tokens_per_device,
        "all_reduce_bytes": 4 * layers * h,
        "formulas": {
            "clip_flops": "n_layers · (stored w_q_b + w_kv_b elements) / devices: one "
                          "multiply each",
            "clip_hbm_bytes": "the same elements, float32, read and written",
            "measure_flops": "n_layers · heads · tokens/device: one compare per query row",
            "residual_bytes_per_layer": "(max, denominator) · 4 B · heads · tokens/device, "
                                        "transient: reduced to [heads] in the layer",
            "all_reduce_bytes": "4 B · n_layers · heads, once per step (max over devices)",
        },
    }
