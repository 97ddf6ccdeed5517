"""The model's weight GEMMs in FP8 (`execution.fp8_gemms`, `execution.fp8_expert_gemms`).

Each GEMM `y = x · w` and both of its backward GEMMs (`dx = dy · wᵀ`, `dw = xᵀ · dy`) take
operands rounded to FP8 and scaled back ("quantize-dequantize"), with the scales of a mode:

- `tensor`: one power-of-two scale per operand and GEMM, from the operand's own largest
  magnitude (current scaling); activations and weights in e4m3, gradients in e5m2 (their
  range is wider: Transformer Engine's "hybrid" format). This is the scaling XLA's GPU
  compiler runs as a cuBLASLt FP8 GEMM on Hopper: its rewrite matches a dot whose operands
  are `convert(f8) × scalar scale` and emits `__cublas$lt$matmul$f8` with the two scales as
  arguments (scalar scales only; tests/test_fp8_linear.py compiles it for GH200). A power
  of two makes the dequantized operand exact in any float dtype, so the CPU computes the
  GPU's operands bit for bit (the sums' order differs).
- `block`: DeepSeek-V3's fine-grained scales (arXiv 2412.19437 §3.3; model/fp8/fp8_gemm.py):
  e4m3 everywhere, 1×128 tiles along each GEMM's contraction for activations and
  gradients, 128×128 blocks for weights, FP32 products. Emulated: the operands dequantized
  in float32 and multiplied at full float32 precision, which equals fp8_gemm.fp8_matmul's
  chunk-by-chunk FP32 promotion up to float32 rounding. No library GEMM on Hopper takes
  these scales, so on a GPU this mode is a numerics study, slower than BF16.

The forward keeps x and w (unquantized) for the backward, which quantizes each operand
along the contraction of the GEMM it enters. The product comes back in w's dtype (the
compute dtype; x is cast to it first).
Shape suffixes (europa_jax/__init__.py): M rows, K contraction, N outputs.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp

from europa_jax.model.fp8 import fp8_gemm

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0}


# ----------------------------------------------------------------------------- rounding


def _tensor_qdq(x: jax.Array, fmt, dtype) -> jax.Array:
    """x rounded to `fmt` under one power-of-two scale, in `dtype` (written as XLA's FP8
    GEMM rewrite matches it: convert(f8) × the scale, both in the GEMM's input dtype).

    All in x's own dtype: dividing by a power of two is exact there, so the one rounding
    is to `fmt`, as from float32, and no float32 copy of the operand is made.
    """
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    fmax = FORMAT_MAX[fmt]
    # the smallest power of two that brings amax inside the format (doubled where log2
    # rounded down: e4m3fn has no infinity, past 448 is NaN) — scalar work, so the
    # operand's own pass is one divide and convert, which XLA fuses
    scale = jnp.where(amax > 0, jnp.exp2(jnp.ceil(jnp.log2(amax / fmax))), 1.0)
    scale = jnp.where(amax / scale > fmax, 2 * scale, scale)
    # The e4m3/e5m2 values are what is kept (1 byte each) for the GEMMs that take them
    # (a gradient's two, in two layouts): without the barrier XLA kept float32 quotients
    # instead, and europa-952b's HBM peak was 96.8 GB, not 87.2 (docs/open-questions.md).
    q = jax.lax.optimization_barrier((x / scale.astype(x.dtype)).astype(fmt))
    return q.astype(dtype) * scale.astype(dtype)


def _block_qdq_along(x_2d: jax.Array, axis: int) -> jax.Array:
    """x (2-D) in e4m3 with a scale per 128 values along `axis`, dequantized in float32."""
    q, scale = fp8_gemm.quantize_along(x_2d, axis)
    width = fp8_gemm.chunk_width(x_2d.shape[axis])
    return q.astype(jnp.float32) * jnp.repeat(scale, width, axis=axis)


def _block_qdq_weight(w_KN: jax.Array) -> jax.Array:
    q, scale_XY = fp8_gemm.quantize_blocks(w_KN)
    k, n = w_KN.shape
    scale_KN = jnp.repeat(jnp.repeat(scale_XY, k // scale_XY.shape[0], axis=0),
                          n // scale_XY.shape[1], axis=1)
    return q.astype(jnp.float32) * scale_KN


def _rounded(x_2d: jax.Array, mode: str, role: str, axis: int) -> jax.Array:
    """An operand as its GEMM takes it: `role` activation/weight/gradient, `axis` the
    GEMM's contraction (the tiles run along it)."""
    if mode == "tensor":
        return _tensor_qdq(x_2d, E5M2 if role == "gradient" else E4M3, x_2d.dtype)
    if role == "weight":
        return _block_qdq_weight(x_2d)
    return _block_qdq_along(x_2d, axis)


def _product(a_MK: jax.Array, b_KN: jax.Array, mode: str, dtype) -> jax.Array:
    if mode == "tensor":
        return jnp.matmul(a_MK, b_KN).astype(dtype)
    return jnp.matmul(a_MK, b_KN, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32).astype(dtype)


# ------------------------------------------------------------------- the three GEMMs


def forward(x_MK: jax.Array, w_KN: jax.Array, mode: str) -> jax.Array:
    """y = x · w [M, N] in x's dtype."""
    return _product(_rounded(x_MK, mode, "activation", 1),
                    _rounded(w_KN.astype(x_MK.dtype), mode, "weight", 0), mode, x_MK.dtype)


def grad_input(g_MN: jax.Array, w_KN: jax.Array, mode: str) -> jax.Array:
    """dx = dy · wᵀ [M, K]: dy's tiles along N (this GEMM's contraction), w's blocks as
    the forward's, transposed."""
    w_KN = w_KN.astype(g_MN.dtype)
    return _product(_rounded(g_MN, mode, "gradient", 1),
                    _rounded(w_KN, mode, "weight", 0).T, mode, g_MN.dtype)


def grad_weight(x_MK: jax.Array, g_MN: jax.Array, mode: str) -> jax.Array:
    """dw = xᵀ · dy [K, N]: both re-quantized in tiles along M, the tokens this GEMM
    contracts ("transposed re-quantization")."""
    g_MN = g_MN.astype(x_MK.dtype)
    return _product(_rounded(x_MK, mode, "activation", 0).T,
                    _rounded(g_MN, mode, "gradient", 0), mode, x_MK.dtype)


def matmul(x_AK: jax.Array, w_KN: jax.Array, mode: str) -> jax.Array:
    """`x @ w` for x [..., K], with all three GEMMs in FP8 under `mode` ("none": `x @ w`
    itself, the program unchanged)."""
    if mode == "none":
        return x_AK @ w_KN
    y_MN = _fp8_matmul(x_AK.reshape(-1, x_AK.shape[-1]), w_KN, mode)
    return y_MN.reshape(*x_AK.shape[:-1], w_KN.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(x_MK: jax.Array, w_KN: jax.Array, mode: str) -> jax.Array:
    return _fp8_matmul_fwd(x_MK, w_KN, mode)[0]


def _fp8_matmul_fwd(x_MK, w_KN, mode):
    # Operands and result in the weight's (compute) dtype, as a cuBLASLt FP8 GEMM writes
    # BF16: FP8 keeps 3 mantissa bits of a float32 input as of a bf16 one, and a float32
    # result (what x · w gives for a float32 x) would bring a float32 gradient back.
    x_c_MK = x_MK.astype(w_KN.dtype)
    # (an empty array carries x's dtype: residuals must be arrays)
    return forward(x_c_MK, w_KN, mode), (x_c_MK, w_KN, jnp.zeros((0,), x_MK.dtype))


def _fp8_matmul_bwd(mode, saved, g_MN):
    x_c_MK, w_KN, x_dtype_0 = saved
    g_MN = g_MN.astype(w_KN.dtype)  # so is the gradient (see _fp8_matmul_fwd)
    return (grad_input(g_MN, w_KN, mode).astype(x_dtype_0.dtype),
            grad_weight(x_c_MK, g_MN, mode).astype(w_KN.dtype))


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


# ------------------------------------------------------------------------- call sites


def matmuls_of_one_input(x_AK: jax.Array, ws_KN: tuple[jax.Array, ...], mode: str):
    """`x @ w` for each w, in FP8 as one GEMM of the weights side by side [K, ΣN].

    XLA merges two GEMMs that share an operand into one of the other operands concatenated
    (its dot merger); in FP8 that concatenation of two differently scaled weights is no
    longer `convert(f8) × scale`, and the merged GEMM would run in BF16. Joined here, the
    weights share one scale and the GEMM is one FP8 call (SwiGLU's gate and up; MLA's q
    and kv down-projections).
    """
    if mode == "none":
        return tuple(x_AK @ w_KN for w_KN in ws_KN)
    y_AN = matmul(x_AK, jnp.concatenate(ws_KN, axis=1), mode)
    ends = list(itertools.accumulate(w.shape[1] for w in ws_KN))
    return tuple(jnp.split(y_AN, ends[:-1], axis=-1))


def einsum(spec: str, x: jax.Array, w: jax.Array, mode: str) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a weight GEMM, in FP8 under `mode`.

    The spec must contract x's trailing dimensions with w's leading ones in the same order
    and keep x's leading then w's trailing ones ("bsd,df->bsf", "bsho,hod->bsd"): the
    GEMM is then [rows, K] · [K, N] of reshaped operands. Mode "none" is jnp.einsum
    itself, the program unchanged.
    """
    if mode == "none":
        return jnp.einsum(spec, x, w)
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    contracted = "".join(c for c in xs if c in ws and c not in out)
    n = len(contracted)
    if not (n and xs.endswith(contracted) and ws.startswith(contracted)
            and out == xs[:-n] + ws[n:]):
        raise ValueError(f"fp8_linear.einsum: {spec!r} is not x[..., K] · w[K, ...]")
    k = math.prod(x.shape[-n:])
    y_MN = _fp8_matmul(x.reshape(-1, k), w.reshape(k, -1), mode)
    return y_MN.reshape(*x.shape[:-n], *w.shape[n:])
