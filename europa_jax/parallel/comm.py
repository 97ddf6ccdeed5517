"""Explicit collectives of the SPMD step: FSDP weight gathers and the expert exchange.

The loss runs inside one `shard_map` over the whole `(data, expert)` mesh (train.py), so
every byte that crosses devices is written here, with its dtype:

- `gather_weight`: a parameter shard → the full weight for this layer. Forward: quantize
  to float8 e4m3 with one scale (amax over all shards, `pmax`), `all_gather`, dequantize
  to the compute dtype — or gather in bf16/fp32. Backward (custom VJP): the weight's
  gradient is `psum_scatter`ed back to shards in bf16 (or fp32). Master weights and the
  optimizer stay fp32. Expert weights keep their `expert` axis: only the `data` (FSDP)
  part is gathered, the experts stay on the GPU of the node that owns them.
- `exchange` / `exchange_counts`: the MoE all-to-all over `expert` only (NVLink inside a
  node). `dense` is `all_to_all` of per-destination buffers sized so nothing can drop
  (XLA:CPU has no ragged collective); `ragged` is `ragged_all_to_all`, which sends only
  the filled rows of the very same buffers, with no host sync of split sizes.

Outside `spmd(...)` (unsharded use: tests, export parity) every function is the identity
up to a dtype cast, so model code runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from europa_jax.parallel import sharding

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
DTYPES = {"fp8": jnp.float8_e4m3fn, "bf16": jnp.bfloat16, "fp32": jnp.float32}
WIRE_PRECISION = ("fp8", "bf16", "fp32")  # lowest first
EXPERT_AXIS = "expert"
# Logical axes whose sharding over a mesh axis is *kept* when a weight is gathered:
# expert parallelism — each device computes only the experts it holds.
KEPT_SHARDED = {"experts": EXPERT_AXIS}


@dataclasses.dataclass(frozen=True)
class SpmdContext:
    """What the collectives need to know while the model is traced inside shard_map."""

    mesh_shape: dict[str, int]
    platform: str = "cpu"  # of the mesh's devices: picks backend-specific kernels
    weight_gather_dtype: str = "fp32"  # fp8 | bf16 | fp32
    grad_reduce_dtype: str = "fp32"  # bf16 | fp32
    expert_exchange: str = "dense"  # dense | ragged
    expert_exchange_dtype: str = "fp32"  # bf16 | fp32: token rows on the MoE all-to-all

    def __hash__(self):  # usable as a jit static argument / cache key despite the dict
        return hash((tuple(self.mesh_shape.items()), self.platform, self.weight_gather_dtype,
                     self.grad_reduce_dtype, self.expert_exchange, self.expert_exchange_dtype))


_CONTEXT: contextvars.ContextVar[SpmdContext | None] = contextvars.ContextVar(
    "spmd", default=None)


@contextlib.contextmanager
def spmd(ctx: SpmdContext):
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current() -> SpmdContext | None:
    return _CONTEXT.get()


# Used in float32 whatever the wire: the router decides discrete choices, norm scales are
# tiny and replicated.
FULL_PRECISION_PARAMS = frozenset({"w_router", "scale"})


def cast_for_entry(params, ctx: SpmdContext):
    """Parameters in the dtype they enter the shard_map in.

    Axes a parameter is replicated over (norm scales; on 96 nodes the tensors without a
    factor 3) get their gradient summed by shard_map's transpose in *this* dtype, so it
    is bf16 exactly when both the gather and the reduction are low precision.
    """
    low = ctx.weight_gather_dtype in ("fp8", "bf16") and ctx.grad_reduce_dtype == "bf16"

    def cast(path, p):
        name = sharding.param_name(path)
        return p.astype(jnp.bfloat16 if low and name not in FULL_PRECISION_PARAMS else
                        jnp.float32)

    return jax.tree_util.tree_map_with_path(cast, params)


# ----------------------------------------------------------------------------- FSDP gather


def gather_plan(logical_axes: Sequence[str], global_shape: Sequence[int],
                mesh_shape: dict[str, int]) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """(dimension, mesh axes to all-gather it over) for each sharded dimension."""
    spec = sharding.resolve_spec(logical_axes, global_shape, mesh_shape)
    plan = []
    for dim, (name, entry) in enumerate(zip(logical_axes, spec)):
        axes = sharding.entry_axes(entry)
        kept = KEPT_SHARDED.get(name)
        if kept in axes:
            if axes[0] != kept:  # the kept axis must be major for the gathered blocks to
                raise ValueError(f"{name}: {axes} keeps {kept} but it is not the major axis")
            axes = axes[1:]  # ... be contiguous (one node's experts)
        if axes:
            plan.append((dim, tuple(axes)))
    return tuple(plan)


def local_shape(logical_axes: Sequence[str], global_shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of this device's shard of a parameter (the global shape outside SPMD)."""
    ctx = current()
    if ctx is None:
        return tuple(global_shape)
    spec = sharding.resolve_spec(logical_axes, global_shape, ctx.mesh_shape)
    return tuple(size // math.prod(ctx.mesh_shape[a] for a in sharding.entry_axes(entry))
                 for size, entry in zip(global_shape, spec))


def gather_weight(w_local: jax.Array, logical_axes: Sequence[str], global_shape: Sequence[int],
                  compute_dtype, *, min_wire: str = "fp8") -> jax.Array:
    """The full weight (minus kept expert sharding) in `compute_dtype`.

    `min_wire` floors the configured wire dtype: "bf16" for the embedding table and LM
    head (never fp8: logits are precision-sensitive), "fp32" for the router and norms.
    """
    ctx = current()
    if ctx is None:
        return w_local.astype(compute_dtype)
    plan = gather_plan(logical_axes, global_shape, ctx.mesh_shape)
    if not plan:
        return w_local.astype(compute_dtype)
    wire = max(ctx.weight_gather_dtype, min_wire, key=WIRE_PRECISION.index)
    return _gather(w_local, plan, wire, ctx.grad_reduce_dtype, jnp.dtype(compute_dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(w_local, plan, wire, reduce, compute):
    if wire == "fp8":
        all_axes = tuple(a for _, axes in plan for a in axes)
        amax = jax.lax.pmax(jnp.max(jnp.abs(w_local.astype(jnp.float32))), all_axes)
        scale = jnp.maximum(amax, 1e-12) / FP8_MAX
        w = (w_local.astype(jnp.float32) / scale).astype(DTYPES["fp8"])
    else:
        w = w_local.astype(DTYPES[wire])
    for dim, axes in plan:
        w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    w = w.astype(compute)
    return w * scale.astype(compute) if wire == "fp8" else w


def _gather_fwd(w_local, plan, wire, reduce, compute):
    return _gather(w_local, plan, wire, reduce, compute), jnp.zeros((0,), w_local.dtype)


def _gather_bwd(plan, wire, reduce, compute, dtype_witness, ct):
    # Straight-through for the fp8 rounding; the reduction is the gather's transpose.
    g = ct.astype(DTYPES[reduce])
    for dim, axes in reversed(plan):
        g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
    return (g.astype(dtype_witness.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


# ----------------------------------------------------------------------------- expert exchange


def expert_parallelism() -> int:
    ctx = current()
    return ctx.mesh_shape.get(EXPERT_AXIS, 1) if ctx else 1


def expert_index() -> jax.Array:
    """This device's position on the expert axis (0 outside shard_map)."""
    return jax.lax.axis_index(EXPERT_AXIS) if expert_parallelism() > 1 else jnp.int32(0)


def exchange_dtype(compute_dtype):
    """Dtype of token rows on the MoE all-to-all (the compute dtype outside SPMD)."""
    ctx = current()
    return DTYPES[ctx.expert_exchange_dtype] if ctx else compute_dtype


def exchange_counts(send_counts_J: jax.Array) -> jax.Array:
    """Rows each peer will send me, from the rows I send each peer ([ep] int32)."""
    if expert_parallelism() == 1:
        return send_counts_J
    return jax.lax.all_to_all(send_counts_J, EXPERT_AXIS, 0, 0, tiled=True)


def exchange(buf_JC: jax.Array, send_counts_J: jax.Array, recv_counts_J: jax.Array) -> jax.Array:
    """Swap per-peer regions over the expert axis: out[i] = what peer i put in its buf[me].

    `buf_JC` is [ep, C, ...]: region j holds `send_counts_J[j]` filled rows for peer j
    (C = worst case, so nothing drops). The result has the same layout, region i holding
    `recv_counts_J[i]` rows from peer i; rows past the counts are don't-care.
    """
    ep = expert_parallelism()
    if ep == 1:
        return buf_JC
    if current().expert_exchange == "dense":
        return jax.lax.all_to_all(buf_JC, EXPERT_AXIS, 0, 0, tiled=True)
    c = buf_JC.shape[1]
    flat = buf_JC.reshape(ep * c, *buf_JC.shape[2:])
    region_starts_J = jnp.arange(ep, dtype=jnp.int32) * c
    out = jax.lax.ragged_all_to_all(
        flat, jnp.zeros_like(flat), region_starts_J, send_counts_J.astype(jnp.int32),
        jnp.full((ep,), expert_index() * c, jnp.int32), recv_counts_J.astype(jnp.int32),
        axis_name=EXPERT_AXIS)
    return out.reshape(buf_JC.shape)


def psum_all(x: jax.Array) -> jax.Array:
    """Sum over every mesh axis (loss numerators, expert loads); identity outside SPMD."""
    ctx = current()
    if ctx is None:
        return x
    return jax.lax.psum(x, tuple(ctx.mesh_shape))
