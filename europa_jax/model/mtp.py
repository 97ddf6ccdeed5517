"""Multi-token prediction (DeepSeek-V3 §2.2): `model.mtp_layers` sequential modules.

Module k (1 … K) at position i predicts token t_{i+k+1}:

    h^k_i = block_k( eh_proj_k · [enorm_k(Emb(t_{i+k})) ; hnorm_k(h^{k-1}_i)] )
    P^k_i = softmax( head_norm_k(h^k_i) · lm_head )

with h^0 the main model's final-normed states, `block_k` a MoE decoder block (the same
layers and roles as the main model's, block.py) and the embedding and LM head the main
model's own (shared, as in the paper). The concatenation order, embedding first, and the
final-normed h^0 are those of DeepSeek-V3's released module as vLLM's `deepseek_mtp` runs
it for speculative decoding, so an export (`model.layers.{n_layers}.*`,
interop/hf_layout.py) serves as a draft model unchanged.

Module k's targets are the tokens k+1 ahead in the same row; a position counts only
where that token is in its own document (train/objective.py target_weights, shift k+1). The
inputs t_{i+k} that cross into the next document belong only to positions whose targets
do not count, and causal, document-masked attention never shows them to one that does.

Shape suffixes: the project's legend (europa_jax/__init__.py); K the MTP modules, J the
concatenated width 2·D.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

from europa_jax import param_table
from europa_jax.config import ExecutionConfig, ModelConfig
from europa_jax.model.fp8 import fp8_linear
from europa_jax.model import lm_head
from europa_jax.model.block import block_layers, under_policy
from europa_jax.model.layers import RMSNorm, weight


class MTPBlock(nn.Module):
    """One MTP module: the projection of [embedding; state], a MoE block, its own head norm.

    Returns its block's output (the next module's h^{k-1}) and (each position's cross
    entropy against its target [B, S], the block's stats)."""

    ROLE_ROOT = True  # roles are paths inside the module, as in a decoder block
    cfg: ModelConfig
    ex: ExecutionConfig

    @nn.compact
    def __call__(self, h_BSD, next_tokens_BS, targets_BS, router_bias_E, embedding_VD,
                 head_DV, segment_ids_BS, cos_BSP2, sin_BSP2, tokens_BS):
        cfg, ex = self.cfg, self.ex
        joined_BSJ = jnp.concatenate([RMSNorm(cfg, ex, name="enorm")(embedding_VD[next_tokens_BS]),
                                      RMSNorm(cfg, ex, name="hnorm")(h_BSD)], axis=-1)
        x_BSD = fp8_linear.einsum("bsj,jd->bsd", joined_BSJ, weight(self, "eh_proj"),
                                  ex.fp8_gemms)
        x_BSD, stats = block_layers(cfg, ex, True, x_BSD, segment_ids_BS, cos_BSP2, sin_BSP2,
                                    router_bias_E, tokens_BS)
        nll_BS = lm_head.token_nll(RMSNorm(cfg, ex, name="head_norm")(x_BSD), head_DV, targets_BS,
                                   cfg.vocab_size, ex.loss_chunk_tokens)
        return x_BSD, (nll_BS, stats)


def shifted_tokens(tokens_BS, k: int):
    """[K+1, B, S]: the row's tokens shifted left by 1 … K+1 (module k's inputs are shift
    k, its targets shift k+1); what wraps around the row's end never counts."""
    return jnp.stack([jnp.roll(tokens_BS, -shift, axis=1) for shift in range(1, k + 2)])


def mtp_modules(cfg: ModelConfig, ex: ExecutionConfig, policy: Callable | None, h_BSD,
                tokens_BS, embedding_VD, head_DV, router_bias_KE, segment_ids_BS, cos_BSP2,
                sin_BSP2, real_BS):
    """The K modules in sequence, created in the calling module (the model): each
    position's cross entropy per module [K, B, S] and the blocks' stats stacked over K.

    Scanned (`execution.scan_layers`: one stacked `mtp_layers` parameter tree) or unrolled
    (`mtp_layers_<k>`), under the same activation policy as the decoder blocks."""
    k = cfg.mtp_layers
    shifted_XBS = shifted_tokens(tokens_BS, k)
    next_KBS, targets_KBS = shifted_XBS[:-1], shifted_XBS[1:]
    stack = param_table.STACKS[-1]
    block_cls = under_policy(MTPBlock, ex, policy)
    if ex.scan_layers:
        scanned = nn.scan(block_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=(0, 0, 0) + (nn.broadcast,) * 6, length=k)
        _, (nll_KBS, stats) = scanned(cfg, ex, name=stack)(
            h_BSD, next_KBS, targets_KBS, router_bias_KE, embedding_VD, head_DV,
            segment_ids_BS, cos_BSP2, sin_BSP2, real_BS)
        return nll_KBS, stats
    nll, per_module = [], []
    for i in range(k):
        name, _ = param_table.stack_key(stack, i, scanned=False)
        h_BSD, (nll_BS, stats) = block_cls(cfg, ex, name=name)(
            h_BSD, next_KBS[i], targets_KBS[i], router_bias_KE[i], embedding_VD, head_DV,
            segment_ids_BS, cos_BSP2, sin_BSP2, real_BS)
        nll.append(nll_BS)
        per_module.append(stats)
    return jnp.stack(nll), {key: jnp.stack([s[key] for s in per_module]) for key in per_module[0]}
