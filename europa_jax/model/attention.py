"""Multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434) and blockwise attention.

Shape suffixes (the project's legend, europa_jax/__init__.py): S positions, queries and
keys alike; Q q latent width, A kv latent width; N no-RoPE, P RoPE and K = N + P q/k head
dims, O value head dims; X blocks of the sequence, Y positions in one.

Every kernel can also report each head's largest pre-softmax logit (scale · q·k over the
visible, non-padding pairs) for QK-clip (qk_clip.py): the blockwise kernel's running max,
tokamax's softmax residual — both already computed, so the report costs no FLOPs.

With `execution.attention_context_parallel` the node's GPUs share the attention of the node's
rows, each for its slice of the heads (parallel/comm.py AttentionGroup): the layer's
projections and output stay on this device's rows, the kernels run on the node's.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from europa_jax.config import ExecutionConfig, ModelConfig
from europa_jax.model import flash_backward, kernels
from europa_jax.model.fp8 import fp8_linear
from europa_jax.model.layers import apply_rope, RMSNorm, weight, yarn_mscale
from europa_jax.parallel import comm


class MLAttention(nn.Module):
    """Low-rank q and kv projections; a decoupled RoPE key shared by all heads.

    With `report_logit_max` the layer returns `(out, logit_max_H)`: per head, the largest
    pre-softmax logit of this device's rows (stop_gradient'ed; -inf if all are padding).
    """

    ROLE = "attention"  # used on its own (tests): its parameters' roles start here
    cfg: ModelConfig
    ex: ExecutionConfig
    report_logit_max: bool = False

    @nn.compact
    def __call__(self, x_BSD, segment_ids_BS, cos_BSP2, sin_BSP2):
        """With `execution.attention_context_parallel` under SPMD, `segment_ids_BS` and the
        RoPE tables are the node's rows (`comm.AttentionGroup.gather_rows` of this
        device's, done once per step by the Transformer); `x_BSD` and the output are this
        device's rows."""
        cfg, ex = self.cfg, self.ex
        kv_rank = cfg.kv_lora_rank
        n, p = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        group = comm.attention_group(ex.attention_context_parallel)
        if segment_ids_BS.shape[0] != group.size * x_BSD.shape[0]:
            raise ValueError(f"attention: {segment_ids_BS.shape[0]} rows of segment ids for "
                             f"{x_BSD.shape[0]} rows of activations; with context parallelism "
                             f"over {group.size} GPUs they are the node's rows")
        # (in this order: flax draws each parameter's initial values in creation order)
        w_q_a_DQ = weight(self, "w_q_a")
        w_q_b_QHK = weight(self, "w_q_b")
        w_kv_a_DA = weight(self, "w_kv_a")
        w_kv_b_AHK = weight(self, "w_kv_b")
        w_o_HOD = weight(self, "w_o")
        # this GPU's heads (all of them without context parallelism)
        w_q_b_QHK = group.local_heads(w_q_b_QHK, axis=1)
        w_kv_b_AHK = group.local_heads(w_kv_b_AHK, axis=1)

        # With context parallelism, the node's rows: gathers of the latents (2,112 values
        # per token), never of the heads; from here on B is the node's rows and H this
        # GPU's heads.
        fp8 = ex.fp8_gemms
        q_a_BSQ, kv_a_BSA = fp8_linear.matmuls_of_one_input(x_BSD, (w_q_a_DQ, w_kv_a_DA), fp8)
        q_latent_BSQ = RMSNorm(cfg, ex, name="q_a_norm")(q_a_BSQ)
        q_BSHK = _node_heads(group, q_latent_BSQ, w_q_b_QHK, fp8)
        q_nope_BSHN, q_rope_BSHP = q_BSHK[..., :n], q_BSHK[..., n:]

        kv_latent_BSA = RMSNorm(cfg, ex, name="kv_a_norm")(kv_a_BSA[..., :kv_rank])
        k_rope_BS1P = group.gather_rows(kv_a_BSA[..., None, kv_rank:])
        kv_BSHK = _node_heads(group, kv_latent_BSA, w_kv_b_AHK, fp8)
        k_nope_BSHN, v_BSHO = kv_BSHK[..., :n], kv_BSHK[..., n:]

        q_rope_BSHP = apply_rope(q_rope_BSHP, cos_BSP2, sin_BSP2)
        k_rope_BSHP = jnp.broadcast_to(apply_rope(k_rope_BS1P, cos_BSP2, sin_BSP2),
                                       k_nope_BSHN.shape[:-1] + (p,))
        q_BSHK = jnp.concatenate([q_nope_BSHN, q_rope_BSHP], axis=-1)
        k_BSHK = jnp.concatenate([k_nope_BSHN, k_rope_BSHP], axis=-1)

        scale = logit_scale(cfg)
        b, s, h, _ = q_BSHK.shape
        impl = kernels.attention_impl(ex, scores_bytes=4 * b * h * s * s)
        with jax.named_scope("attention_kernel"):  # profiles (benchmarks/profile_breakdown.py)
            if impl == "dense":
                result = dense_attention(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS, scale=scale,
                                         block_size=ex.attention_block_size,
                                         return_logit_max=self.report_logit_max)
            elif impl == "blockwise":
                result = blockwise_attention(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS,
                                             block_size=ex.attention_block_size, scale=scale,
                                             return_logit_max=self.report_logit_max)
            else:
                result = library_attention(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS,
                                           scale=scale, impl=impl,
                                           return_logit_max=self.report_logit_max,
                                           backward_chunk=ex.attention_backward_chunk)
        out_BSHO, logit_max_H = result if self.report_logit_max else (result, None)
        # (with context parallelism the name is on the node's rows × my heads: the same
        # bytes, and what the backward needs)
        out_BSHO = checkpoint_name(out_BSHO, "attention_out")
        # my rows, every head (and the node's rows' maxima of every head for QK-clip)
        out_BSD = _rows_home_projected(group, out_BSHO, w_o_HOD, fp8)
        logit_max_H = None if logit_max_H is None else group.all_heads(logit_max_H)
        return (out_BSD, logit_max_H) if self.report_logit_max else out_BSD


def _node_heads(group: comm.AttentionGroup, latent_BSX, w_XHK, fp8: str):
    """The node's rows' latents by this GPU's heads' up-projection [B·size, S, H/size, K]."""
    if group.size == 1:
        return fp8_linear.einsum("bsx,xhk->bshk", latent_BSX, w_XHK, fp8)
    # the gathered latents are w's gradient's operand: gathered again in the backward
    # (nothing saved but this device's latents), not kept through the layer's backward
    return jax.checkpoint(lambda x, w: fp8_linear.einsum("bsx,xhk->bshk", group.gather_rows(x),
                                                         w, fp8),
                          policy=jax.checkpoint_policies.nothing_saveable)(latent_BSX, w_XHK)


def _rows_home_projected(group: comm.AttentionGroup, out_BSHO, w_o_HOD, fp8: str):
    """Outputs of the node's rows × my heads → my rows × all heads, then `w_o` [B, S, D]."""
    if group.size == 1:
        return fp8_linear.einsum("bsho,hod->bsd", out_BSHO, w_o_HOD, fp8)
    # recomputed in the backward from the kernel's own residual: the exchanged copy of
    # the output is not kept for w_o's gradient (one more all-to-all, 1 GB less HBM)
    return jax.checkpoint(lambda o, w: fp8_linear.einsum("bsho,hod->bsd", group.rows_home(o),
                                                         w, fp8),
                          policy=jax.checkpoint_policies.nothing_saveable)(out_BSHO, w_o_HOD)


def logit_scale(cfg: ModelConfig) -> float:
    """The softmax temperature: 1/√K, sharpened by YaRN's mscale² as in DeepSeek-V3."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling.type == "yarn":
        scale *= yarn_mscale(cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim) ** 2
    return scale


def row_max_per_head(m_BHS, segment_ids_BS):
    """Per head, the largest of the rows' logit maxima over non-padding query rows
    (segment id 0 is padding, data/pipeline.py): [H] float32, outside the gradient."""
    real_B1S = (segment_ids_BS > 0)[:, None, :]
    return jax.lax.stop_gradient(jnp.where(real_B1S, m_BHS, -jnp.inf).max(axis=(0, 2)))


def attention_mask(q_index_S, k_index_S, q_segment_BS, k_segment_BS):
    """Causal by token index and isolated by document: [B, 1, S_q, S_k] booleans."""
    causal_SS = q_index_S[:, None] >= k_index_S[None, :]
    same_doc_BSS = q_segment_BS[:, :, None] == k_segment_BS[:, None, :]
    return (causal_SS[None] & same_doc_BSS)[:, None]


def dense_attention(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS, *, scale, block_size=None,
                    return_logit_max=False):
    """Causal, document-masked attention with each query block's scores all at once.

    The blockwise kernel's math without its loops: the sequence is cut into query blocks
    of `block_size` (default: one block), unrolled, and each block attends to the keys up
    to its own end at once (`_attend`) — causality skips the keys after the block (with
    2 blocks a quarter of the score matrix). For sequences whose scores fit in memory (the
    CPU configs), where a few large einsums beat the blockwise scan's loop, conditionals
    and per-block recompute. Heads lead the batch dims (`[B, H, S, ·]`), so every einsum
    is a plain batched matmul. With `return_logit_max`, also each head's largest logit.
    """
    s = q_BSHK.shape[1]
    y = min(block_size or s, s)
    index_S = jnp.arange(s)
    q_BHSK, k_BHSK, v_BHSO = (jnp.einsum("bshk->bhsk", t) for t in (q_BSHK, k_BSHK, v_BSHO))
    outs, maxes = [], []
    for start in range(0, s, y):  # static: each block's own (key-prefix) shapes
        end = min(start + y, s)
        mask_B1YS = attention_mask(index_S[start:end], index_S[:end],
                                   segment_ids_BS[:, start:end], segment_ids_BS[:, :end])
        out_BHYO, m_BHY = _attend(q_BHSK[:, :, start:end], k_BHSK[:, :, :end],
                                  v_BHSO[:, :, :end], mask_B1YS, scale)
        outs.append(out_BHYO)
        maxes.append(m_BHY)
    out_BSHO = jnp.einsum("bhso->bsho", jnp.concatenate(outs, axis=2))
    if not return_logit_max:
        return out_BSHO
    return out_BSHO, row_max_per_head(jnp.concatenate(maxes, axis=2), segment_ids_BS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q_BHYK, k_BHSK, v_BHSO, mask_B1YS, scale):
    """Queries of one block against their visible keys: (output [B, H, Y, O], each row's
    max logit [B, H, Y]; -inf for a row that sees no key, whose output is zeros).

    A custom VJP (FlashAttention's backward, Dao et al. 2022, on the saved probabilities):
    dS = P ∘ (dP − rowsum(dO ∘ O)), no pass over the scores for the softmax's own
    normalization and no mask in the backward — masked probabilities are zeros.
    """
    return _attend_fwd(q_BHYK, k_BHSK, v_BHSO, mask_B1YS, scale)[0]


def _attend_fwd(q_BHYK, k_BHSK, v_BHSO, mask_B1YS, scale):
    # the scale goes on the queries (Y·K products, not Y·S), and the probabilities stay
    # unnormalized (e = exp(s − max)); the output is divided by their sum once per row
    s_BHYS = jnp.einsum("bhqk,bhtk->bhqt", q_BHYK * jnp.asarray(scale, q_BHYK.dtype), k_BHSK,
                        preferred_element_type=jnp.float32)
    s_BHYS = jnp.where(mask_B1YS, s_BHYS, -jnp.inf)
    m_BHY = s_BHYS.max(axis=-1)
    shift_BHY = jnp.where(jnp.isfinite(m_BHY), m_BHY, 0.0)  # rows with no visible key
    e_BHYS = jnp.exp(s_BHYS - shift_BHY[..., None])
    l_BHY = e_BHYS.sum(axis=-1)
    inv_l_BHY = 1.0 / jnp.where(l_BHY > 0, l_BHY, 1.0)
    out_BHYO = jnp.einsum("bhqt,bhtv->bhqv", e_BHYS.astype(v_BHSO.dtype), v_BHSO,
                          preferred_element_type=jnp.float32) * inv_l_BHY[..., None]
    return ((out_BHYO.astype(v_BHSO.dtype), m_BHY),
            (q_BHYK, k_BHSK, v_BHSO, e_BHYS, inv_l_BHY, out_BHYO))


def _attend_bwd(scale, residuals, cotangents):
    q_BHYK, k_BHSK, v_BHSO, e_BHYS, inv_l_BHY, out_BHYO = residuals
    d_out_BHYO = cotangents[0].astype(jnp.float32)  # the max logit is reported, not trained
    f32 = dict(preferred_element_type=jnp.float32)
    # P = e / l: its row factor goes on the small operands, never a pass over the scores
    d_out_l_BHYO = d_out_BHYO * inv_l_BHY[..., None]
    dv_BHSO = jnp.einsum("bhqt,bhqv->bhtv", e_BHYS, d_out_l_BHYO, **f32)
    dp_BHYS = jnp.einsum("bhqv,bhtv->bhqt", d_out_l_BHYO, v_BHSO.astype(jnp.float32), **f32)
    row_BHY = jnp.sum(d_out_l_BHYO * out_BHYO, axis=-1)
    ds_BHYS = e_BHYS * (dp_BHYS - row_BHY[..., None])  # dS/scale, as P ∘ (dP − rowsum)
    dq_BHYK = jnp.einsum("bhqt,bhtk->bhqk", ds_BHYS, k_BHSK.astype(jnp.float32), **f32) * scale
    dk_BHSK = jnp.einsum("bhqt,bhqk->bhtk", ds_BHYS, q_BHYK.astype(jnp.float32), **f32) * scale
    return (dq_BHYK.astype(q_BHYK.dtype), dk_BHSK.astype(k_BHSK.dtype),
            dv_BHSO.astype(v_BHSO.dtype), None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def blockwise_attention(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS, *, block_size, scale,
                        return_logit_max=False):
    """Causal, document-masked attention with an online softmax over key blocks.

    Memory is O(S·block) per query block, never O(S²): each query block scans the key
    blocks keeping a running max/denominator (Milakov & Gimelshein 2018; FlashAttention,
    Dao et al. 2022). Key blocks strictly after the query block are skipped (a `cond` on
    replicated loop indices, so it costs no collective). Each query block is a
    `jax.checkpoint`, so the backward pass recomputes one block's scores at a time.
    Tokens whose document has no visible key (impossible with causal self-attention, but
    kept safe) produce zeros. With `return_logit_max`, also each head's largest logit
    (`row_max_per_head` of the final running maxima: exact, the very max the softmax used).
    """
    b, s, h, _ = q_BSHK.shape
    o_dim = v_BSHO.shape[-1]
    y = min(block_size, s)
    x = s // y

    def blocks(t):  # [B, S, ...] -> [X, B, Y, ...]
        return jnp.moveaxis(t.reshape(b, x, y, *t.shape[2:]), 1, 0)

    q_XBYHK, k_XBYHK, v_XBYHO = blocks(q_BSHK), blocks(k_BSHK), blocks(v_BSHO)
    seg_XBY = blocks(segment_ids_BS)
    block_ids_X = jnp.arange(x)

    @jax.checkpoint
    def one_query_block(args):
        qi, q_BYHK, q_seg_BY = args
        q_index_Y = qi * y + jnp.arange(y)

        def visit_key_block(carry, kv):
            kj, k_BYHK, v_BYHO, k_seg_BY = kv

            def accumulate(carry):
                m_BHY, l_BHY, acc_BHYO = carry
                s_BHYY = jnp.einsum("bqhk,bthk->bhqt", q_BYHK, k_BYHK,
                                    preferred_element_type=jnp.float32) * scale
                mask = attention_mask(q_index_Y, kj * y + jnp.arange(y), q_seg_BY, k_seg_BY)
                s_BHYY = jnp.where(mask, s_BHYY, -jnp.inf)
                m_new_BHY = jnp.maximum(m_BHY, s_BHYY.max(axis=-1))
                # Rows that have seen no visible key yet keep max -inf; shift them by 0.
                shift_BHY = jnp.where(jnp.isfinite(m_new_BHY), m_new_BHY, 0.0)
                p_BHYY = jnp.exp(s_BHYY - shift_BHY[..., None])
                correction_BHY = jnp.exp(m_BHY - shift_BHY)
                l_BHY = l_BHY * correction_BHY + p_BHYY.sum(axis=-1)
                pv_BHYO = jnp.einsum("bhqt,bthv->bhqv", p_BHYY.astype(v_BYHO.dtype), v_BYHO,
                                     preferred_element_type=jnp.float32)
                acc_BHYO = acc_BHYO * correction_BHY[..., None] + pv_BHYO
                return m_new_BHY, l_BHY, acc_BHYO

            return jax.lax.cond(kj <= qi, accumulate, lambda c: c, carry), None

        init = (jnp.full((b, h, y), -jnp.inf, jnp.float32), jnp.zeros((b, h, y), jnp.float32),
                jnp.zeros((b, h, y, o_dim), jnp.float32))
        (m_BHY, l_BHY, acc_BHYO), _ = jax.lax.scan(visit_key_block, init,
                                                   (block_ids_X, k_XBYHK, v_XBYHO, seg_XBY))
        out_BHYO = acc_BHYO / jnp.where(l_BHY > 0, l_BHY, 1.0)[..., None]
        return (jnp.einsum("bhyo->byho", out_BHYO).astype(v_BSHO.dtype),
                row_max_per_head(m_BHY, q_seg_BY))

    out_XBYHO, logit_max_XH = jax.lax.map(one_query_block, (block_ids_X, q_XBYHK, seg_XBY))
    out_BSHO = jnp.moveaxis(out_XBYHO, 0, 1).reshape(b, s, h, o_dim)
    return (out_BSHO, logit_max_XH.max(axis=0)) if return_logit_max else out_BSHO


def document_starts(segment_ids_BS: jax.Array) -> jax.Array:
    """For each position, the index of the first token of its document [B, S] int32.

    Packed rows hold each document piece in one contiguous run of one segment id
    (data/pipeline.py), so "same document and causal" is exactly "key index in
    [document start, query index]": a per-query lower bound instead of a [S, S] mask.
    """
    b, s = segment_ids_BS.shape
    index_S = jnp.arange(s, dtype=jnp.int32)
    starts_BS = jnp.concatenate([jnp.ones((b, 1), bool),
                                 segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(starts_BS, index_S, 0), axis=1)


def pad_sequence(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS, multiple: int):
    """Pad the sequence to a multiple of `multiple`. The padded positions come last and
    form a document of their own (segment −1), so no real query sees them (causal) and
    the real outputs are unchanged; the caller drops the padded rows."""
    pad = -q_BSHK.shape[1] % multiple
    if not pad:
        return q_BSHK, k_BSHK, v_BSHO, segment_ids_BS
    q_BSHK, k_BSHK, v_BSHO = (jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0)))
                              for t in (q_BSHK, k_BSHK, v_BSHO))
    return q_BSHK, k_BSHK, v_BSHO, jnp.pad(segment_ids_BS, ((0, 0), (0, pad)),
                                           constant_values=-1)


# tokamax's GPU kernels tile queries in blocks of up to 128: other lengths (tests) are
# padded to a multiple of it.
LIBRARY_SEQ_MULTIPLE = 128
# execution.attention → tokamax's implementation (ops in tokamax's attention api).
TOKAMAX_ATTENTION = {"tokamax": "mosaic_gpu", "tokamax_triton": "triton",
                     "tokamax_xla": "xla"}


def backward_chunk_for(s: int, backward_chunk: int) -> int:
    """The chunk the pairwise backward runs on for `s` positions (0: none): whole query
    tiles, at most the (padded) sequence; the sequence is padded to a multiple of it."""
    if not backward_chunk:
        return 0
    whole = -(-s // LIBRARY_SEQ_MULTIPLE) * LIBRARY_SEQ_MULTIPLE
    return -(-min(backward_chunk, whole) // LIBRARY_SEQ_MULTIPLE) * LIBRARY_SEQ_MULTIPLE


def library_attention(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS, *, scale, impl="tokamax",
                      return_logit_max=False, backward_chunk=0):
    """Causal, document-masked attention by tokamax's flash attention (forward and VJP).

    The document mask goes in as `Mask(k_start=document start, is_causal=True)`, which
    tokamax's Mosaic GPU kernel applies per tile, so no [S, S] mask exists (its public
    `dot_product_attention` takes only a dense mask or sequence lengths, hence the op
    object). q/k head dims (192) may differ from v's (128). On Hopper the default is the
    Mosaic GPU kernel (warp-specialized, sm90 WGMMA); `tokamax_triton` is its Triton one;
    `tokamax_xla` runs anywhere but materializes the mask (tests compare it with the
    blockwise kernel). Rows whose document has no visible key cannot occur (causal).
    With `backward_chunk` the Mosaic kernel's backward runs on chunk pairs and skips the
    pairs of other documents (flash_backward.py); its forward already skips them.

    `return_logit_max`: the op's softmax residuals `(row max of scale·q·k, denominator)`
    [B, H, S] (`return_residuals=True`; the Mosaic sm90 kernel stores its exact running
    max, and its VJP needs them anyway) reduced at once to each head's max over real rows.
    The residuals' cotangent is dropped by the VJPs (they differentiate the output only),
    and they are stop_gradient'ed here, so gradients are unchanged.
    """
    kernels.import_tokamax()  # its log filter before tokamax's modules log
    from tokamax._src.ops.attention import api, base

    op = api.IMPLEMENTATIONS[TOKAMAX_ATTENTION[impl]]
    s = q_BSHK.shape[1]
    chunk = backward_chunk_for(s, backward_chunk) if impl == "tokamax" else 0
    if impl != "tokamax_xla":
        q_BSHK, k_BSHK, v_BSHO, segment_ids_BS = pad_sequence(
            q_BSHK, k_BSHK, v_BSHO, segment_ids_BS, chunk or LIBRARY_SEQ_MULTIPLE)
    k_start_BS = document_starts(segment_ids_BS)
    dtype = v_BSHO.dtype
    if impl == "tokamax" and dtype == jnp.float32:
        # the Mosaic kernel multiplies bf16 only: float32-compute configs (the CPU ones,
        # planned for a GPU) get bf16 inputs there, float32 accumulation and output
        q_BSHK, k_BSHK, v_BSHO = (t.astype(jnp.bfloat16) for t in (q_BSHK, k_BSHK, v_BSHO))

    def forward(q, k, v, k_start):
        mask = base.Mask(k_start=k_start[:, None, :], is_causal=True)
        return op(q, k, v, mask=mask, logits_scale=scale, return_residuals=True)

    if chunk:
        out_BSHO, m_BHS = flash_backward.attention(
            q_BSHK, k_BSHK, v_BSHO, k_start_BS, scale, chunk, forward,
            flash_backward.tokamax_pair_vjp(op, scale))
    elif return_logit_max:
        out_BSHO, (m_BHS, _) = forward(q_BSHK, k_BSHK, v_BSHO, k_start_BS)
    else:
        mask = base.Mask(k_start=k_start_BS[:, None, :], is_causal=True)
        return op(q_BSHK, k_BSHK, v_BSHO, mask=mask, logits_scale=scale)[:, :s].astype(dtype)
    if not return_logit_max:
        return out_BSHO[:, :s].astype(dtype)
    # padded query rows (a document of their own, segment -1) are dropped with the output
    logit_max_H = row_max_per_head(m_BHS[:, :, :s], segment_ids_BS[:, :s])
    return out_BSHO[:, :s].astype(dtype), logit_max_H
