"""The grouped FP8 kernels (model/fp8/fp8_grouped_kernel.py) run by jax's Mosaic GPU interpreter
on CPU against the block-scaled emulation (model/fp8/fp8_gemm.py) — the forward, the backward's
dx and the weight gradient — and compiled for GH200."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

from europa_jax.model.fp8 import fp8_gemm
from europa_jax.model.fp8.fp8_grouped_kernel import (fp8_grouped_matmul, fp8_grouped_weight_grad,
                                                 grad_input_operands)
from conftest import gh200_program_text
from test_gpu_target import needs_toolchain


BLOCK_M = 64


def interpreted(fn, *args, **kwargs):
    with interpret_params.force_gpu_interpret_mode(interpret_params.InterpretGPUParams()):
        return fn(*args, **kwargs)


def experts_problem(blocks, k, n, seed=0):
    """Rows of the given experts' blocks (the last block of an expert half padding, as
    the blocked layout pads) and per-expert weights, with outliers in rows and weights."""
    rng = np.random.default_rng(seed)
    g = max(blocks) + 1
    x = rng.standard_normal((BLOCK_M * len(blocks), k)) * np.exp(rng.standard_normal((1, k)))
    x[rng.random(x.shape) < 0.01] *= 40
    x[BLOCK_M * len(blocks) - BLOCK_M // 2:] = 0  # padding rows
    w = rng.standard_normal((g, k, n)) / np.sqrt(k)
    w[:, :, 5] *= 30  # an outlier column: what 128×128 blocks confine
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)


def emulated(xq, sx, wq, sw, blocks):
    """Block by block, model/fp8/fp8_gemm.py's exact FP32 product of the same operands."""
    n = wq.shape[-1]
    rows = [fp8_gemm.scaled_matmul(xq[i * BLOCK_M:(i + 1) * BLOCK_M],
                                   sx[i * BLOCK_M:(i + 1) * BLOCK_M], wq[e],
                                   fp8_gemm.block_scales_per_column(sw[e], n))
            for i, e in enumerate(blocks)]
    return np.asarray(jnp.concatenate(rows), np.float32)


def quantized_weights(w):
    wq, sw = zip(*(fp8_gemm.quantize_blocks(w_e) for w_e in w))
    return jnp.stack(wq), jnp.stack(sw)  # [G, K, N], [G, X, Y]


@pytest.mark.parametrize("blocks,k,n", [([0, 0, 1, 2], 256, 256), ([1, 0], 384, 128)])
def test_the_kernel_is_the_block_scaled_product_in_the_interpreter(blocks, k, n):
    x, w = experts_problem(blocks, k, n)
    xq, sx = fp8_gemm.quantize_along(x, axis=1)
    wq_GKN, sw = quantized_weights(w)
    out = interpreted(fp8_grouped_matmul, xq, sx.T, jnp.swapaxes(wq_GKN, 1, 2), sw,
                      jnp.asarray(blocks, jnp.int32), block_m=BLOCK_M, out_dtype=jnp.float32)
    ref = emulated(xq, sx, wq_GKN, sw, blocks)
    # the same products and scales; only the order of FP32 adds differs
    np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert not np.asarray(out)[-BLOCK_M // 2:].any()  # padding rows stay zero
    # and the FP8 product is the unquantized one within e4m3's resolution
    exact = np.concatenate([np.asarray(x[i * BLOCK_M:(i + 1) * BLOCK_M] @ w[e])
                            for i, e in enumerate(blocks)])
    error = np.linalg.norm(np.asarray(out) - exact) / np.linalg.norm(exact)
    assert 1e-3 < error < 0.05, error


def test_the_same_kernel_computes_the_backwards_dx():
    blocks, k, n = [0, 1, 1], 256, 384
    _, w = experts_problem(blocks, k, n)
    dy = jnp.asarray(np.random.default_rng(1).standard_normal((BLOCK_M * 3, n)), jnp.float32)
    gq, sg = fp8_gemm.quantize_along(dy, axis=1)  # dy in 1×128 tiles along N
    wq_GKN, sw = quantized_weights(w)
    wq_for_dx, sw_for_dx = grad_input_operands(wq_GKN, sw)
    dx = interpreted(fp8_grouped_matmul, gq, sg.T, wq_for_dx, sw_for_dx,
                     jnp.asarray(blocks, jnp.int32), block_m=BLOCK_M, out_dtype=jnp.float32)
    ref = emulated(gq, sg, jnp.swapaxes(wq_GKN, 1, 2), jnp.swapaxes(sw, 1, 2), blocks)
    np.testing.assert_allclose(np.asarray(dx), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_the_weight_gradient_sums_each_experts_row_blocks():
    blocks = [0, 0, 2, 2, 2]  # expert 1 has no rows: its gradient is zero
    k, n, rows = 128, 256, 128 * 5
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((rows, k)) * np.exp(rng.standard_normal((rows, 1))),
                    jnp.float32)
    dy = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
    xq, sx = fp8_gemm.quantize_along(x, axis=0)  # 128×1 tiles along the rows: [B, K]
    gq, sg = fp8_gemm.quantize_along(dy, axis=0)
    first, count = jnp.asarray([0, 2, 2], jnp.int32), jnp.asarray([2, 0, 3], jnp.int32)
    dw = np.asarray(interpreted(fp8_grouped_weight_grad, xq.T, sx, gq.T, sg, first, count))
    for e in range(3):
        mine = [b for b, owner in enumerate(blocks) if owner == e]
        ref = sum((np.asarray(fp8_gemm.scaled_matmul(
            xq[b * 128:(b + 1) * 128].T, sx[b:b + 1].T, gq[b * 128:(b + 1) * 128], sg[b:b + 1]))
            for b in mine), np.zeros((k, n), np.float32))
        np.testing.assert_allclose(dw[e], ref, rtol=0, atol=1e-5 * max(np.abs(ref).max(), 1))
        if not mine:
            assert not dw[e].any()


def test_bad_operands_are_refused_in_one_line():
    xq = jnp.zeros((128, 200), jnp.float8_e4m3fn)
    wq = jnp.zeros((2, 128, 200), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="K must be a multiple of 128"):
        fp8_grouped_matmul(xq, jnp.zeros((1, 128)), wq, jnp.zeros((2, 1, 1)),
                           jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="e4m3 operands expected"):
        fp8_grouped_matmul(xq.astype(jnp.bfloat16), jnp.zeros((1, 128)), wq,
                           jnp.zeros((2, 1, 1)), jnp.zeros(2, jnp.int32))


@pytest.mark.slow
@needs_toolchain
def test_the_kernels_compile_for_gh200():
    g, k, n, blocks = 4, 512, 256, 8
    s = jax.ShapeDtypeStruct
    forward = gh200_program_text(
        lambda *a: fp8_grouped_matmul(*a, block_m=BLOCK_M),
        s((BLOCK_M * blocks, k), jnp.float8_e4m3fn), s((k // 128, BLOCK_M * blocks), jnp.float32),
        s((g, n, k), jnp.float8_e4m3fn), s((g, k // 128, n // 128), jnp.float32),
        s((blocks,), jnp.int32))
    weight_grad = gh200_program_text(
        fp8_grouped_weight_grad, s((k, 128 * blocks), jnp.float8_e4m3fn),
        s((blocks, k), jnp.float32), s((n, 128 * blocks), jnp.float8_e4m3fn),
        s((blocks, n), jnp.float32), s((g,), jnp.int32), s((g,), jnp.int32))
    # each one Mosaic GPU kernel (an sm90 wgmma program), and no other GEMM
    for text in (forward, weight_grad):
        assert text.count('custom_call_target="mosaic_gpu') == 1
        assert "__cublas" not in text
