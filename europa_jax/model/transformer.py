"""The model: embedding, the scan over decoder blocks (block.py), LM head, MTP (mtp.py).

Shape suffixes: the project's legend (europa_jax/__init__.py).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from europa_jax import param_table
from europa_jax.config import ExecutionConfig, ModelConfig
from europa_jax.model import lm_head, mtp, row_loop
from europa_jax.model.block import DecoderBlock, under_policy
from europa_jax.model.layers import RMSNorm, rope_tables, weight
from europa_jax.parallel import comm


class Transformer(nn.Module):
    """Embedding → first `n_dense_layers` dense blocks → MoE blocks → norm → LM head, and
    with `model.mtp_layers` the multi-token prediction modules after it (mtp.py)."""

    ROLE_ROOT = True  # its own parameters' roles are their paths in the model
    cfg: ModelConfig
    ex: ExecutionConfig
    # jax.checkpoint policy naming what backward keeps, offloads or recomputes (offload.py)
    remat_policy: Callable | None = None
    # with execution.row_loop: the policy of a row's trip through a layer (row_loop.py;
    # offload.row_trip_policy); None: recompute it whole under execution.remat: full
    row_trip_policy: Callable | None = None

    @nn.compact
    def __call__(self, tokens_BS, segment_ids_BS, positions_BS, router_bias_LE,
                 targets_BS=None):
        """float32 logits [B, S, V] and per-MoE-layer stats stacked over L; given targets,
        each position's cross entropy [B, S] instead of the logits (lm_head.token_nll:
        `execution.loss_chunk_tokens` positions' logits at a time). The stats also hold
        `attention_logit_max_LH`: every layer's (dense first, then MoE, then MTP) per-head
        largest attention logit on this device's rows.

        With `model.mtp_layers` K > 0 and targets, the MTP modules run too: the stats hold
        their cross entropies `mtp_nll_KBS` (module k's targets are k+1 tokens further,
        mtp.py) and their MoE blocks' stats after the main model's (L = L_moe + K, in the
        order of `router_bias_LE`). Without targets (sampling, evaluation) they are skipped.
        """
        cfg, ex = self.cfg, self.ex
        embedding_VD = weight(self, "embedding")
        x_BSD = embedding_VD[tokens_BS]
        # With context parallelism attention sees the node's rows (comm.AttentionGroup):
        # their positions and segment ids are gathered here once, not in every layer.
        group = comm.attention_group(ex.attention_context_parallel)
        attention_segments_BS = group.gather_rows(segment_ids_BS)
        cos_BSP2, sin_BSP2 = rope_tables(group.gather_rows(positions_BS), cfg)

        real_BS = segment_ids_BS > 0  # this device's own rows: padding is segment 0
        dense_stack, moe_stack, _ = param_table.STACKS
        n_moe = cfg.n_moe_layers
        x_BSD, dense = self._stack(x_BSD, attention_segments_BS, cos_BSP2, sin_BSP2, None,
                                   real_BS, is_moe=False, n=cfg.n_dense_layers,
                                   stack=dense_stack)
        x_BSD, moe = self._stack(x_BSD, attention_segments_BS, cos_BSP2, sin_BSP2,
                                 router_bias_LE[:n_moe], real_BS,
                                 is_moe=True, n=n_moe, stack=moe_stack)
        x_BSD = RMSNorm(cfg, ex, name="final_norm")(x_BSD)
        head_DV = weight(self, "lm_head")
        # the MTP modules' parameters exist whether or not this call trains them
        predict_more = cfg.mtp_layers > 0 and (targets_BS is not None or self.is_initializing())
        extra = {}
        if predict_more:
            mtp_nll_KBS, extra = mtp.mtp_modules(
                cfg, ex, self.remat_policy, x_BSD, tokens_BS, embedding_VD, head_DV,
                router_bias_LE[n_moe:], attention_segments_BS, cos_BSP2, sin_BSP2, real_BS)
        stats = {key: jnp.concatenate([value] + ([extra[key]] if extra else []))
                 for key, value in moe.items() if key != "attention_logit_max_H"}
        stats["attention_logit_max_LH"] = jnp.concatenate(
            [part["attention_logit_max_H"] for part in (dense, moe, extra) if part])
        if predict_more:
            stats["mtp_nll_KBS"] = mtp_nll_KBS
        if targets_BS is None:
            return lm_head.logits(x_BSD, head_DV, cfg.vocab_size), stats
        return lm_head.token_nll(x_BSD, head_DV, targets_BS, cfg.vocab_size,
                                 ex.loss_chunk_tokens), stats

    def _stack(self, x_BSD, segment_ids_BS, cos_BSP2, sin_BSP2, router_bias_LE, tokens_BS, *,
               is_moe, n, stack):
        """`n` blocks, scanned (stacked params, compile time independent of depth) or unrolled."""
        if n == 0:
            return x_BSD, {}
        block_cls = DecoderBlock
        if self.ex.row_loop:
            trip = self.row_trip_policy
            if trip is None and self.ex.remat == "full":
                trip = jax.checkpoint_policies.nothing_saveable
            block_cls = row_loop.row_looped_block(self.cfg, self.ex, trip, stack)
        block_cls = under_policy(block_cls, self.ex, self.remat_policy)
        bias_axis = 0 if is_moe else nn.broadcast
        if self.ex.scan_layers:
            scanned = nn.scan(block_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                              in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, bias_axis,
                                       nn.broadcast),
                              length=n)
            return scanned(self.cfg, self.ex, is_moe, name=stack)(x_BSD, segment_ids_BS, cos_BSP2,
                                                         sin_BSP2, router_bias_LE, tokens_BS)
        per_layer = []
        for i in range(n):
            bias_E = router_bias_LE[i] if is_moe else None
            name, _ = param_table.stack_key(stack, i, scanned=False)
            x_BSD, stats = block_cls(self.cfg, self.ex, is_moe, name=name)(
                x_BSD, segment_ids_BS, cos_BSP2, sin_BSP2, bias_E, tokens_BS)
            per_layer.append(stats)
        return x_BSD, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def init_router_bias(cfg: ModelConfig) -> jax.Array:
    """Aux-loss-free balancing bias [L_moe + K, E] (the MoE layers, then the MTP modules'
    blocks); state, not a parameter (no gradient)."""
    return jnp.zeros(param_table.ROUTER_BIAS.shape(cfg), jnp.float32)
