"""The model's forward one new token at a time, with multi-head latent attention's cache.

What MLA caches (DeepSeek-V2 §2.1, arXiv:2405.04434): per layer and position, the
normalized kv latent (A values) and the RoPE'd shared key (P values) — 576 numbers per
token and layer at DeepSeek-V3's shapes, not the 2·H·K of the heads' keys and values.
A new token's queries meet the cached latents through the key up-projection folded into
them ("absorbed": q_nope · w_kv_bᵀ, [H, A]), and the attended latents go through the value
up-projection once per token, so nothing is up-projected per cached position.

Everything else in a block is position-wise, so a step runs the training model's own
modules (RMSNorm, MoE, SwiGLU, the LM head) under the same parameter names: the decoder
reads a training checkpoint's parameter tree as it is. The first call takes the whole
prompt at once (its positions attend causally among themselves), each later call one
token. `tests/test_decode.py` checks every step's logits against the uncached forward
(model/transformer.py) and greedy text against uncached sampling.

Outside the SPMD step only (sampling, interop/sample.py): one device, no gathers.

Shape suffixes: the project's legend (europa_jax/__init__.py); T new positions, S the
cache's positions.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from europa_jax import param_table
from europa_jax.config import ExecutionConfig, ModelConfig
from europa_jax.model import layer_input, lm_head
from europa_jax.model.attention import logit_scale
from europa_jax.model.layers import RMSNorm, SwiGLU, apply_rope, rope_tables, weight
from europa_jax.model.experts.moe import MoE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
    """Every layer's cached latents [L, B, S, A] and RoPE'd keys [L, B, S, P], dense layers
    first; `length` positions of them are filled."""

    latent_LBSA: jax.Array
    k_rope_LBSP: jax.Array
    length: jax.Array  # int32 scalar

    @staticmethod
    def empty(cfg: ModelConfig, rows: int, positions: int, dtype) -> "LatentCache":
        n = cfg.n_dense_layers + cfg.n_moe_layers
        return LatentCache(jnp.zeros((n, rows, positions, cfg.kv_lora_rank), dtype),
                           jnp.zeros((n, rows, positions, cfg.qk_rope_head_dim), dtype),
                           jnp.zeros((), jnp.int32))


class CachedAttention(nn.Module):
    """MLAttention's parameters (same names, model/attention.py) applied to new positions
    against the cache; returns the output and the layer's updated cache."""

    ROLE = "attention"
    cfg: ModelConfig
    ex: ExecutionConfig

    @nn.compact
    def __call__(self, x_BTD, cos_BTP2, sin_BTP2, latent_BSA, k_rope_BSP, start):
        cfg = self.cfg
        a, n = cfg.kv_lora_rank, cfg.qk_nope_head_dim
        w_q_a_DQ = weight(self, "w_q_a")
        w_q_b_QHK = weight(self, "w_q_b")
        w_kv_a_DA = weight(self, "w_kv_a")
        w_kv_b_AHK = weight(self, "w_kv_b")
        w_o_HOD = weight(self, "w_o")

        q_latent_BTQ = RMSNorm(cfg, self.ex, name="q_a_norm")(x_BTD @ w_q_a_DQ)
        q_BTHK = jnp.einsum("btq,qhk->bthk", q_latent_BTQ, w_q_b_QHK)
        q_rope_BTHP = apply_rope(q_BTHK[..., n:], cos_BTP2, sin_BTP2)
        kv_a_BTA = x_BTD @ w_kv_a_DA
        latent_BTA = RMSNorm(cfg, self.ex, name="kv_a_norm")(kv_a_BTA[..., :a])
        k_rope_BTP = apply_rope(kv_a_BTA[..., None, a:], cos_BTP2, sin_BTP2)[:, :, 0]

        latent_BSA = jax.lax.dynamic_update_slice_in_dim(
            latent_BSA, latent_BTA.astype(latent_BSA.dtype), start, axis=1)
        k_rope_BSP = jax.lax.dynamic_update_slice_in_dim(
            k_rope_BSP, k_rope_BTP.astype(k_rope_BSP.dtype), start, axis=1)

        # the key up-projection folded into the queries: q_nope · w_k = (q_nope · w_kᵀ) · latent
        w_k_AHN, w_v_AHO = w_kv_b_AHK[..., :n], w_kv_b_AHK[..., n:]
        scale = logit_scale(cfg)
        q_absorbed_BTHA = jnp.einsum("bthn,ahn->btha", q_BTHK[..., :n] * scale, w_k_AHN)
        s_BHTS = (jnp.einsum("btha,bsa->bhts", q_absorbed_BTHA, latent_BSA,
                             preferred_element_type=jnp.float32)
                  + jnp.einsum("bthp,bsp->bhts", q_rope_BTHP * scale, k_rope_BSP,
                               preferred_element_type=jnp.float32))
        t, s = x_BTD.shape[1], latent_BSA.shape[1]
        visible_TS = (start + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :]
        p_BHTS = jax.nn.softmax(jnp.where(visible_TS, s_BHTS, -jnp.inf), axis=-1)
        out_latent_BTHA = jnp.einsum("bhts,bsa->btha", p_BHTS.astype(latent_BSA.dtype),
                                     latent_BSA, preferred_element_type=jnp.float32)
        out_BTHO = jnp.einsum("btha,aho->btho", out_latent_BTHA.astype(x_BTD.dtype), w_v_AHO)
        return jnp.einsum("btho,hod->btd", out_BTHO, w_o_HOD), latent_BSA, k_rope_BSP


class CachedBlock(nn.Module):
    """A decoder block (model/block.py's `block_layers`, same names) with cached attention."""

    ROLE_ROOT = True
    cfg: ModelConfig
    ex: ExecutionConfig
    is_moe: bool

    @nn.compact
    def __call__(self, x_BTD, cos_BTP2, sin_BTP2, start, latent_BSA, k_rope_BSP, router_bias_E):
        cfg, ex = self.cfg, self.ex
        x_BTD, branch_in_BTD = layer_input.for_branches(ex, x_BTD)  # as the model trained
        attn_BTD, latent_BSA, k_rope_BSP = CachedAttention(cfg, ex, name="attention")(
            RMSNorm(cfg, ex, name="attention_norm")(branch_in_BTD), cos_BTP2, sin_BTP2, latent_BSA,
            k_rope_BSP, start)
        h_branch_BTD, h_BTD = layer_input.after_attention(x_BTD, branch_in_BTD, attn_BTD)
        mlp_in_BTD = RMSNorm(cfg, ex, name="mlp_norm")(h_branch_BTD)
        if self.is_moe:
            mlp_out_BTD, _ = MoE(cfg, ex, name="moe")(mlp_in_BTD, router_bias_E)
        else:
            mlp_out_BTD = SwiGLU(cfg, ex, name="mlp")(mlp_in_BTD)
        return h_BTD + mlp_out_BTD, (latent_BSA, k_rope_BSP)


class CachedTransformer(nn.Module):
    """The Transformer's parameters (model/transformer.py, MTP modules unused) run on new
    positions: float32 logits of the last one [B, V] and the updated cache."""

    ROLE_ROOT = True
    cfg: ModelConfig
    ex: ExecutionConfig

    @nn.compact
    def __call__(self, tokens_BT, cache: LatentCache, router_bias_LE):
        cfg = self.cfg
        start = cache.length
        embedding_VD = weight(self, "embedding")
        x_BTD = embedding_VD[tokens_BT]
        positions_BT = start + jnp.arange(tokens_BT.shape[1], dtype=jnp.int32)[None]
        cos_BTP2, sin_BTP2 = rope_tables(positions_BT, cfg)
        n_dense, n_moe = cfg.n_dense_layers, cfg.n_moe_layers
        dense_stack, moe_stack, _ = param_table.STACKS
        latents, keys = [], []
        for stack, is_moe, layers, bias_LE in (
                (dense_stack, False, slice(0, n_dense), None),
                (moe_stack, True, slice(n_dense, n_dense + n_moe), router_bias_LE[:n_moe])):
            if layers.stop == layers.start:
                continue
            x_BTD, (latent_LBSA, k_rope_LBSP) = self._stack(
                stack, is_moe, x_BTD, cos_BTP2, sin_BTP2, start,
                cache.latent_LBSA[layers], cache.k_rope_LBSP[layers], bias_LE)
            latents.append(latent_LBSA)
            keys.append(k_rope_LBSP)
        x_BD = RMSNorm(cfg, self.ex, name="final_norm")(x_BTD[:, -1])
        logits_BV = lm_head.logits(x_BD[:, None], weight(self, "lm_head"), cfg.vocab_size)[:, 0]
        return logits_BV, LatentCache(jnp.concatenate(latents), jnp.concatenate(keys),
                                      start + tokens_BT.shape[1])

    def _stack(self, stack, is_moe, x_BTD, cos_BTP2, sin_BTP2, start, latent_LBSA,
               k_rope_LBSP, bias_LE):
        n = latent_LBSA.shape[0]
        if self.ex.scan_layers:
            scanned = nn.scan(CachedBlock, variable_axes={"params": 0},
                              split_rngs={"params": True},
                              in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0, 0,
                                       0 if is_moe else nn.broadcast), length=n)
            return scanned(self.cfg, self.ex, is_moe, name=stack)(x_BTD, cos_BTP2, sin_BTP2, start,
                                                         latent_LBSA, k_rope_LBSP, bias_LE)
        per_layer = []
        for i in range(n):
            name, _ = param_table.stack_key(stack, i, scanned=False)
            x_BTD, cache_i = CachedBlock(self.cfg, self.ex, is_moe, name=name)(
                x_BTD, cos_BTP2, sin_BTP2, start, latent_LBSA[i], k_rope_LBSP[i],
                bias_LE[i] if is_moe else None)
            per_layer.append(cache_i)
        return x_BTD, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
