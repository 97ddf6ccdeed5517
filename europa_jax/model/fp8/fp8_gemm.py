"""FP8 GEMMs as DeepSeek-V3 trains with them, emulated exactly on any backend.

The recipe (arXiv 2412.19437, §3.3): every GEMM of the forward and both of the backward
take e4m3 operands with fine-grained scales — 1×128 tiles for activations and gradients,
128×128 blocks for weights — and accumulate in FP32, the partial sum of each 128-wide
chunk of the contraction promoted to FP32 and multiplied by its two scales there. Every
scale group lies inside one 128-wide chunk of the contraction, so:

    out[m, n] = Σ_chunks  s_lhs[m, c] · s_rhs[c, n] · Σ_{k in c} q_lhs[m, k] · q_rhs[k, n]

with q the e4m3 values and s float32 scales (the group's largest magnitude over 448, as
parallel/fp8_rows.py scales the dispatch's rows). e4m3 values are exact in float32 and so
are their products (4 significant bits each), so this module computes exactly that sum in
float32: what a GPU kernel with FP32 accumulation computes, up to the order of its adds.

The backward quantizes along each GEMM's own contraction: dX = dY · Wᵀ takes dY in 1×128
tiles along N and W's blocks transposed; dW = Xᵀ · dY takes X and dY in 128×1 tiles along
the tokens ("transposed re-quantization": the forward's tiles run along K, the weight
gradient contracts over M). A dimension narrower than 128, or that 128 does not divide (the
test models), is one chunk.

Shape suffixes (europa_jax/__init__.py): M rows (tokens), K contraction, N outputs; X chunks
of K, Y blocks of N.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from europa_jax.parallel.fp8_rows import E4M3_MAX, FP8

CHUNK = 128


def chunk_width(n: int) -> int:
    return CHUNK if n % CHUNK == 0 else n


def quantize_along(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """e4m3 values of a 2-D `x` and float32 scales, one per 128 values along `axis`
    (the scales have that axis cut to its chunks: [M, X] along 1, [X, N] along 0)."""
    x32 = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    rows, n = x32.shape
    w = chunk_width(n)
    x_RXW = x32.reshape(rows, n // w, w)
    amax_RX = jnp.max(jnp.abs(x_RXW), axis=-1)
    scale_RX = jnp.where(amax_RX > 0, amax_RX / E4M3_MAX, 1.0)
    q = (x_RXW / scale_RX[..., None]).astype(FP8).reshape(rows, n)
    return jnp.moveaxis(q, -1, axis), jnp.moveaxis(scale_RX, -1, axis)


def quantize_blocks(w_KN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """e4m3 values of a weight and float32 scales per 128×128 block [X, Y]."""
    k, n = w_KN.shape
    bk, bn = chunk_width(k), chunk_width(n)
    w_XBYC = w_KN.astype(jnp.float32).reshape(k // bk, bk, n // bn, bn)
    amax_XY = jnp.max(jnp.abs(w_XBYC), axis=(1, 3))
    scale_XY = jnp.where(amax_XY > 0, amax_XY / E4M3_MAX, 1.0)
    q = (w_XBYC / scale_XY[:, None, :, None]).astype(FP8).reshape(k, n)
    return q, scale_XY


def block_scales_per_column(scale_XY: jax.Array, n: int) -> jax.Array:
    """A weight's block scales as one scale per (K chunk, output column) [X, N]."""
    return jnp.repeat(scale_XY, n // scale_XY.shape[1], axis=1)


def scaled_matmul(q_MK: jax.Array, scale_MX: jax.Array, q_KN: jax.Array,
                  scale_XN: jax.Array) -> jax.Array:
    """float32 Σ over K chunks of (the chunk's e4m3 product, exact in float32) × both
    operands' scales for that chunk [M, N]."""
    m, k = q_MK.shape
    w = k // scale_MX.shape[1]
    q_MXW = q_MK.astype(jnp.float32).reshape(m, k // w, w)
    q_XWN = q_KN.astype(jnp.float32).reshape(k // w, w, -1)
    partial_XMN = jnp.einsum("mxw,xwn->xmn", q_MXW, q_XWN,
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    return jnp.einsum("xmn,mx,xn->mn", partial_XMN, scale_MX, scale_XN,
                      precision=jax.lax.Precision.HIGHEST)


@jax.custom_vjp
def fp8_matmul(x_MK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """x · w with both operands in e4m3 (x in 1×128 tiles, w in 128×128 blocks), FP32
    accumulation, the result in x's dtype; the backward's two GEMMs in e4m3 too."""
    return _forward(x_MK, w_KN)[0]


def _forward(x_MK, w_KN):
    qx_MK, sx_MX = quantize_along(x_MK, axis=1)
    qw_KN, sw_XY = quantize_blocks(w_KN)
    out_MN = scaled_matmul(qx_MK, sx_MX, qw_KN, block_scales_per_column(sw_XY, w_KN.shape[1]))
    # (an empty array carries w's dtype: residuals must be arrays)
    return out_MN.astype(x_MK.dtype), (x_MK, qw_KN, sw_XY, jnp.zeros((0,), w_KN.dtype))


def _backward(saved, g_MN):
    x_MK, qw_KN, sw_XY, w_dtype_0 = saved
    # dX = dY · Wᵀ: contraction over N, dY tiles along N, W's blocks transposed
    qg_MN, sg_MY = quantize_along(g_MN, axis=1)
    dx_MK = scaled_matmul(qg_MN, sg_MY, qw_KN.T,
                          block_scales_per_column(sw_XY.T, qw_KN.shape[0]))
    # dW = Xᵀ · dY: contraction over M, both re-quantized in 128×1 tiles along M
    qx_MK, sx_XK = quantize_along(x_MK, axis=0)
    qg_cols_MN, sg_XN = quantize_along(g_MN, axis=0)
    dw_KN = scaled_matmul(qx_MK.T, sx_XK.T, qg_cols_MN, sg_XN)
    return dx_MK.astype(x_MK.dtype), dw_KN.astype(w_dtype_0.dtype)


fp8_matmul.defvjp(_forward, _backward)
