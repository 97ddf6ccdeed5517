"""MLA attention: the dense and blockwise kernels equal naive attention, are causal and
isolate documents; the library (tokamax) kernel's call equals the blockwise kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.model import kernels
from europa_jax.model.attention import (attention_mask, blockwise_attention, dense_attention,
                                        document_starts, library_attention, pad_sequence)


def naive_attention(q_BSHK, k_BSHK, v_BSHO, segment_ids_BS, scale):
    s = q_BSHK.shape[1]
    scores_BHSS = jnp.einsum("bshk,bthk->bhst", q_BSHK, k_BSHK) * scale
    mask = attention_mask(jnp.arange(s), jnp.arange(s), segment_ids_BS, segment_ids_BS)
    probs_BHSS = jax.nn.softmax(jnp.where(mask, scores_BHSS, -jnp.inf), axis=-1)
    return jnp.einsum("bhst,bthv->bshv", probs_BHSS, v_BSHO)


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
    # the running max it reports (QK-clip) is the masked max of the logits, per head
    out_m, logit_max_H = blockwise_attention(q, k, v, seg, block_size=block, scale=0.3,
                                             return_logit_max=True)
    np.testing.assert_array_equal(out_m, out)
    mask = attention_mask(jnp.arange(64), jnp.arange(64), seg, seg)
    logits = jnp.einsum("bshk,bthk->bhst", q, k) * 0.3
    dense_max_H = jnp.where(mask, logits, -jnp.inf).max(axis=(0, 2, 3))
    np.testing.assert_allclose(logit_max_H, dense_max_H, rtol=1e-6)


def test_blockwise_gradients_equal_naive():
    q, k, v, seg = random_inputs(1)
    f_ref = lambda *a: jnp.sum(jnp.sin(naive_attention(*a, seg, 0.3)))
    f_blk = lambda *a: jnp.sum(jnp.sin(blockwise_attention(*a, seg, block_size=16, scale=0.3)))
    for g_ref, g_blk in zip(jax.grad(f_ref, (0, 1, 2))(q, k, v), jax.grad(f_blk, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g_blk, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block", [None, 16, 24])
def test_dense_equals_naive_values_logit_max_and_gradients(block):
    """The CPU kernel for sequences whose scores fit, in one query block or several (each
    up to its own keys; 24 leaves a short last block): naive attention's values and
    gradients, the masked max logit per head, and padding rows' max left out."""
    q, k, v, seg = random_inputs(4)
    seg = seg.at[1, 60:].set(0)  # padding rows: a document of their own, max reported apart
    out, logit_max_H = dense_attention(q, k, v, seg, scale=0.3, block_size=block,
                                       return_logit_max=True)
    np.testing.assert_allclose(out, naive_attention(q, k, v, seg, 0.3), rtol=1e-5, atol=1e-5)
    _, blockwise_max_H = blockwise_attention(q, k, v, seg, block_size=16, scale=0.3,
                                             return_logit_max=True)
    np.testing.assert_allclose(logit_max_H, blockwise_max_H, rtol=1e-6)
    f_ref = lambda *a: jnp.sum(jnp.sin(naive_attention(*a, seg, 0.3)))
    f_dense = lambda *a: jnp.sum(jnp.sin(dense_attention(*a, seg, scale=0.3, block_size=block)))
    for g_ref, g_dense in zip(jax.grad(f_ref, (0, 1, 2))(q, k, v),
                              jax.grad(f_dense, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g_dense, g_ref, rtol=1e-4, atol=1e-5)


def test_auto_is_dense_on_cpu_only_while_the_scores_fit(tiny_cfg):
    cfg = tiny_cfg.execution
    fits = kernels.DENSE_ATTENTION_MAX_BYTES
    assert kernels.attention_impl(cfg, "cpu", scores_bytes=fits) == "dense"
    assert kernels.attention_impl(cfg, "cpu", scores_bytes=fits + 1) == "blockwise"
    assert kernels.attention_impl(cfg, "cpu") == "blockwise"  # size unknown: never holds them
    blockwise = dataclasses.replace(cfg, attention="blockwise")
    assert kernels.attention_impl(blockwise, "cpu", scores_bytes=1) == "blockwise"


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


# --------------------------------------------------------------------------- library kernels
# On GPU the model runs tokamax's flash attention (attention.library_attention); its Mosaic
# GPU kernel cannot run here, but tokamax's XLA implementation takes the very same call —
# the same op API, the same per-query document-start mask — and runs on CPU: it checks the
# mask translation, the head widths and the gradients against the blockwise kernel. The
# GPU kernel itself is compiled for a GH200 in tests/test_gpu_target.py.
needs_tokamax = pytest.mark.skipif(not kernels.tokamax_available(),
                                   reason="tokamax (the gpu extra) is not installed")


def test_document_starts_are_each_position_s_first_token_of_its_document():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0],
                       [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]], jnp.int32)
    np.testing.assert_array_equal(document_starts(seg), [[0, 0, 0, 3, 3, 5, 5, 5, 5, 9, 9],
                                                         [0] * 11])


@needs_tokamax
def test_the_document_start_mask_is_the_causal_document_mask():
    from tokamax._src.ops.attention import base

    _, _, _, seg = random_inputs()
    s = seg.shape[1]
    mask = base.Mask(k_start=document_starts(seg)[:, None, :], is_causal=True).as_array(s, s)
    expected = attention_mask(jnp.arange(s), jnp.arange(s), seg, seg)  # [B, 1, S, S]
    np.testing.assert_array_equal(np.broadcast_to(mask, expected.shape), expected)


@needs_tokamax
@pytest.mark.parametrize("o", [8, 12])  # v narrower than q/k as in MLA (128 vs 192), or equal
def test_library_attention_equals_blockwise_values_and_gradients(o):
    q, k, v, seg = random_inputs(4, o=o)
    attend = {"library": lambda *a: library_attention(*a, seg, scale=0.3, impl="tokamax_xla"),
              "blockwise": lambda *a: blockwise_attention(*a, seg, block_size=16, scale=0.3)}
    np.testing.assert_allclose(attend["library"](q, k, v), attend["blockwise"](q, k, v),
                               rtol=1e-5, atol=1e-5)
    grads = {name: jax.grad(lambda *a, f=f: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)
             for name, f in attend.items()}
    for g_lib, g_blk in zip(grads["library"], grads["blockwise"]):
        np.testing.assert_allclose(g_lib, g_blk, rtol=1e-4, atol=1e-5)


@needs_tokamax
def test_library_attention_in_bf16_stays_within_bf16_tolerance_of_float32():
    q, k, v, seg = random_inputs(5)
    ref = blockwise_attention(q, k, v, seg, block_size=16, scale=0.3)
    low = library_attention(*(t.astype(jnp.bfloat16) for t in (q, k, v)), seg, scale=0.3,
                            impl="tokamax_xla")
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.astype(jnp.float32), ref, rtol=0.05, atol=0.03)


@needs_tokamax
def test_padding_the_sequence_for_the_kernel_tiles_changes_no_real_output():
    q, k, v, seg = random_inputs(6, s=40)
    padded = pad_sequence(q, k, v, seg, 128)
    assert padded[0].shape[1] == 128 and int(padded[3][0, -1]) == -1
    out = library_attention(*padded, scale=0.3, impl="tokamax_xla")[:, :40]
    np.testing.assert_allclose(out, naive_attention(q, k, v, seg, 0.3), rtol=1e-5, atol=1e-5)


@needs_tokamax
def test_the_model_s_attention_layer_is_the_same_with_either_kernel(tiny_cfg):
    import dataclasses

    from europa_jax.model.attention import MLAttention
    from europa_jax.model.layers import rope_tables

    cfg = tiny_cfg.model
    b, s = 2, 64
    x = jax.random.normal(jax.random.key(7), (b, s, cfg.d_model))
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 30 + [3] * 14], b, axis=0), jnp.int32)
    cos, sin = rope_tables(jnp.broadcast_to(jnp.arange(s), (b, s)), cfg)
    layers = {impl: MLAttention(cfg, dataclasses.replace(tiny_cfg.execution, attention=impl))
              for impl in ("blockwise", "tokamax_xla")}
    params = layers["blockwise"].init(jax.random.key(0), x, seg, cos, sin)
    outs = {impl: layer.apply(params, x, seg, cos, sin) for impl, layer in layers.items()}
    np.testing.assert_allclose(outs["tokamax_xla"], outs["blockwise"], rtol=1e-5, atol=1e-6)
    # both report the same per-head max logit (QK-clip), beside the same output
    reported = {impl: MLAttention(cfg, layer.ex, report_logit_max=True).apply(
                    params, x, seg, cos, sin) for impl, layer in layers.items()}
    np.testing.assert_array_equal(reported["blockwise"][0], outs["blockwise"])
    assert reported["blockwise"][1].shape == (cfg.n_heads,)
    np.testing.assert_allclose(reported["tokamax_xla"][1], reported["blockwise"][1], rtol=1e-6)
