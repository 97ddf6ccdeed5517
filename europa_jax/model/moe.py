"""DeepSeek-V3 mixture of experts: sigmoid router, group-limited top-k, shared expert.

Shape suffixes: the project's one legend (europa_jax/__init__.py); here T tokens (B·S),
U experts chosen per token (top-k), M rows sorted by expert (one per row and choice),
J peers on the expert axis, C slots per peer (capacity), R = J·C rows received,
X and Y blocks (chunks) and the rows in one.

Routing (DeepSeek-V3 §2.1.2, arXiv:2412.19437): scores = sigmoid(x·W_router). A per-expert
bias, updated outside the gradient (aux-loss-free balancing), is added to the scores only
to *select* experts; the gate weights come from the unbiased scores. With group-limited
routing a token first picks `topk_group` of `n_group` groups (group score = sum of its
two best biased scores), then its top-k experts inside those groups.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from europa_jax.config import ModelConfig
from europa_jax.model import kernels
from europa_jax.model.layers import SwiGLU, weight
from europa_jax.parallel import comm


def route(logits_TE: jax.Array, bias_E: jax.Array, cfg: ModelConfig):
    """Return (gate weights [T, U] float32, chosen experts [T, U] int32)."""
    scores_TE = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
    choice_TE = scores_TE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    t, e = choice_TE.shape
    if cfg.n_group > 1:
        choice_TGE = choice_TE.reshape(t, cfg.n_group, e // cfg.n_group)
        group_score_TG = jax.lax.top_k(choice_TGE, 2)[0].sum(axis=-1)
        _, kept_groups = jax.lax.top_k(group_score_TG, cfg.topk_group)  # [T, topk_group]
        keep_TG = jax.nn.one_hot(kept_groups, cfg.n_group, dtype=jnp.bool_).any(axis=1)
        choice_TE = jnp.where(keep_TG[:, :, None], choice_TGE, -jnp.inf).reshape(t, e)
    _, experts_TU = jax.lax.top_k(choice_TE, cfg.top_k)
    weights_TU = jnp.take_along_axis(scores_TE, experts_TU, axis=-1)
    if cfg.norm_topk_prob:
        weights_TU = weights_TU / (weights_TU.sum(axis=-1, keepdims=True) + 1e-20)
    return weights_TU * cfg.routed_scaling_factor, experts_TU.astype(jnp.int32)


def grouped_swiglu(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E, *, impl: str,
                   block_rows: int = 256):
    """SwiGLU per expert on rows sorted by expert; rows past sum(group_sizes) give zeros.

    - `tokamax`: tokamax's grouped matmul — on Hopper its Pallas Mosaic GPU kernel (then
      Triton), each row multiplied by its own expert's matrix only; elsewhere tokamax
      falls back to XLA. The GPU default. `tokamax_triton`: the Triton kernel only (built
      entirely ahead of time; Mosaic GPU kernels are built when the program loads).
    - `ragged_dot`: `jax.lax.ragged_dot`. jaxlib 0.10.2 compiles it, on GPU as on CPU, to
      a dense masked matmul over *all* experts (E× the FLOPs and an [E, M, ·] buffer).
    - `blocked` (XLA:CPU): each expert's rows are padded to a multiple of `block_rows`,
      every block then belongs to one expert and is multiplied by that expert's matrix;
      blocks past the filled rows are skipped at run time (the expert-parallel receive
      buffer is sized for the worst case). Exact, at most E·(block_rows−1) padding rows.
    """
    if impl in ("ragged_dot", "tokamax", "tokamax_triton"):
        matmul = _ragged_matmul(impl, group_sizes_E)
        hidden_MF = nn.silu(matmul(x_MD, w_gate_EDF)) * matmul(x_MD, w_up_EDF)
        out_MD = matmul(hidden_MF, w_down_EFD)
        if impl == "ragged_dot":
            return out_MD
        # tokamax's GPU kernels need not write rows past the groups: make them zeros
        filled_M = jnp.arange(x_MD.shape[0]) < group_sizes_E.sum()
        return jnp.where(filled_M[:, None], out_MD, 0)
    m, e = x_MD.shape[0], group_sizes_E.shape[0]
    y = max(1, min(block_rows, m))
    n_blocks = -(-(m + e * (y - 1)) // y)  # static bound on blocks after per-expert padding
    padded_sizes_E = -(-group_sizes_E // y) * y
    start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    padded_end_E = jnp.cumsum(padded_sizes_E)
    expert_M = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(m),
                                            side="right"), e - 1)
    valid_M = jnp.arange(m) < group_sizes_E.sum()
    row_M = padded_end_E[expert_M] - padded_sizes_E[expert_M] + jnp.arange(m) - start_E[expert_M]
    row_M = jnp.where(valid_M, row_M, n_blocks * y)  # out of range: dropped / filled with 0
    block_expert_X = jnp.minimum(
        jnp.searchsorted(padded_end_E, jnp.arange(n_blocks) * y, side="right"), e - 1)

    used_blocks = padded_end_E[-1] // y  # blocks past this hold no row: skipped

    def blocked(rows, w):  # rows [M, in] @ each row's expert's w [E, in, out] → [M, out]
        blocks = jnp.zeros((n_blocks * y, rows.shape[1]), rows.dtype).at[row_M].set(
            rows, mode="drop").reshape(n_blocks, y, -1)

        def block(args):  # a real branch: the static bound is worst-case, the work is not
            n, block_rows = args
            return jax.lax.cond(n < used_blocks, lambda: block_rows @ w[block_expert_X[n]],
                                lambda: jnp.zeros((y, w.shape[-1]), block_rows.dtype))

        # checkpoint: backward re-indexes w instead of saving each block's [in, out] slice
        out_blocks = jax.lax.map(jax.checkpoint(block), (jnp.arange(n_blocks), blocks))
        return out_blocks.reshape(n_blocks * y, -1).at[row_M].get(mode="fill", fill_value=0)

    hidden_MF = nn.silu(blocked(x_MD, w_gate_EDF)) * blocked(x_MD, w_up_EDF)
    return blocked(hidden_MF, w_down_EFD)


def _ragged_matmul(impl: str, group_sizes_E):
    if impl == "ragged_dot":
        return lambda rows, w: jax.lax.ragged_dot(rows, w, group_sizes_E)
    tokamax = kernels.import_tokamax()
    # None: tokamax's own order (Mosaic GPU on Hopper, then Triton, then XLA)
    implementation = ("triton", "xla") if impl == "tokamax_triton" else None
    return lambda rows, w: tokamax.ragged_dot(rows, w, group_sizes_E,
                                              implementation=implementation)


def compute_local_experts(x_RD, experts_RU, weights_RU, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                          impl: str):
    """Σ_k weight·expert_k(row) for rows whose choices index *these* experts (−1 = none).

    Shared by the single-device path (rows = tokens) and the expert-parallel path (rows =
    what peers sent). Returns the combined rows [R, D] float32 and copies per expert [E].
    """
    r, k = experts_RU.shape
    e = w_gate_EDF.shape[0]
    ids_M = jnp.where(experts_RU >= 0, experts_RU, e).reshape(-1)  # "none" sorts last
    order_M = jnp.argsort(ids_M, stable=True)
    sizes_E = jnp.bincount(ids_M, length=e + 1)[:e].astype(jnp.int32)
    y_sorted_MD = grouped_swiglu(x_RD[order_M // k], w_gate_EDF, w_up_EDF, w_down_EFD, sizes_E,
                                 impl=impl)
    y_sorted_MD = jnp.where((ids_M[order_M] < e)[:, None], y_sorted_MD, 0)
    y_RUD = jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD).reshape(r, k, -1)
    return jnp.einsum("rud,ru->rd", y_RUD.astype(jnp.float32), weights_RU), sizes_E


def dispatch_layout(experts_TU: jax.Array, ep: int, experts_per_device: int, capacity: int):
    """Where each token goes: one row per (token, destination device), not per expert.

    A token routed to several experts on one device is sent there once (group-limited
    routing with one group per device bounds destinations by `topk_group`). Rows land in
    per-destination regions of `capacity` slots in token order; a row whose slot is past
    capacity is dropped (only possible with a capacity factor).
    Returns (dest [T, U], kept [T, J] bool, flat buffer index [T, J]).
    """
    dest_TU = experts_TU // experts_per_device
    sent_TJ = jnp.any(dest_TU[:, :, None] == jnp.arange(ep), axis=1)
    slot_TJ = jnp.cumsum(sent_TJ, axis=0) - 1
    kept_TJ = sent_TJ & (slot_TJ < capacity)
    index_TJ = jnp.where(kept_TJ, jnp.arange(ep) * capacity + slot_TJ, ep * capacity)
    return dest_TU, kept_TJ, index_TJ


def moe_dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD,
                 cfg: ModelConfig):
    """Routed experts with expert parallelism over the mesh's `expert` axis.

    Communication (per MoE layer, J = ep peers on the `expert` axis, C = capacity rows):
      1. all_to_all int32[J]        rows per peer (so receivers know what is valid)
      2. all_to_all x[J, C, D]      token rows, bf16/compute dtype (ragged: filled rows only)
         all_to_all int32[J, C, U]  their local expert ids, float32[J, C, U] gate weights
      3. grouped matmul over this device's E/J experts
      4. all_to_all y[J, C, D]      combined outputs back to the token's device
    With ep = 1 (one device, or no SPMD context) the exchanges are the identity.
    """
    ep = comm.expert_parallelism()
    t, k = experts_TU.shape
    d, e_local = x_TD.shape[1], w_gate_EDF.shape[0]
    capacity = t
    if cfg.moe_capacity_factor is not None:
        capacity = min(t, max(1, math.ceil(cfg.moe_capacity_factor * t * k / ep)))
    dest_TU, kept_TJ, index_TJ = dispatch_layout(experts_TU, ep, e_local, capacity)
    rows = ep * capacity

    def scatter(values, fill):  # [T, J, ...] → [J, C, ...] send buffer
        flat = values.reshape(t * ep, *values.shape[2:])
        buf = jnp.full((rows, *flat.shape[1:]), fill, flat.dtype)
        return buf.at[index_TJ.reshape(-1)].set(flat, mode="drop").reshape(
            ep, capacity, *flat.shape[1:])

    peer_TUJ = dest_TU[:, :, None] == jnp.arange(ep)
    local_TJU = jnp.where(peer_TUJ, experts_TU[:, :, None] % e_local, -1).transpose(0, 2, 1)
    gate_TJU = jnp.where(peer_TUJ, weights_TU[:, :, None], 0.0).transpose(0, 2, 1)
    send_counts_J = kept_TJ.sum(axis=0).astype(jnp.int32)
    recv_counts_J = comm.exchange_counts(send_counts_J)
    wire = comm.exchange_dtype(x_TD.dtype)
    recv_x_JCD = comm.exchange(scatter(jnp.broadcast_to(x_TD.astype(wire)[:, None], (t, ep, d)), 0),
                               send_counts_J, recv_counts_J).astype(x_TD.dtype)
    recv_e_JCU = comm.exchange(scatter(local_TJU, -1), send_counts_J, recv_counts_J)
    recv_w_JCU = comm.exchange(scatter(gate_TJU, 0.0), send_counts_J, recv_counts_J)
    valid_JC = jnp.arange(capacity) < recv_counts_J[:, None]  # ragged leaves the rest stale
    recv_e_JCU = jnp.where(valid_JC[..., None], recv_e_JCU, -1)

    y_RD, sizes_E = compute_local_experts(
        recv_x_JCD.reshape(rows, d), recv_e_JCU.reshape(rows, k), recv_w_JCU.reshape(rows, k),
        w_gate_EDF, w_up_EDF, w_down_EFD, impl=kernels.grouped_matmul_impl(cfg))
    back_JCD = comm.exchange(y_RD.astype(wire).reshape(ep, capacity, d), recv_counts_J,
                             send_counts_J)
    back_TJD = back_JCD.reshape(rows, d).at[index_TJ].get(mode="fill", fill_value=0)
    y_TD = back_TJD.astype(jnp.float32).sum(axis=1)

    stats = {"processed_copies": comm.psum_all(sizes_E.sum()),
             "routed_copies": comm.psum_all(jnp.asarray(t * k, jnp.int32)),
             # rows that leave the device: what the exchange really has to carry, against
             # one row per remote expert copy (no per-device deduplication)
             "exchanged_rows": comm.psum_all(jnp.where(
                 jnp.arange(ep) == comm.expert_index(), 0, send_counts_J).sum()),
             "remote_copies": comm.psum_all((dest_TU != comm.expert_index()).sum())}
    return y_TD, stats


def chunked_dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD,
                     cfg: ModelConfig):
    """`moe_dispatch` over `cfg.moe_chunk_tokens` tokens at a time (all at once for 0).

    Each chunk is dispatched dropless on its own — its exchange buffers, sorted rows and
    grouped-matmul operands sized by the chunk — and is a `jax.checkpoint`, so that the
    backward pass also holds one chunk's buffers at a time instead of every chunk's
    residuals: the layer's peak no longer grows with the sequence. The price is that the
    chunk's forward (exchange and expert matmuls) runs once more in the backward pass.
    Tokens never interact across chunks in a MoE layer, so outputs and gradients are
    those of one dispatch (up to summation order).
    """
    t, k = experts_TU.shape
    chunk = cfg.moe_chunk_tokens
    if not chunk or chunk >= t:
        return moe_dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD,
                            cfg)
    n = t // chunk  # the config checks that the chunk divides the sequence

    @jax.checkpoint
    def one_chunk(w_gate_EDF, w_up_EDF, w_down_EFD, x_YD, weights_YU, experts_YU):
        return moe_dispatch(x_YD, weights_YU, experts_YU, w_gate_EDF, w_up_EDF, w_down_EFD,
                            cfg)

    y_XYD, stats_X = jax.lax.map(
        lambda args: one_chunk(w_gate_EDF, w_up_EDF, w_down_EFD, *args),
        (x_TD.reshape(n, chunk, -1), weights_TU.reshape(n, chunk, k),
         experts_TU.reshape(n, chunk, k)))
    return y_XYD.reshape(t, -1), jax.tree.map(lambda v: v.sum(axis=0), stats_X)


class MoE(nn.Module):
    """Routed experts (dropless by default, expert-parallel under SPMD) plus shared experts."""

    ROLE = "moe"  # used on its own (tests): its parameters' roles start here
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BSD: jax.Array, router_bias_E: jax.Array):
        cfg, dt = self.cfg, x_BSD.dtype
        d, e = cfg.d_model, cfg.n_routed_experts
        w_router_DE = weight(self, "w_router")  # float32 (param_table.ROUTING)
        w_gate_EDF = weight(self, "w_gate")
        w_up_EDF = weight(self, "w_up")
        w_down_EFD = weight(self, "w_down")

        b, s, _ = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d)
        weights_TU, experts_TU = route(x_TD.astype(jnp.float32) @ w_router_DE, router_bias_E, cfg)
        y_TD, stats = chunked_dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF,
                                       w_down_EFD, cfg)
        routed_BSD = checkpoint_name(y_TD.astype(dt).reshape(b, s, d), "moe_out")
        if cfg.n_shared_experts:
            shared_BSD = SwiGLU(cfg, name="shared")(x_BSD)
            routed_BSD = routed_BSD + shared_BSD
        # Loads over the whole global batch: the balancing bias must agree on every device.
        stats["expert_counts_E"] = comm.psum_all(
            jnp.bincount(experts_TU.reshape(-1), length=e).astype(jnp.int32))
        return routed_BSD, stats


def updated_router_bias(bias_LE: jax.Array, counts_LE: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
    counts_LE = counts_LE.astype(jnp.float32)
    mean_L1 = counts_LE.mean(axis=-1, keepdims=True)
    return bias_LE + rate * jnp.sign(mean_L1 - counts_LE)
