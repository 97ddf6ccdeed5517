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
from europa_jax.model.expert_matmul import compute_local_experts
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

    # each slot of the [J, C] send buffer: which (token, peer) fills it (t·ep: none), so
    # the buffers are gathered from the tokens — no [T, J, D] copy of them is ever made
    source_S = jnp.full(rows, t * ep, jnp.int32).at[index_TJ.reshape(-1)].set(
        jnp.arange(t * ep, dtype=jnp.int32), mode="drop")

    def send_buffer(values, fill):  # [T·J, ...] per (token, peer) → [J, C, ...]
        return values.at[source_S].get(mode="fill", fill_value=fill).reshape(
            ep, capacity, *values.shape[1:])

    peer_TUJ = dest_TU[:, :, None] == jnp.arange(ep)
    local_TJU = jnp.where(peer_TUJ, experts_TU[:, :, None] % e_local, -1).transpose(0, 2, 1)
    gate_TJU = jnp.where(peer_TUJ, weights_TU[:, :, None], 0.0).transpose(0, 2, 1)
    send_counts_J = kept_TJ.sum(axis=0).astype(jnp.int32)
    recv_counts_J = comm.exchange_counts(send_counts_J)
    wire = comm.exchange_dtype(x_TD.dtype)
    send_x_JCD = x_TD.astype(wire).at[source_S // ep].get(mode="fill", fill_value=0).reshape(
        ep, capacity, d)
    recv_x_JCD = comm.exchange(send_x_JCD, send_counts_J, recv_counts_J).astype(x_TD.dtype)
    recv_e_JCU = comm.exchange(send_buffer(local_TJU.reshape(t * ep, k), -1), send_counts_J,
                               recv_counts_J)
    recv_w_JCU = comm.exchange(send_buffer(gate_TJU.reshape(t * ep, k), 0.0), send_counts_J,
                               recv_counts_J)
    valid_JC = jnp.arange(capacity) < recv_counts_J[:, None]  # ragged leaves the rest stale
    recv_e_JCU = jnp.where(valid_JC[..., None], recv_e_JCU, -1)

    with jax.named_scope("expert_matmuls"):  # profiles (benchmarks/profile_breakdown.py)
        y_RD, sizes_E = compute_local_experts(
            recv_x_JCD.reshape(rows, d), recv_e_JCU.reshape(rows, k),
            recv_w_JCU.reshape(rows, k), w_gate_EDF, w_up_EDF, w_down_EFD,
            impl=kernels.grouped_matmul_impl(cfg))
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
