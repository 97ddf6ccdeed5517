"""Token rows in FP8 for the MoE dispatch (`comm.expert_exchange_dtype: fp8`).

DeepSeek-V3 (arXiv 2412.19437, §3.3) dispatches the tokens to their experts in FP8 and
combines the experts' outputs in BF16. Here a row is cut in tiles of `TILE` values (1×128,
its activation tiles; the whole row when the width is smaller), each tile scaled by its
largest magnitude onto e4m3's range (448) and sent as e4m3 with a float32 scale: 1 byte
per value + 4 per 128, against BF16's 2. The received row is the tile × its scale in the
compute dtype — what the expert GEMMs take. Rounding to e4m3 keeps 3 mantissa bits: a
value moves by at most 2⁻⁴ of itself (half a step), or by half e4m3's smallest subnormal
step (2⁻¹⁰) × the scale near zero (`error_bound`).

The dispatch's gradient is straight through the rounding: its backward exchange carries the
rows' gradients back in BF16, the combine's reverse.

Shape suffixes (europa_jax/__init__.py): T tokens (or rows), D width, K tiles of a row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TILE = 128
E4M3_MAX = 448.0
FP8 = jnp.float8_e4m3fn


def tile_width(d: int) -> int:
    """The tile a row of width `d` is cut in: 128, or the whole row when narrower or when
    128 does not divide it (the test models)."""
    return TILE if d % TILE == 0 else d


def quantize(x_TD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(e4m3 rows [T, D], float32 scales [T, K]): each tile over its scale."""
    t, d = x_TD.shape
    w = tile_width(d)
    x_TKW = x_TD.astype(jnp.float32).reshape(t, d // w, w)
    amax_TK = jnp.max(jnp.abs(x_TKW), axis=-1)
    scale_TK = jnp.where(amax_TK > 0, amax_TK / E4M3_MAX, 1.0)
    q_TKW = (x_TKW / scale_TK[..., None]).astype(FP8)
    return q_TKW.reshape(t, d), scale_TK


def dequantize(q_TD: jax.Array, scale_TK: jax.Array, dtype) -> jax.Array:
    """The rows `quantize` stood for, in `dtype`."""
    t, d = q_TD.shape
    w = tile_width(d)
    x_TKW = q_TD.astype(jnp.float32).reshape(t, d // w, w) * scale_TK[..., None]
    return x_TKW.reshape(t, d).astype(dtype)


def error_bound(x_TD: jax.Array) -> jax.Array:
    """The largest |dequantize(quantize(x)) − x| e4m3 allows per value [T, D]: half a step
    of 3 mantissa bits (2⁻⁴ · |x|), or half the smallest subnormal step (2⁻¹⁰) × the tile's
    scale for values that land below e4m3's normals."""
    t, d = x_TD.shape
    w = tile_width(d)
    _, scale_TK = quantize(x_TD)
    floor_TD = jnp.repeat(scale_TK * 2.0**-10, w, axis=1)
    return jnp.maximum(jnp.abs(x_TD.astype(jnp.float32)) * 2.0**-4, floor_TD)
