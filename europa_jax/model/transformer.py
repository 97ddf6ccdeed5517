"""Decoder blocks, the scan over layers, embedding and LM head.

Shape suffixes: the project's legend (europa_jax/__init__.py).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from europa_jax import param_table
from europa_jax.config import ModelConfig
from europa_jax.model import lm_head
from europa_jax.model.attention import MLAttention
from europa_jax.model.layers import RMSNorm, rope_tables, SwiGLU, weight
from europa_jax.model.moe import MoE
from europa_jax.parallel import comm


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + MLP or MoE (norm(·)).

    Returns the new residual stream and the layer's stats: each head's largest attention
    logit on this device (`attention_logit_max_H`, for QK-clip) and, in MoE blocks, the
    MoE's counts (moe.py).
    """

    ROLE_ROOT = True  # parameter roles are paths inside a block (param_table.py)
    cfg: ModelConfig
    is_moe: bool

    @nn.compact
    def __call__(self, x_BSD, segment_ids_BS, cos_BSP2, sin_BSP2, router_bias_E, tokens_BS):
        """`segment_ids_BS` are attention's (the node's rows under context parallelism);
        `tokens_BS` marks this device's own real tokens (the MoE's sequence balance)."""
        cfg = self.cfg
        x_BSD = checkpoint_name(x_BSD, "layer_input")
        attn_BSD, logit_max_H = MLAttention(cfg, report_logit_max=True, name="attention")(
            RMSNorm(cfg, name="attention_norm")(x_BSD), segment_ids_BS,
            cos_BSP2, sin_BSP2)
        h_BSD = x_BSD + attn_BSD
        mlp_in_BSD = RMSNorm(cfg, name="mlp_norm")(h_BSD)
        if self.is_moe:
            mlp_out_BSD, stats = MoE(cfg, name="moe")(mlp_in_BSD, router_bias_E, tokens_BS)
        else:
            mlp_out_BSD, stats = SwiGLU(cfg, name="mlp")(mlp_in_BSD), {}
        return h_BSD + mlp_out_BSD, {**stats, "attention_logit_max_H": logit_max_H}


def _block_class(cfg: ModelConfig, policy: Callable | None):
    """The block under the activation policy: offload.py's if given, else model.remat."""
    if policy is None and cfg.remat == "full":  # recompute all; keep only block inputs
        policy = jax.checkpoint_policies.nothing_saveable
    if policy is None:
        return DecoderBlock
    return nn.remat(DecoderBlock, policy=policy, prevent_cse=not cfg.scan_layers)


class Transformer(nn.Module):
    """Embedding → first `n_dense_layers` dense blocks → MoE blocks → norm → LM head."""

    ROLE_ROOT = True  # its own parameters' roles are their paths in the model
    cfg: ModelConfig
    # jax.checkpoint policy naming what backward keeps, offloads or recomputes (offload.py)
    remat_policy: Callable | None = None

    @nn.compact
    def __call__(self, tokens_BS, segment_ids_BS, positions_BS, router_bias_LE,
                 targets_BS=None):
        """float32 logits [B, S, V] and per-MoE-layer stats stacked over L; given targets,
        each position's cross entropy [B, S] instead of the logits (lm_head.token_nll:
        `model.loss_chunk_tokens` positions' logits at a time). The stats also hold
        `attention_logit_max_LH`: every layer's (dense first, then MoE) per-head largest
        attention logit on this device's rows."""
        cfg = self.cfg
        embedding_VD = weight(self, "embedding")
        x_BSD = embedding_VD[tokens_BS]
        # With context parallelism attention sees the node's rows (comm.AttentionGroup):
        # their positions and segment ids are gathered here once, not in every layer.
        group = comm.attention_group(cfg.attention_context_parallel)
        attention_segments_BS = group.gather_rows(segment_ids_BS)
        cos_BSP2, sin_BSP2 = rope_tables(group.gather_rows(positions_BS), cfg)

        tokens_BS = segment_ids_BS > 0  # this device's own rows: padding is segment 0
        dense_stack, moe_stack = param_table.STACKS
        x_BSD, dense = self._stack(x_BSD, attention_segments_BS, cos_BSP2, sin_BSP2, None,
                                   tokens_BS, is_moe=False, n=cfg.n_dense_layers,
                                   stack=dense_stack)
        x_BSD, moe = self._stack(x_BSD, attention_segments_BS, cos_BSP2, sin_BSP2,
                                 router_bias_LE, tokens_BS,
                                 is_moe=True, n=cfg.n_moe_layers, stack=moe_stack)
        stats = {key: value for key, value in moe.items() if key != "attention_logit_max_H"}
        stats["attention_logit_max_LH"] = jnp.concatenate(
            [part["attention_logit_max_H"] for part in (dense, moe) if part])

        x_BSD = RMSNorm(cfg, name="final_norm")(x_BSD)
        head_DV = weight(self, "lm_head")
        if targets_BS is None:
            return lm_head.logits(x_BSD, head_DV, cfg.vocab_size), stats
        return lm_head.token_nll(x_BSD, head_DV, targets_BS, cfg.vocab_size,
                                 cfg.loss_chunk_tokens), stats

    def _stack(self, x_BSD, segment_ids_BS, cos_BSP2, sin_BSP2, router_bias_LE, tokens_BS, *,
               is_moe, n, stack):
        """`n` blocks, scanned (stacked params, compile time independent of depth) or unrolled."""
        if n == 0:
            return x_BSD, {}
        block_cls = _block_class(self.cfg, self.remat_policy)
        bias_axis = 0 if is_moe else nn.broadcast
        if self.cfg.scan_layers:
            scanned = nn.scan(block_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                              in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, bias_axis,
                                       nn.broadcast),
                              length=n)
            return scanned(self.cfg, is_moe, name=stack)(x_BSD, segment_ids_BS, cos_BSP2,
                                                         sin_BSP2, router_bias_LE, tokens_BS)
        per_layer = []
        for i in range(n):
            bias_E = router_bias_LE[i] if is_moe else None
            name, _ = param_table.stack_key(stack, i, scanned=False)
            x_BSD, stats = block_cls(self.cfg, is_moe, name=name)(
                x_BSD, segment_ids_BS, cos_BSP2, sin_BSP2, bias_E, tokens_BS)
            per_layer.append(stats)
        return x_BSD, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def init_router_bias(cfg: ModelConfig) -> jax.Array:
    """Aux-loss-free balancing bias [L_moe, E]; state, not a parameter (no gradient)."""
    return jnp.zeros(param_table.ROUTER_BIAS.shape(cfg), jnp.float32)
