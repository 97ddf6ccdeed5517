"""The FP8 GEMM emulation (model/fp8/fp8_gemm.py) against a float64 reference of the same
block-scaled product — forward and both backward GEMMs — and against the unquantized
product within e4m3's resolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.model.fp8 import fp8_gemm

SHAPES = [(64, 256, 384), (32, 96, 128), (130, 128, 64)]  # chunks of 128 and narrower dims


def operands(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    # activations with a few large values (outliers are what per-tile scales are for)
    x = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)))
    x[rng.random((m, k)) < 0.01] *= 30
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)


def dequantized(q, scale, axis):
    """float64 values a quantized operand stands for (scales repeated over their chunk)."""
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    s64 = np.asarray(scale, np.float64)
    return q64 * np.repeat(s64, q64.shape[axis] // s64.shape[axis], axis=axis)


def dequantized_blocks(q, scale_XY):
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    s = np.asarray(scale_XY, np.float64)
    return q64 * np.repeat(np.repeat(s, q64.shape[0] // s.shape[0], 0), q64.shape[1] // s.shape[1], 1)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_the_forward_is_the_block_scaled_product_in_float64(m, k, n):
    x, w = operands(m, k, n)
    qx, sx = fp8_gemm.quantize_along(x, axis=1)
    qw, sw = fp8_gemm.quantize_blocks(w)
    assert sx.shape == (m, k // fp8_gemm.chunk_width(k))
    assert sw.shape == (k // fp8_gemm.chunk_width(k), n // fp8_gemm.chunk_width(n))
    reference = dequantized(qx, sx, 1) @ dequantized_blocks(qw, sw)
    got = np.asarray(jax.jit(fp8_gemm.fp8_matmul)(x, w), np.float64)
    scale = np.abs(reference).max()
    np.testing.assert_allclose(got, reference, rtol=0, atol=2e-6 * scale)
    # and the unquantized product within e4m3's 3 mantissa bits
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 2.0**-4


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_both_backward_gemms_are_block_scaled_products_along_their_contraction(m, k, n):
    x, w = operands(m, k, n, seed=1)
    r = jnp.asarray(np.random.default_rng(2).standard_normal((m, n)), jnp.float32)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(fp8_gemm.fp8_matmul(x, w) * r),
                              argnums=(0, 1)))(x, w)
    qw, sw = fp8_gemm.quantize_blocks(w)
    qg, sg = fp8_gemm.quantize_along(r, axis=1)  # dY in 1×128 tiles along N
    dx_ref = dequantized(qg, sg, 1) @ dequantized_blocks(qw, sw).T
    qx_cols, sx_cols = fp8_gemm.quantize_along(x, axis=0)  # 128×1 tiles along M
    qg_cols, sg_cols = fp8_gemm.quantize_along(r, axis=0)
    dw_ref = dequantized(qx_cols, sx_cols, 0).T @ dequantized(qg_cols, sg_cols, 0)
    for got, ref in ((dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=0,
                                   atol=2e-6 * np.abs(ref).max())
    exact_dx = np.asarray(r, np.float64) @ np.asarray(w, np.float64).T
    exact_dw = np.asarray(x, np.float64).T @ np.asarray(r, np.float64)
    for got, exact in ((dx, exact_dx), (dw, exact_dw)):
        assert np.linalg.norm(np.asarray(got) - exact) / np.linalg.norm(exact) < 2.0**-4


def test_a_tile_s_values_are_within_half_an_e4m3_step_of_the_input():
    x, _ = operands(16, 256, 8)
    q, s = fp8_gemm.quantize_along(x, axis=1)
    back = dequantized(q, s, 1)
    x64 = np.asarray(x, np.float64)
    floor = np.repeat(np.asarray(s, np.float64), 128, axis=1) * 2.0**-10  # subnormals
    assert (np.abs(back - x64) <= np.maximum(np.abs(x64) * 2.0**-4, floor) * (1 + 1e-6)).all()
    assert np.abs(np.asarray(q.astype(jnp.float32))).max() <= 448.0
