"""The document-aware flash backward (chunk pairs) against autodiff of masked attention,
the pairs it skips, and the fractions the plan prices attention with."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.model import flash_backward, kernels
from europa_jax.model.attention import attention_mask, document_starts

B, S, H, K, O = 2, 64, 2, 16, 8
SCALE = 0.3
# row 0: three documents; row 1: a short one, then one of 59 positions
LENGTHS = ([20, 30, 14], [5, 59])


def packed(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(len(lengths), S, H, K)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(len(lengths), S, H, K)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(len(lengths), S, H, O)), jnp.float32)
    seg = np.stack([np.repeat(np.arange(1, len(n) + 1), n) for n in lengths])
    return q, k, v, jnp.asarray(seg, jnp.int32)


def naive(q, k, v, seg):
    """Softmax over the causal, same-document keys, with its row max and denominator."""
    index = jnp.arange(S)
    mask = attention_mask(index, index, seg, seg)  # [B, 1, S, S]
    s = jnp.where(mask, jnp.einsum("bqhk,bthk->bhqt", q, k) * SCALE, -jnp.inf)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    return jnp.einsum("bhqt,btho->bqho", p / l[..., None], v), (m, l)


@pytest.mark.parametrize("chunk", [64, 16, 8])
def test_pairwise_backward_equals_autodiff(chunk):
    q, k, v, seg = packed()
    out, (m, l) = naive(q, k, v, seg)
    dout = jax.random.normal(jax.random.key(1), out.shape)
    want = jax.grad(lambda q, k, v: jnp.sum(naive(q, k, v, seg)[0] * dout),
                    argnums=(0, 1, 2))(q, k, v)
    got = flash_backward.flash_backward(m, l, out, dout, q, k, v, document_starts(seg),
                                        chunk=chunk,
                                        pair_vjp=flash_backward.reference_pair_vjp(SCALE))
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.skipif(not kernels.tokamax_available(), reason="tokamax (the gpu extra)")
def test_attention_with_tokamax_forward_equals_its_own_vjp():
    """The custom VJP around a tokamax forward (its XLA op here; Mosaic GPU on Hopper,
    compiled in test_gpu_target.py): same output and row max, and gradients from the
    pairs equal to tokamax's own VJP of the whole row."""
    kernels.import_tokamax()  # its log filter first
    from tokamax._src.ops.attention import api, base

    q, k, v, seg = packed()
    starts = document_starts(seg)
    op = api.IMPLEMENTATIONS["xla"]
    mask = base.Mask(k_start=starts[:, None, :], is_causal=True)

    def forward(q, k, v, k_start):
        return op(q, k, v, mask=base.Mask(k_start=k_start[:, None, :], is_causal=True),
                  logits_scale=SCALE, return_residuals=True)

    def ours(q, k, v):
        return flash_backward.attention(q, k, v, starts, SCALE, 16, forward,
                                        flash_backward.reference_pair_vjp(SCALE))

    out, m = ours(q, k, v)
    ref_out, (ref_m, _) = op(q, k, v, mask=mask, logits_scale=SCALE, return_residuals=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    np.testing.assert_allclose(m, ref_m, rtol=1e-6)
    dout = jax.random.normal(jax.random.key(2), out.shape)
    got = jax.grad(lambda *a: jnp.sum(ours(*a)[0] * dout), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(op(*a, mask=mask, logits_scale=SCALE) * dout),
                    argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def starts_of(lengths):
    return document_starts(packed([lengths])[3])


def test_pairs_visited_skip_other_documents():
    one = np.asarray(flash_backward.visited_pairs(starts_of([64]), 16))[0]
    assert np.array_equal(one, np.tril(np.ones((4, 4), bool)))  # one document: all causal
    aligned = np.asarray(flash_backward.visited_pairs(starts_of([16, 16, 32]), 16))[0]
    # the 32-long document spans chunks 2-3: their pair; nothing else off the diagonal
    assert np.array_equal(aligned, np.eye(4, dtype=bool) | (np.eye(4, k=-1, dtype=bool)
                                                            & [[0], [0], [0], [1]]))
    straddling = np.asarray(flash_backward.visited_pairs(starts_of([10, 54]), 16))[0]
    assert straddling.sum() == 4 + 3 + 2 + 1  # the second document reaches back to chunk 0
    # each row of a batch its own pairs: not what any of its rows needs
    both = np.asarray(flash_backward.visited_pairs(
        jnp.concatenate([starts_of([16, 16, 32]), starts_of([64])]), 16))
    assert np.array_equal(both[0], aligned) and np.array_equal(both[1], one)


# a node's rows (context parallelism hands a GPU all of them): packed documents, one
# document across every chunk boundary, a short document then padding to the row's end
# (padding is a document of its own, attention.pad_sequence)
NODE_LENGTHS = ([16, 16, 32], [64], [7, 9, 48], [30, 34])


def counting(pair_vjp):
    """`pair_vjp` that counts its runs (a callback per run, loops included)."""
    runs = []

    def vjp(*args):
        jax.debug.callback(lambda: runs.append(1))
        return pair_vjp(*args)

    return vjp, runs


def test_each_row_runs_only_the_pairs_its_own_documents_need():
    """Rows with different documents in one call: values and gradients of autodiff, and
    the pairs run are the sum of each row's own (before, the rows ran the pairs any of
    them needed: 4 × 10 here, where the rows need 5 + 10 + 7 + 8)."""
    q, k, v, seg = packed(NODE_LENGTHS)
    out, (m, l) = naive(q, k, v, seg)
    dout = jax.random.normal(jax.random.key(3), out.shape)
    want = jax.grad(lambda q, k, v: jnp.sum(naive(q, k, v, seg)[0] * dout),
                    argnums=(0, 1, 2))(q, k, v)
    starts = document_starts(seg)
    pair_vjp, runs = counting(flash_backward.reference_pair_vjp(SCALE))
    got = jax.jit(lambda *a: flash_backward.flash_backward(*a, chunk=16, pair_vjp=pair_vjp))(
        m, l, out, dout, q, k, v, starts)
    jax.effects_barrier()
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    per_row = np.asarray(flash_backward.visited_pairs(starts, 16)).sum(axis=(1, 2))
    assert per_row.tolist() == [5, 10, 7, 8]
    assert len(runs) == per_row.sum() == 30


def test_fractions_the_plan_prices_attention_with():
    one_doc = flash_backward.kernel_pair_fraction([65536], 65536, 4096, 128)
    assert one_doc["forward"] == pytest.approx(1.0) and one_doc["backward"] == pytest.approx(1.0)
    short = flash_backward.kernel_pair_fraction([1024] * 64, 65536, 4096, 128)
    # the backward runs the 16 diagonal chunk pairs: 1/16 of a causal row
    assert short["backward"] == pytest.approx(16 * 4096 * 4097 / 65536 / 65537, rel=1e-6)
    # the forward reads whole 128-tiles from each document's start: 1,024-long documents
    assert short["forward"] == pytest.approx(64 * 1024 * 1025 / 65536 / 65537, rel=0.15)
    assert short["forward"] < short["backward"]
