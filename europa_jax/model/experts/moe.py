"""DeepSeek-V3 mixture of experts: sigmoid router, group-limited top-k, shared expert.

Shape suffixes: the project's one legend (europa_jax/__init__.py); here T tokens (B·S),
U experts chosen per token (top-k), J peers on the expert axis, X and Y chunks of tokens
and the tokens in one.

The routed experts run where they live: moe_dispatch.py exchanges token rows over the
`expert` axis in bounded rounds; each device's experts run by expert_matmul.py (the
blocked loop on CPU) or expert_windows.py (a library grouped matmul in bounded windows).

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

from europa_jax.config import ConfigError, ExecutionConfig, ModelConfig
from europa_jax.model import kernels
from europa_jax.model.experts.expert_matmul import LocalExperts
from europa_jax.model.experts.expert_windows import Windows
from europa_jax.model.experts.moe_dispatch import dispatch, exchange_capacity, Layout, Rounds
from europa_jax.model.experts.node_dispatch import two_stage_dispatch
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


def sequence_balance(logits_BSE: jax.Array, experts_BSU: jax.Array, tokens_BS: jax.Array):
    """DeepSeek-V3's sequence-wise balance (§2.1.2, eq. 18-20) of each row, before α:

        f_i = N_r / (K_r·T) · Σ_t 1[expert i chosen for token t]
        P_i = 1/T · Σ_t s'_{i,t},   s'_{i,t} = s_{i,t} / Σ_j s_{j,t}   (unbiased sigmoid scores)
        balance = Σ_i f_i·P_i       (1 when perfectly balanced, up to N_r / K_r)

    T is the row's real tokens (`tokens_BS` 1, padding 0). The choice counts are
    constants (an indicator); the gradient reaches the router through P. Returns (the sum
    over rows of their balance, the number of rows with tokens)."""
    b, s, e = logits_BSE.shape
    k = experts_BSU.shape[-1]
    real_BS = tokens_BS.astype(jnp.float32)
    tokens_B = real_BS.sum(axis=-1)
    scores_BSE = jax.nn.sigmoid(logits_BSE.astype(jnp.float32))
    shares_BSE = scores_BSE / scores_BSE.sum(axis=-1, keepdims=True)
    p_BE = (shares_BSE * real_BS[..., None]).sum(axis=1) / jnp.maximum(tokens_B, 1.0)[:, None]
    # choices per row by a scatter-add: [B, S, K, E] one-hots would be GBs at 65,536 × 384
    rows_BSU = jnp.broadcast_to(jnp.arange(b)[:, None, None], experts_BSU.shape)
    chosen_BE = jnp.zeros((b, e), jnp.float32).at[rows_BSU, experts_BSU].add(
        jnp.broadcast_to(real_BS[..., None], experts_BSU.shape))
    f_BE = chosen_BE * e / (k * jnp.maximum(tokens_B, 1.0))[:, None]
    has_tokens_B = tokens_B > 0
    balance_B = jnp.where(has_tokens_B, (f_BE * p_BE).sum(axis=-1), 0.0)
    return balance_B.sum(), has_tokens_B.sum().astype(jnp.float32)


def expert_window_rows(t: int, cfg: ModelConfig, ex: ExecutionConfig, groups: int) -> int:
    """Copies per window of one expert group: `moe_buffer_factor` × the copies a group
    expects (a device receives t·k copies on average, split over its groups)."""
    return max(1, math.ceil(ex.moe_buffer_factor * t * cfg.top_k / groups))


MAX_WINDOW_ROWS = 65536  # auto expert groups: the fewest whose window is at most this


def expert_groups(t: int, cfg: ModelConfig, ex: ExecutionConfig, local_experts: int) -> int:
    if ex.moe_expert_groups:
        return ex.moe_expert_groups
    return next(g for g in range(1, local_experts + 1) if local_experts % g == 0 and (
        expert_window_rows(t, cfg, ex, g) <= MAX_WINDOW_ROWS or g == local_experts))


def local_experts(t: int, cfg: ModelConfig, ex: ExecutionConfig, e_local: int) -> LocalExperts:
    """How this device's experts run for t local tokens (the kernel of the platform)."""
    impl = kernels.grouped_matmul_impl(ex)
    if impl == "blocked":
        return LocalExperts(impl, fp8=ex.fp8_expert_gemms)
    if ex.fp8_expert_gemms != "none":
        raise ConfigError(f"execution.fp8_expert_gemms: {ex.fp8_expert_gemms!r} runs with the "
                          f"`blocked` expert kernel only, not {impl!r}: no FP8 grouped GEMM "
                          "with block scales exists for it (docs/open-questions.md)")
    groups = expert_groups(t, cfg, ex, e_local)
    return LocalExperts(impl, windows=Windows(impl, groups,
                                              expert_window_rows(t, cfg, ex, groups)))


def moe_dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD,
                 cfg: ModelConfig, ex: ExecutionConfig):
    """Routed experts with expert parallelism over the mesh's `expert` axis: the exchange
    rounds of moe_dispatch.py (through each expert's node first with a two-stage
    dispatch, node_dispatch.py), and what they carried (summed over the mesh)."""
    axis, per_node = comm.expert_axis(), comm.two_stage_nodes()
    ep, (t, k), e_local = axis.size, experts_TU.shape, w_gate_EDF.shape[0]
    how = local_experts(t, cfg, ex, e_local)
    with jax.named_scope("expert_matmuls"):  # profiles (benchmarks/profile_breakdown.py)
        if per_node:
            inner = axis.inside_nodes(per_node)
            rounds = Rounds.with_capacity(exchange_capacity(t, cfg, ex, ep, per_node), how, inner)
            y_TD, processed, e_RU, off_node = two_stage_dispatch(
                x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD, rounds, axis,
                per_node)
            rows_J = Layout.rows_per_peer(e_RU, e_local, per_node)
        else:
            rounds = Rounds.of(t, cfg, ex, axis, how)
            y_TD, processed = dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF,
                                       w_down_EFD, rounds)
            rows_J = Layout.rows_per_peer(experts_TU, e_local, ep)
    if rounds.drops:
        rows_J = jnp.minimum(rows_J, rounds.capacity)
    remote = jnp.where(jnp.arange(rows_J.shape[0]) == rounds.axis.index(), 0, rows_J).sum()
    if per_node:  # and the rows that went to other nodes first
        remote = remote + off_node
    stats = {"processed_copies": comm.psum_all(jax.lax.stop_gradient(processed)),
             "routed_copies": comm.psum_all(jnp.asarray(t * k, jnp.int32)),
             # rows that leave the device: what the exchange really has to carry, against
             # one row per remote expert copy (no per-device deduplication)
             "exchanged_rows": comm.psum_all(remote),
             "remote_copies": comm.psum_all((experts_TU // e_local != axis.index()).sum()),
             # exchange rounds past round 0, and dispatches (devices × layers × chunks)
             "overflow_rounds": comm.psum_all(rounds.overflow_rounds(rows_J)),
             "dispatches": comm.psum_all(jnp.asarray(1, jnp.int32))}
    return y_TD, stats


def dispatch_tokens(cfg) -> int:
    """Tokens one device dispatches at once under a run's config (`Config`): its rows'
    tokens in one microbatch (`train.microbatches`) — one row's under `execution.row_loop` —
    or `moe_chunk_tokens` of them."""
    tokens = (cfg.data.global_batch_size * cfg.data.seq_len // cfg.mesh.n_devices
              // cfg.train.microbatches)
    if cfg.execution.row_loop:
        tokens = min(tokens, cfg.data.seq_len)
    chunk = cfg.execution.moe_chunk_tokens
    return min(tokens, chunk) if chunk else tokens


def chunked_dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD,
                     cfg: ModelConfig, ex: ExecutionConfig):
    """`moe_dispatch` over `ex.moe_chunk_tokens` tokens at a time (all at once for 0).

    Each chunk is dispatched on its own — its exchange buffers and expert windows sized
    by the chunk — and is a `jax.checkpoint`, so that the backward pass also holds one
    chunk's buffers at a time: a memory lever for when one dispatch of the whole row does
    not fit. Its costs: the chunk's forward runs once more in the backward pass, and the
    expert weights' gradients are added up chunk by chunk (a read-modify-write of every
    expert matrix per chunk, in the weights' dtype) where one dispatch writes them once.
    Tokens never interact across chunks in a MoE layer, so outputs and gradients are
    those of one dispatch (up to summation order).
    """
    t, k = experts_TU.shape
    chunk = ex.moe_chunk_tokens
    if not chunk or chunk >= t:
        return moe_dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD,
                            cfg, ex)
    n = t // chunk  # the config checks that the chunk divides the sequence

    @jax.checkpoint
    def one_chunk(w_gate_EDF, w_up_EDF, w_down_EFD, x_YD, weights_YU, experts_YU):
        return moe_dispatch(x_YD, weights_YU, experts_YU, w_gate_EDF, w_up_EDF, w_down_EFD,
                            cfg, ex)

    y_XYD, stats_X = jax.lax.map(
        lambda args: one_chunk(w_gate_EDF, w_up_EDF, w_down_EFD, *args),
        (x_TD.reshape(n, chunk, -1), weights_TU.reshape(n, chunk, k),
         experts_TU.reshape(n, chunk, k)))
    return y_XYD.reshape(t, -1), jax.tree.map(lambda v: v.sum(axis=0), stats_X)


class MoE(nn.Module):
    """Routed experts (dropless by default, expert-parallel under SPMD) plus shared experts."""

    ROLE = "moe"  # used on its own (tests): its parameters' roles start here
    cfg: ModelConfig
    ex: ExecutionConfig

    @nn.compact
    def __call__(self, x_BSD: jax.Array, router_bias_E: jax.Array, tokens_BS=None):
        """`tokens_BS` (1 = a real token, 0 = padding) is needed only for the
        sequence-wise balance loss (`model.seq_aux_loss_weight` > 0)."""
        cfg, dt = self.cfg, x_BSD.dtype
        d, e = cfg.d_model, cfg.n_routed_experts
        w_router_DE = weight(self, "w_router")  # float32 (param_table.ROUTING)
        w_gate_EDF = weight(self, "w_gate")
        w_up_EDF = weight(self, "w_up")
        w_down_EFD = weight(self, "w_down")

        b, s, _ = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d)
        logits_TE = x_TD.astype(jnp.float32) @ w_router_DE
        weights_TU, experts_TU = route(logits_TE, router_bias_E, cfg)
        y_TD, stats = chunked_dispatch(x_TD, weights_TU, experts_TU, w_gate_EDF, w_up_EDF,
                                       w_down_EFD, cfg, self.ex)
        routed_BSD = checkpoint_name(y_TD.astype(dt).reshape(b, s, d), "moe_out")
        if cfg.n_shared_experts:
            shared_BSD = SwiGLU(cfg, self.ex, name="shared")(x_BSD)
            routed_BSD = routed_BSD + shared_BSD
        # Loads over the whole global batch: the balancing bias must agree on every device.
        stats["expert_counts_E"] = comm.psum_all(
            jnp.bincount(experts_TU.reshape(-1), length=e).astype(jnp.int32))
        if cfg.seq_aux_loss_weight > 0:  # this device's rows; the loss sums over devices
            stats["seq_balance_sum"], stats["seq_balance_rows"] = sequence_balance(
                logits_TE.reshape(b, s, e), experts_TU.reshape(b, s, -1), tokens_BS)
        return routed_BSD, stats


def updated_router_bias(bias_LE: jax.Array, counts_LE: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
    counts_LE = counts_LE.astype(jnp.float32)
    mean_L1 = counts_LE.mean(axis=-1, keepdims=True)
    return bias_LE + rate * jnp.sign(mean_L1 - counts_LE)
