"""Explicit collectives of the SPMD step: FSDP weight gathers and the expert exchange.

The loss runs inside one `shard_map` over the whole `(data, expert)` mesh (train.py), so
every byte that crosses devices is written here, with its dtype:

- `gather_weight`: a parameter shard → the full weight for this layer. Forward: quantize
  to float8 e4m3 with one scale (amax over all shards, `pmax`), `all_gather`, dequantize
  to the compute dtype — or gather in bf16/fp32. Backward (custom VJP): the weight's
  gradient is `psum_scatter`ed back to shards in bf16 (or fp32). Master weights and the
  optimizer stay fp32. Expert weights keep their `expert` axis: only the `data` (FSDP)
  part is gathered, the experts stay on the GPU of the node that owns them.
- `ExpertAxis.exchange` / `.counts`: the MoE all-to-all over `expert` only (NVLink inside
  a node). `dense` is `all_to_all` of the per-destination buffers (the CPU default);
  `ragged` is `ragged_all_to_all`, which sends only the filled rows of the very same
  buffers, with no host sync of split sizes — on a CPU mesh, which has no ragged
  collective, a model of its documented contract (ragged_model.py) behind the same call.
- `AttentionGroup`: attention context parallelism over a node's part of `expert` — the
  node's rows' latents all-gathered, each GPU's heads' outputs all-to-all'ed back to
  their rows.

Outside `spmd(...)` (unsharded use: tests, export parity) every function is the identity
up to a dtype cast, so model code runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp

from europa_jax import param_table
from europa_jax.config import CommConfig
from europa_jax.parallel import ragged_model
from europa_jax.parallel.layout import Gather, Layout

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
DTYPES = {"fp8": jnp.float8_e4m3fn, "bf16": jnp.bfloat16, "fp32": jnp.float32}
WIRE_PRECISION = ("fp8", "bf16", "fp32")  # lowest first
EXPERT_AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class SpmdContext:
    """What the model's collectives and kernels need while it is traced inside shard_map:
    the parameters' layout on the mesh (layout.py), the wire settings and the platform."""

    layout: Layout
    comm: CommConfig  # expert_exchange resolved for the platform (never "auto")
    platform: str = "cpu"  # of the mesh's devices: picks backend-specific kernels
    devices_per_node: int = 4  # mesh.devices_per_node: a node's part of the expert axis

    @property
    def mesh_shape(self) -> dict[str, int]:
        return self.layout.mesh_shape


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


def cast_for_entry(params_tree, ctx: SpmdContext):
    """Parameters in the dtype they enter the shard_map in.

    Axes a parameter is replicated over (norm scales; on 96 nodes the tensors without a
    factor 3) get their gradient summed by shard_map's transpose in *this* dtype, so it
    is bf16 exactly when both the gather and the reduction are low precision — except for
    the parameters the table keeps in float32 (param_table.Precision.float32_compute).
    """
    low = (ctx.comm.weight_gather_dtype in ("fp8", "bf16")
           and ctx.comm.grad_reduce_dtype == "bf16")

    def cast(path, p):
        float32 = param_table.row_of_path(path).precision.float32_compute
        return p.astype(jnp.bfloat16 if low and not float32 else jnp.float32)

    return jax.tree_util.tree_map_with_path(cast, params_tree)


# ----------------------------------------------------------------------------- FSDP gather


def gather_weight(w_local: jax.Array, gather: Gather, compute_dtype, *,
                  min_wire: str = "fp8") -> jax.Array:
    """The full weight (minus kept expert sharding) in `compute_dtype`.

    `gather` is the weight's plan on this mesh (layout.ParamLayout.gather); `min_wire`
    floors the configured wire dtype (param_table.Precision.wire: "bf16" for the embedding and
    LM head, "fp32" for the router and norms).
    """
    ctx = current()
    if ctx is None or not gather:
        return w_local.astype(compute_dtype)
    wire = max(ctx.comm.weight_gather_dtype, min_wire, key=WIRE_PRECISION.index)
    return _gather(w_local, gather, wire, ctx.comm.grad_reduce_dtype,
                   jnp.dtype(compute_dtype).name)


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


@dataclasses.dataclass(frozen=True)
class ExpertAxis:
    """The MoE exchange over the `expert` axis: its size, `dense` or `ragged`, and the
    wire dtype of token rows (None: the compute dtype). Taken from the SPMD context while
    the model is traced (`expert_axis()`) and kept by whoever needs it later: a custom
    VJP's backward pass is traced after the context has been left.

    `groups` splits the axis into exchanges among parts of it (`axis_index_groups`): the
    two stages of node_dispatch.py — a node's devices (`inside_nodes`), or one device of
    each node (`across_nodes`); `size` is then a group's size."""

    size: int = 1
    mode: str = "dense"
    wire: str | None = None
    groups: tuple[tuple[int, ...], ...] | None = None
    # `ragged` on a CPU mesh: the op's documented contract in collectives XLA:CPU runs
    # (ragged_model.py), so the GPU's exchange executes in CPU tests
    modelled: bool = False

    def inside_nodes(self, per_node: int) -> "ExpertAxis":
        """Exchanges among the `per_node` consecutive devices of each node."""
        nodes = self.size // per_node
        return dataclasses.replace(self, size=per_node, groups=tuple(
            tuple(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)))

    def across_nodes(self, per_node: int) -> "ExpertAxis":
        """Exchanges among the devices of the same place in each node."""
        nodes = self.size // per_node
        return dataclasses.replace(self, size=nodes, groups=tuple(
            tuple(p + n * per_node for n in range(nodes)) for p in range(per_node)))

    @property
    def _groups(self) -> list[list[int]] | None:
        return [list(g) for g in self.groups] if self.groups else None

    def index(self) -> jax.Array:
        """This device's position on the expert axis, or in its group (0 for size 1)."""
        if self.size == 1:
            return jnp.int32(0)
        me = jax.lax.axis_index(EXPERT_AXIS)
        if not self.groups:
            return me
        position = [0] * sum(len(g) for g in self.groups)
        for g in self.groups:
            for i, device in enumerate(g):
                position[device] = i
        return jnp.asarray(position, jnp.int32)[me]

    def max(self, x: jax.Array) -> jax.Array:
        """The largest `x` over this device's expert group: what the group agrees on
        before exchange rounds that all of it must join (over the whole axis when it is
        split in groups: one answer that every group may use, at the cost of the rounds
        the fullest group needs)."""
        return jax.lax.pmax(x, EXPERT_AXIS) if self.size > 1 else x

    def wire_dtype(self, compute_dtype):
        """Dtype of token rows on the wire (the compute dtype outside SPMD); with `fp8`, of
        the combine's and the backward's rows (bf16): the dispatch's are `dispatch_rows`."""
        if self.wire == "fp8":
            return jnp.bfloat16
        return DTYPES[self.wire] if self.wire else compute_dtype

    def counts(self, send_counts_J: jax.Array) -> jax.Array:
        """Rows each peer will send me, from the rows I send each peer ([ep] int32)."""
        if self.size == 1:
            return send_counts_J
        return jax.lax.all_to_all(send_counts_J, EXPERT_AXIS, 0, 0, tiled=True,
                                  axis_index_groups=self._groups)

    def exchange(self, buf_JC: jax.Array, send_counts_J: jax.Array,
                 recv_counts_J: jax.Array) -> jax.Array:
        """Swap per-peer regions: out[i] = what peer i put in its buf[me].

        `buf_JC` is [ep, C, ...]: region j holds `send_counts_J[j]` filled rows for peer
        j. The result has the same layout, region i holding `recv_counts_J[i]` rows from
        peer i; rows past the counts are don't-care (stale with `ragged`).
        """
        ep = self.size
        if ep == 1:
            return buf_JC
        if self.mode == "dense":
            return jax.lax.all_to_all(buf_JC, EXPERT_AXIS, 0, 0, tiled=True,
                                      axis_index_groups=self._groups)
        c = buf_JC.shape[1]
        flat = buf_JC.reshape(ep * c, *buf_JC.shape[2:])
        region_starts_J = jnp.arange(ep, dtype=jnp.int32) * c
        ragged = ragged_model.ragged_all_to_all if self.modelled else jax.lax.ragged_all_to_all
        out = ragged(
            flat, jnp.zeros_like(flat), region_starts_J, send_counts_J.astype(jnp.int32),
            jnp.full((ep,), self.index() * c, jnp.int32), recv_counts_J.astype(jnp.int32),
            axis_name=EXPERT_AXIS, axis_index_groups=self._groups)
        return out.reshape(buf_JC.shape)


def expert_axis() -> ExpertAxis:
    """The expert exchange of the SPMD context being traced (size 1 outside it)."""
    ctx = current()
    if ctx is None:
        return ExpertAxis()
    return ExpertAxis(ctx.mesh_shape.get(EXPERT_AXIS, 1), ctx.comm.expert_exchange,
                      ctx.comm.expert_exchange_dtype, modelled=ctx.platform == "cpu")


def two_stage_nodes() -> int:
    """Devices per node when the MoE dispatches in two stages (`comm.expert_dispatch:
    two_stage` over an expert axis wider than a node), else 0."""
    ctx = current()
    if (ctx is None or ctx.comm.expert_dispatch != "two_stage"
            or ctx.mesh_shape.get(EXPERT_AXIS, 1) <= ctx.devices_per_node):
        return 0
    return ctx.devices_per_node


def psum_all(x: jax.Array) -> jax.Array:
    """Sum over every mesh axis (loss numerators, expert loads); identity outside SPMD."""
    ctx = current()
    if ctx is None:
        return x
    return jax.lax.psum(x, tuple(ctx.mesh_shape))


# ----------------------------------------------------------------------------- attention, node


@dataclasses.dataclass(frozen=True)
class AttentionGroup:
    """Attention context parallelism over the GPUs of one node (NVLink).

    The node's GPUs compute the attention of all the node's rows together, each for its
    own slice of the heads (Ulysses-style, Jacobs et al. 2023, arXiv:2309.14509): every
    GPU then runs the same number of unmasked query-key pairs whatever the documents, and
    the flash kernels see whole rows, so document masks and causality are unchanged. MLA
    makes the exchange small: a GPU needs of the other rows only their low-rank latents
    (q 1536 + kv 512 + RoPE key 64 values per token, against 64 · 512 for the heads),
    which it multiplies by its own heads' slice of w_q_b / w_kv_b; the outputs go back to
    their rows' owners per head. Forward: one all-gather of the latents, one all-to-all of
    the outputs. Backward (autodiff's transposes): an all-to-all of the output gradients
    and a reduce-scatter of the latents' gradients. Positions and segment ids are
    gathered once per step (transformer.py). Size 1 outside SPMD or when off.

    The group is `size` consecutive devices of the `expert` axis: all of it while the
    axis fits in a node, else each node's part of it (`parts` > 1, collectives over
    `axis_index_groups`), so that an expert axis across nodes keeps attention on NVLink.
    """

    size: int = 1
    parts: int = 1  # groups along the expert axis (its nodes)

    @property
    def _groups(self) -> list[list[int]] | None:
        if self.parts == 1:
            return None
        return [list(range(p * self.size, (p + 1) * self.size)) for p in range(self.parts)]

    def gather_rows(self, x_B: jax.Array) -> jax.Array:
        """The node's rows, peers in device order: [B, ...] → [size·B, ...]."""
        if self.size == 1:
            return x_B
        return jax.lax.all_gather(x_B, EXPERT_AXIS, axis=0, tiled=True,
                                  axis_index_groups=self._groups)

    def local_heads(self, w: jax.Array, axis: int) -> jax.Array:
        """This GPU's slice of the heads along `axis` (heads split evenly, device order)."""
        if self.size == 1:
            return w
        n = w.shape[axis] // self.size
        rank = jax.lax.axis_index(EXPERT_AXIS) % self.size
        return jax.lax.dynamic_slice_in_dim(w, rank * n, n, axis)

    def rows_home(self, out_BSHO: jax.Array) -> jax.Array:
        """Node rows × my heads → my rows × all heads: [size·B, S, H/size, O] → [B, S, H, O]
        (row block j to peer j, its head blocks concatenated in device order)."""
        if self.size == 1:
            return out_BSHO
        return jax.lax.all_to_all(out_BSHO, EXPERT_AXIS, 0, 2, tiled=True,
                                  axis_index_groups=self._groups)

    def all_heads(self, m_H: jax.Array) -> jax.Array:
        """Per-head values of my heads → of every head ([H/size] → [H])."""
        if self.size == 1:
            return m_H
        return jax.lax.all_gather(m_H, EXPERT_AXIS, axis=0, tiled=True,
                                  axis_index_groups=self._groups)


def attention_group(enabled: bool) -> AttentionGroup:
    """The attention group of the SPMD context being traced: the node's GPUs of the expert
    axis when `execution.attention_context_parallel` is on, else (and outside SPMD) size 1."""
    ctx = current()
    if ctx is None or not enabled:
        return AttentionGroup()
    ep = ctx.mesh_shape.get(EXPERT_AXIS, 1)
    size = min(ep, ctx.devices_per_node)
    return AttentionGroup(size, ep // size)
