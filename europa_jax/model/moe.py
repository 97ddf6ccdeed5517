"""DeepSeek-V3 mixture of experts: sigmoid router, group-limited top-k, shared expert.

Shape legend: B batch, S sequence, T tokens (B·S), D model width, E routed experts,
G expert groups, F expert ffn width, K experts chosen per token (top-k), M = T·K token copies.

Routing (DeepSeek-V3 §2.1.2, arXiv:2412.19437): scores = sigmoid(x·W_router). A per-expert
bias, updated outside the gradient (aux-loss-free balancing), is added to the scores only
to *select* experts; the gate weights come from the unbiased scores. With group-limited
routing a token first picks `topk_group` of `n_group` groups (group score = sum of its
two best biased scores), then its top-k experts inside those groups.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from europa_jax.config import ModelConfig
from europa_jax.model.layers import SwiGLU, weight


def route(logits_TE: jax.Array, bias_E: jax.Array, cfg: ModelConfig):
    """Return (gate weights [T, K] float32, chosen experts [T, K] int32)."""
    scores_TE = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
    choice_TE = scores_TE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    t, e = choice_TE.shape
    if cfg.n_group > 1:
        choice_TGE = choice_TE.reshape(t, cfg.n_group, e // cfg.n_group)
        group_score_TG = jax.lax.top_k(choice_TGE, 2)[0].sum(axis=-1)
        _, groups_TK = jax.lax.top_k(group_score_TG, cfg.topk_group)
        keep_TG = jax.nn.one_hot(groups_TK, cfg.n_group, dtype=jnp.bool_).any(axis=1)
        choice_TE = jnp.where(keep_TG[:, :, None], choice_TGE, -jnp.inf).reshape(t, e)
    _, experts_TK = jax.lax.top_k(choice_TE, cfg.top_k)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if cfg.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(axis=-1, keepdims=True) + 1e-20)
    return weights_TK * cfg.routed_scaling_factor, experts_TK.astype(jnp.int32)


def sort_by_expert(experts_TK: jax.Array, n_experts: int):
    """Order token copies by expert: (order [M], token of each sorted copy [M], sizes [E])."""
    experts_M = experts_TK.reshape(-1)
    order_M = jnp.argsort(experts_M, stable=True)
    token_M = order_M // experts_TK.shape[1]
    group_sizes_E = jnp.bincount(experts_M, length=n_experts).astype(jnp.int32)
    return order_M, token_M, group_sizes_E


def grouped_swiglu(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E, *, impl: str,
                   block_rows: int = 256):
    """SwiGLU per expert on rows already sorted by expert, dropless.

    `ragged_dot`: one grouped matmul per weight (the GPU/TPU kernel). XLA:CPU lowers
    ragged_dot to a dense masked matmul over *all* experts (E× the FLOPs), so on CPU we
    use `blocked`: each expert's rows are padded to a multiple of `block_rows`, every block
    then belongs to one expert and is multiplied by that expert's matrix. Exact, dropless,
    at most E·(block_rows−1) padding rows of extra work.
    """
    if impl == "ragged_dot":
        gate_MF = jax.lax.ragged_dot(x_MD, w_gate_EDF, group_sizes_E)
        up_MF = jax.lax.ragged_dot(x_MD, w_up_EDF, group_sizes_E)
        return jax.lax.ragged_dot(nn.silu(gate_MF) * up_MF, w_down_EFD, group_sizes_E)
    m, e = x_MD.shape[0], group_sizes_E.shape[0]
    y = max(1, min(block_rows, m))
    n_blocks = -(-(m + e * (y - 1)) // y)  # static bound on blocks after per-expert padding
    padded_sizes_E = -(-group_sizes_E // y) * y
    start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    padded_end_E = jnp.cumsum(padded_sizes_E)
    expert_M = jnp.repeat(jnp.arange(e), group_sizes_E, total_repeat_length=m)
    row_M = padded_end_E[expert_M] - padded_sizes_E[expert_M] + jnp.arange(m) - start_E[expert_M]
    block_expert_N = jnp.minimum(
        jnp.searchsorted(padded_end_E, jnp.arange(n_blocks) * y, side="right"), e - 1)

    def blocked(rows_MI, w_EIO):
        rows_NYI = jnp.zeros((n_blocks * y, rows_MI.shape[1]), rows_MI.dtype).at[row_M].set(
            rows_MI).reshape(n_blocks, y, -1)
        out_NYO = jnp.einsum("nyi,nio->nyo", rows_NYI, w_EIO[block_expert_N])
        return out_NYO.reshape(n_blocks * y, -1)[row_M]

    hidden_MF = nn.silu(blocked(x_MD, w_gate_EDF)) * blocked(x_MD, w_up_EDF)
    return blocked(hidden_MF, w_down_EFD)


def combine(y_sorted_MD, order_M, weights_TK):
    """Undo the sort and sum each token's K expert outputs with its gate weights."""
    t, k = weights_TK.shape
    y_MD = jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD)
    y_TKD = y_MD.reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK)


def grouped_matmul_impl(cfg: ModelConfig) -> str:
    if cfg.grouped_matmul != "auto":
        return cfg.grouped_matmul
    return "blocked" if jax.default_backend() == "cpu" else "ragged_dot"


class MoE(nn.Module):
    """Routed experts (dropless, single-program grouped matmul) plus shared experts."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BSD: jax.Array, router_bias_E: jax.Array):
        cfg, dt = self.cfg, x_BSD.dtype
        d, e, f = cfg.d_model, cfg.n_routed_experts, cfg.expert_ffn_dim
        w_router_DE = weight(self, "w_router", (d, e), ("embed", "router"), cfg)
        w_gate_EDF = weight(self, "w_gate", (e, d, f), ("experts", "expert_embed", "expert_mlp"), cfg)
        w_up_EDF = weight(self, "w_up", (e, d, f), ("experts", "expert_embed", "expert_mlp"), cfg)
        w_down_EFD = weight(self, "w_down", (e, f, d), ("experts", "expert_mlp", "expert_embed"), cfg)

        b, s, _ = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d)
        # Router in float32: near-tied sigmoid scores decide discrete choices.
        logits_TE = x_TD.astype(jnp.float32) @ w_router_DE.astype(jnp.float32)
        weights_TK, experts_TK = route(logits_TE, router_bias_E, cfg)

        order_M, token_M, group_sizes_E = sort_by_expert(experts_TK, e)
        y_sorted_MD = grouped_swiglu(x_TD[token_M], w_gate_EDF.astype(dt), w_up_EDF.astype(dt),
                                     w_down_EFD.astype(dt), group_sizes_E,
                                     impl=grouped_matmul_impl(cfg))
        y_TD = combine(y_sorted_MD, order_M, weights_TK).astype(dt)
        routed_BSD = checkpoint_name(y_TD.reshape(b, s, d), "moe_out")

        if cfg.n_shared_experts:
            shared_BSD = SwiGLU(cfg, cfg.n_shared_experts * f, name="shared")(x_BSD)
            routed_BSD = routed_BSD + shared_BSD
        # Copies the grouped matmul processed; with capacity limits this would fall short
        # of T·K, and train.py reports the gap as moe_dropped_fraction.
        stats = {"expert_counts_E": group_sizes_E, "processed_copies": group_sizes_E.sum(),
                 "routed_copies": jnp.asarray(experts_TK.size, jnp.int32)}
        return routed_BSD, stats


def updated_router_bias(bias_LE: jax.Array, counts_LE: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
    counts_LE = counts_LE.astype(jnp.float32)
    mean_L1 = counts_LE.mean(axis=-1, keepdims=True)
    return bias_LE + rate * jnp.sign(mean_L1 - counts_LE)
