"""MLA + blockwise attention: equals naive attention, causal, isolates documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.model.attention import attention_mask, blockwise_attention


def naive_attention(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS, scale):
    s = q_BSHK.shape[1]
    scores_BHST = jnp.einsum("bshk,bthk->bhst", q_BSHK, k_BSHK) * scale
    mask = attention_mask(jnp.arange(s), jnp.arange(s), segment_ids_BS, segment_ids_BS)
    probs_BHST = jax.nn.softmax(jnp.where(mask, scores_BHST, -jnp.inf), axis=-1)
    return jnp.einsum("bhst,bthv->bshv", probs_BHST, v_BSHO)


def random_inputs(seed=0, b=2, s=64, h=3, k=12, o=8):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, s, h, k))
    kk = jax.random.normal(keys[1], (b, s, h, k))
    v = jax.random.normal(keys[2], (b, s, h, o))
    # Row 0: three documents of uneven lengths; row 1: one document.
    seg = np.ones((b, s), np.int32)
    seg[0, 10:37], seg[0, 37:] = 2, 3
    return q, kk, v, jnp.asarray(seg)


@pytest.mark.parametrize("block", [8, 16, 64])
def test_blockwise_equals_naive(block):
    q, k, v, seg = random_inputs()
    ref = naive_attention(q, k, v, seg, 0.3)
    out = blockwise_attention(q, k, v, seg, block_size=block, scale=0.3)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_blockwise_gradients_equal_naive():
    q, k, v, seg = random_inputs(1)
    f_ref = lambda *a: jnp.sum(jnp.sin(naive_attention(*a, seg, 0.3)))
    f_blk = lambda *a: jnp.sum(jnp.sin(blockwise_attention(*a, seg, block_size=16, scale=0.3)))
    for g_ref, g_blk in zip(jax.grad(f_ref, (0, 1, 2))(q, k, v), jax.grad(f_blk, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g_blk, g_ref, rtol=1e-4, atol=1e-5)


def test_no_gradient_from_future_tokens():
    q, k, v, seg = random_inputs(2)
    t = 20  # output at position t must not depend on k/v at positions > t
    out_t = lambda k, v: blockwise_attention(q, k, v, seg, block_size=16, scale=0.3)[:, t].sum()
    dk, dv = jax.grad(out_t, (0, 1))(k, v)
    assert np.all(np.asarray(dk[:, t + 1:]) == 0) and np.all(np.asarray(dv[:, t + 1:]) == 0)
    assert np.any(np.asarray(dk[1, : t + 1]) != 0)  # and it does depend on the past


def test_changing_one_document_leaves_the_others_unchanged():
    q, k, v, seg = random_inputs(3)
    out = blockwise_attention(q, k, v, seg, block_size=16, scale=0.3)
    doc2 = np.asarray(seg[0] == 2)
    k2 = k.at[0, doc2].set(jax.random.normal(jax.random.key(9), k[0, doc2].shape))
    v2 = v.at[0, doc2].add(5.0)
    out2 = blockwise_attention(q, k2, v2, seg, block_size=16, scale=0.3)
    other = ~doc2
    np.testing.assert_array_equal(np.asarray(out2[0, other]), np.asarray(out[0, other]))
    assert not np.allclose(out2[0, doc2], out[0, doc2])
