"""Flash attention's backward pass that skips other documents, as its forward does.

Shape suffixes (europa_jax/__init__.py): B rows, S positions, H heads, K q/k head dims,
O value head dims, X chunks of the sequence, Y positions in one.

tokamax's Mosaic GPU forward (sm90) skips the key tiles before a query tile's earliest
document start (`k_start` of its `Mask`); its backward kernels (dq; dk/dv) skip only on
causality, so on a row of short documents they still cost a whole causal row. FlashAttention's
backward is a sum over (query block, key block) pairs given the forward's softmax
statistics — each pair's dq, dk, dv depend only on that pair's q, k, v, the rows' output,
output gradient and (row max, denominator) — so the backward is run here pair by pair on
chunks of `chunk` positions, and the pairs no query of the chunk can see are never run:
for each key chunk j, the diagonal pair (j, j) (causal), then the query chunks i > j in
order while chunk i's earliest key start is before chunk j's end (packed documents:
starts never decrease along a row) — a loop with a run-time trip count, usually zero
iterations for short documents. Each row runs its own loops (a loop over a device's
rows): rows run together would all run the pairs any one of them needs. The pairs a
batch runs are `visited_pairs`;
`kernel_pair_fraction` is the same count from document lengths, for the plan.

`attention` wraps a forward that returns its softmax statistics (tokamax's op with
`return_residuals=True`) and this backward in one custom VJP. The pair backward is
tokamax's own VJP kernel on GPU (`tokamax_pair_vjp`: the kernel reads the statistics and
computes δ = rowsum(dout ∘ out) itself, so a pair gets exactly its share);
`reference_pair_vjp` is the same math in jnp (CPU, tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

def chunk_count(s: int, chunk: int) -> int:
    if s % chunk:
        raise ValueError(f"sequence {s} is not a multiple of the backward chunk {chunk}")
    return s // chunk


def visible_after(k_start_BS, chunk: int) -> jax.Array:
    """Per row and query chunk, its earliest key start [B, X] (what bounds the key chunks
    the chunk's queries see)."""
    b, s = k_start_BS.shape
    return k_start_BS.reshape(b, chunk_count(s, chunk), chunk).min(axis=2)


def visited_pairs(k_start_BS, chunk: int) -> jax.Array:
    """[B, X, X] bool: the (query chunk, key chunk) pairs the backward runs on each row."""
    first_BX = visible_after(k_start_BS, chunk)
    x = first_BX.shape[1]
    i, j = jnp.arange(x)[:, None], jnp.arange(x)[None, :]
    return (j == i) | ((j < i) & (first_BX[:, :, None] < (j + 1) * chunk))


def flash_backward(m_BHS, l_BHS, out_BSHO, dout_BSHO, q_BSHK, k_BSHK, v_BSHO, k_start_BS, *,
                   chunk: int, pair_vjp):
    """(dq, dk, dv) of causal attention masked by `k_start` (keys of a query: [k_start,
    query]), run pair by pair (module docstring) and row by row: each row's own document
    starts decide its pairs. (Rows run together would run the pairs any of them needs: on
    a node sharing 4 rows, one whole-document row would cost all four a whole causal row.)
    m, l: the forward's row max of the scaled logits and its softmax denominator [B, H, S].
    """
    if q_BSHK.shape[0] == 1:
        return _row_backward(m_BHS, l_BHS, out_BSHO, dout_BSHO, q_BSHK, k_BSHK, v_BSHO,
                             k_start_BS, chunk=chunk, pair_vjp=pair_vjp)

    def one_row(row):  # a loop over rows, not a vmap: a vmapped loop runs the longest's trips
        grads = _row_backward(*(a[None] for a in row), chunk=chunk, pair_vjp=pair_vjp)
        return tuple(g[0] for g in grads)

    return jax.lax.map(one_row, (m_BHS, l_BHS, out_BSHO, dout_BSHO, q_BSHK, k_BSHK, v_BSHO,
                                 k_start_BS))


def _row_backward(m_BHS, l_BHS, out_BSHO, dout_BSHO, q_BSHK, k_BSHK, v_BSHO, k_start_BS, *,
                  chunk: int, pair_vjp):
    """flash_backward of one row (B = 1). A scan over key chunks j: the diagonal pair
    (j, j), then the later query chunks while they see chunk j. dk, dv of chunk j sum in
    float32 in the loop and are written once; dq sums over key chunks in a float32
    [B, S, H, K] buffer, the only full-size one."""
    s = q_BSHK.shape[1]
    x = chunk_count(s, chunk)
    first_X = visible_after(k_start_BS, chunk)[0]

    def piece(t, i, axis=1):
        return jax.lax.dynamic_slice_in_dim(t, i * chunk, chunk, axis)

    def pair(i, j, causal):
        """(dq of query chunk i, dk and dv of key chunk j) from their pair."""
        start_BY = piece(k_start_BS, i) - j * chunk  # < 0: every key of chunk j
        return pair_vjp(piece(m_BHS, i, 2), piece(l_BHS, i, 2), piece(out_BSHO, i),
                        piece(dout_BSHO, i), piece(q_BSHK, i), piece(k_BSHK, j),
                        piece(v_BSHO, j), jnp.maximum(start_BY, 0) if causal else start_BY,
                        causal)

    def add_dq(dq_BSHK, i, dq_i):
        return jax.lax.dynamic_update_slice_in_dim(
            dq_BSHK, piece(dq_BSHK, i) + dq_i.astype(jnp.float32), i * chunk, 1)

    def key_chunk(carry, j):
        dq_BSHK, dk_BSHK, dv_BSHO = carry
        dq_j, dk_j, dv_j = pair(j, j, True)
        dq_BSHK = add_dq(dq_BSHK, j, dq_j)

        def visible(carry):
            i = carry[0]
            return (i < x) & (first_X[jnp.minimum(i, x - 1)] < (j + 1) * chunk)

        def query_chunk(carry):
            i, dq_BSHK, dk_j, dv_j = carry
            dq_i, dk_ij, dv_ij = pair(i, j, False)
            return (i + 1, add_dq(dq_BSHK, i, dq_i), dk_j + dk_ij.astype(jnp.float32),
                    dv_j + dv_ij.astype(jnp.float32))

        _, dq_BSHK, dk_j, dv_j = jax.lax.while_loop(
            visible, query_chunk, (j + 1, dq_BSHK, dk_j.astype(jnp.float32),
                                   dv_j.astype(jnp.float32)))
        # written in place into whole-row buffers: a stack of chunks [X, B, ...] would
        # need a transpose back to [B, S, ...] whenever B > 1 (context parallelism)
        dk_BSHK = jax.lax.dynamic_update_slice_in_dim(
            dk_BSHK, dk_j.astype(dk_BSHK.dtype), j * chunk, 1)
        dv_BSHO = jax.lax.dynamic_update_slice_in_dim(
            dv_BSHO, dv_j.astype(dv_BSHO.dtype), j * chunk, 1)
        return (dq_BSHK, dk_BSHK, dv_BSHO), None

    (dq_BSHK, dk_BSHK, dv_BSHO), _ = jax.lax.scan(
        key_chunk, (jnp.zeros(q_BSHK.shape, jnp.float32), jnp.zeros_like(k_BSHK),
                    jnp.zeros_like(v_BSHO)), jnp.arange(x))
    return dq_BSHK, dk_BSHK, dv_BSHO


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def attention(q_BSHK, k_BSHK, v_BSHO, k_start_BS, scale: float, chunk: int, forward, pair_vjp):
    """Causal attention masked by `k_start`: (out [B, S, H, O], row max of the scaled
    logits [B, H, S]); `forward(q, k, v, k_start)` → (out, (m, l)); the backward pass runs
    `flash_backward` with `pair_vjp`. The row max is reported, not differentiated."""
    out_BSHO, (m_BHS, _) = forward(q_BSHK, k_BSHK, v_BSHO, k_start_BS)
    return out_BSHO, m_BHS


def _attention_fwd(q_BSHK, k_BSHK, v_BSHO, k_start_BS, scale, chunk, forward, pair_vjp):
    out_BSHO, (m_BHS, l_BHS) = forward(q_BSHK, k_BSHK, v_BSHO, k_start_BS)
    return (out_BSHO, m_BHS), (q_BSHK, k_BSHK, v_BSHO, k_start_BS, out_BSHO, m_BHS, l_BHS)


def _attention_bwd(scale, chunk, forward, pair_vjp, saved, cotangents):
    q_BSHK, k_BSHK, v_BSHO, k_start_BS, out_BSHO, m_BHS, l_BHS = saved
    dq, dk, dv = flash_backward(m_BHS, l_BHS, out_BSHO, cotangents[0].astype(out_BSHO.dtype),
                                q_BSHK, k_BSHK, v_BSHO, k_start_BS, chunk=chunk,
                                pair_vjp=pair_vjp)
    return (dq.astype(q_BSHK.dtype), dk.astype(k_BSHK.dtype), dv.astype(v_BSHO.dtype), None)


attention.defvjp(_attention_fwd, _attention_bwd)


def tokamax_pair_vjp(op, scale: float):
    """tokamax's VJP kernel of `op` (its attention op object) on one pair: the mask is the
    pair's key starts, causal on the diagonal; every other argument as `op` binds it."""
    from tokamax._src.ops.attention import base

    def vjp(m_BHY, l_BHY, out_BYHO, dout_BYHO, q_BYHK, k_BYHK, v_BYHO, k_start_BY, causal):
        mask = base.Mask(k_start=k_start_BY[:, None, :], is_causal=causal)
        bound = op.bind(q_BYHK, k_BYHK, v_BYHO, mask=mask, logits_scale=scale)
        kwargs = {k: v for k, v in bound.kwargs.items() if k != "return_residuals"}
        grads = op.vjp((m_BHY, l_BHY), out_BYHO, dout_BYHO, *bound.args, **kwargs)
        return grads["q"], grads["k"], grads["v"]

    return vjp


def reference_pair_vjp(scale: float):
    """The pair backward in jnp, FlashAttention's (Dao et al. 2022) as tokamax's kernel
    computes it: P = exp(scale·q·k − m) / l on the visible pairs, dS = P ∘ (dP − δ) with
    δ = rowsum(dout ∘ out) of the whole row."""

    def vjp(m_BHY, l_BHY, out_BYHO, dout_BYHO, q_BYHK, k_BYHK, v_BYHO, k_start_BY, causal):
        f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
        q, k, v, out, dout = map(f32, (q_BYHK, k_BYHK, v_BYHO, out_BYHO, dout_BYHO))
        y = q.shape[1]
        s_BHYY = jnp.einsum("bqhk,bthk->bhqt", q, k) * scale
        key_Y = jnp.arange(k.shape[1])
        mask_BYY = key_Y[None, None, :] >= k_start_BY[:, :, None]
        if causal:
            mask_BYY &= key_Y[None, None, :] <= jnp.arange(y)[None, :, None]
        p_BHYY = jnp.where(mask_BYY[:, None], jnp.exp(s_BHYY - m_BHY[..., None]), 0.0)
        p_BHYY = p_BHYY / jnp.where(l_BHY > 0, l_BHY, 1.0)[..., None]
        delta_BHY = jnp.einsum("bqho,bqho->bhq", out, dout)
        dp_BHYY = jnp.einsum("bqho,btho->bhqt", dout, v)
        ds_BHYY = p_BHYY * (dp_BHYY - delta_BHY[..., None]) * scale
        return (jnp.einsum("bhqt,bthk->bqhk", ds_BHYY, k).astype(q_BYHK.dtype),
                jnp.einsum("bhqt,bqhk->bthk", ds_BHYY, q).astype(k_BYHK.dtype),
                jnp.einsum("bhqt,bqho->btho", p_BHYY, dout).astype(v_BYHO.dtype))

    return vjp


def kernel_pair_fraction(doc_lengths, seq_len: int, chunk: int, tile: int) -> dict:
    """Query-key pairs the kernels run on one row of these packed documents, as a fraction
    of a whole causal row's S(S+1)/2: the forward skips key tiles before each `tile` of
    queries' earliest document start; the backward runs the pairs of `visited_pairs`
    (a diagonal pair counts its causal half, an off-diagonal pair whole)."""
    starts = np.zeros(seq_len, np.int64)
    pos = 0
    for n in doc_lengths:
        starts[pos:pos + n] = pos
        pos += n
    starts[pos:] = pos  # the rest of the row: padding, a document of its own
    causal = seq_len * (seq_len + 1) / 2
    fwd = 0.0
    for q0 in range(0, seq_len, tile):
        q1 = min(q0 + tile, seq_len)
        k0 = starts[q0] // tile * tile  # the tile-aligned earliest key the tile reads
        fwd += (q1 - q0) * (q1 - k0) - (q1 - q0) * (q1 - q0 - 1) / 2
    pairs = np.asarray(visited_pairs(jnp.asarray(starts[None], jnp.int32), chunk))[0]
    n_diag = pairs.shape[0]
    bwd = n_diag * chunk * (chunk + 1) / 2 + (pairs.sum() - n_diag) * chunk * chunk
    return {"forward": float(min(1.0, fwd / causal)), "backward": float(bwd / causal)}
