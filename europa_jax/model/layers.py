"""Building blocks shared by attention and MLPs: parameters, RMSNorm, RoPE/YaRN, SwiGLU.

Shape legend: B batch, S sequence, D model width, F feed-forward width, H heads,
P rotary dims (P2 = P/2 frequency pairs).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from europa_jax.parallel import comm, sharding
from europa_jax.config import ModelConfig, RopeScalingConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def weight(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
           cfg: ModelConfig, *, init: str = "normal", dtype=None,
           min_wire: str = "fp8") -> jax.Array:
    """A parameter with logical axis names, returned ready to compute with.

    The stored parameter (fp32 master, sharded by sharding.py's rules) is gathered to
    its full shape for this layer by `comm.gather_weight` — FSDP, in fp8/bf16/fp32 as
    configured — and cast to `dtype` (default: the compute dtype). Outside the SPMD step
    it is only cast.
    """
    assert len(shape) == len(axes), (name, shape, axes)
    initializer = {"normal": nn.initializers.normal(cfg.init_std),
                   "ones": nn.initializers.ones, "zeros": nn.initializers.zeros}[init]
    stored = sharding.storage_shape(axes, shape, cfg.param_pad_multiple)
    if stored != tuple(shape):  # the padding is zeros; the rest as if unpadded
        initializer = _zero_padded(initializer, shape, stored)
    boxed_init = nn.with_logical_partitioning(initializer, axes)
    # Under SPMD the module sees its shard; Flax checks the stored shape against this.
    w = module.param(name, boxed_init, comm.local_shape(axes, stored), DTYPES[cfg.param_dtype])
    w = comm.gather_weight(w, axes, stored, dtype or DTYPES[cfg.compute_dtype],
                           min_wire=min_wire)
    if stored != tuple(shape):  # the padded dimension is gathered whole: drop the padding
        w = w[tuple(slice(0, n) if n != m else slice(None) for n, m in zip(shape, stored))]
    return w


def _zero_padded(initializer, shape, stored):
    def init(key, requested, dtype):
        if tuple(requested) != tuple(stored):  # a shard's shape (Flax checks it under SPMD)
            return initializer(key, requested, dtype)
        w = initializer(key, shape, dtype)
        return jnp.pad(w, [(0, m - n) for n, m in zip(shape, stored)])

    return init


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 like DeepSeek-V3's reference."""

    cfg: ModelConfig
    dim: int

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        scale_D = weight(self, "scale", (self.dim,), ("norm",), self.cfg, init="ones",
                         dtype=jnp.float32, min_wire="fp32")
        x32_BSD = x_BSD.astype(jnp.float32)
        var_BS1 = jnp.mean(jnp.square(x32_BSD), axis=-1, keepdims=True)
        y_BSD = x32_BSD * jax.lax.rsqrt(var_BS1 + self.cfg.rms_norm_eps)
        return (scale_D * y_BSD).astype(x_BSD.dtype)


class SwiGLU(nn.Module):
    """Gated MLP (Shazeer 2020): down(silu(x·gate) ⊙ x·up). Dense layers and the shared expert."""

    cfg: ModelConfig
    ffn_dim: int

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, x_BSD.dtype
        d, f = cfg.d_model, self.ffn_dim
        w_gate_DF = weight(self, "w_gate", (d, f), ("embed", "mlp"), cfg, dtype=dt)
        w_up_DF = weight(self, "w_up", (d, f), ("embed", "mlp"), cfg, dtype=dt)
        w_down_FD = weight(self, "w_down", (f, d), ("mlp", "embed"), cfg, dtype=dt)
        gate_BSF = jnp.einsum("bsd,df->bsf", x_BSD, w_gate_DF)
        up_BSF = jnp.einsum("bsd,df->bsf", x_BSD, w_up_DF)
        return jnp.einsum("bsf,fd->bsd", nn.silu(gate_BSF) * up_BSF, w_down_FD)


# ----------------------------------------------------------------------------- rotary


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1·m·ln(s) + 1 (Peng et al. 2023, eq. 22)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(rope_dim: int, theta: float, scaling: RopeScalingConfig) -> tuple[jax.Array, float]:
    """Per-pair inverse frequencies [P2] and the cos/sin magnitude (YaRN 'attention factor').

    YaRN keeps high-frequency pairs (many rotations within the original context)
    unchanged, divides low-frequency pairs by `factor`, and ramps linearly between,
    with the ramp ends from beta_fast/beta_slow rotations — the same formula as
    DeepSeek-V3's reference code and Hugging Face's `_compute_yarn_parameters`.
    """
    pos_freqs_P2 = theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim)
    extrapolation_P2 = 1.0 / pos_freqs_P2
    if scaling.type == "none":
        return extrapolation_P2, 1.0
    interpolation_P2 = 1.0 / (scaling.factor * pos_freqs_P2)

    def correction_dim(n_rotations: float) -> float:
        orig = scaling.original_max_position_embeddings
        return rope_dim * math.log(orig / (n_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), rope_dim - 1)
    high = high + 0.001 if low == high else high
    ramp_P2 = jnp.clip((jnp.arange(rope_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep_P2 = 1.0 - ramp_P2  # 1 → extrapolate (unchanged frequency), 0 → interpolate
    inv_freq_P2 = interpolation_P2 * (1 - keep_P2) + extrapolation_P2 * keep_P2
    attention_factor = (yarn_mscale(scaling.factor, scaling.mscale)
                        / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return inv_freq_P2, attention_factor


def rope_tables(positions_BS: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, S, P2] for each token's position inside its own document."""
    inv_freq_P2, magnitude = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles_BSP2 = positions_BS.astype(jnp.float32)[..., None] * inv_freq_P2
    return jnp.cos(angles_BSP2) * magnitude, jnp.sin(angles_BSP2) * magnitude


def apply_rope(x_BSHP: jax.Array, cos_BSP2: jax.Array, sin_BSP2: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by angle i.

    This is the pairing of DeepSeek-V3's checkpoints (`rope_interleave=True` in
    transformers), so exported q/k projections need no permutation.
    """
    x32 = x_BSHP.astype(jnp.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    cos, sin = cos_BSP2[:, :, None, :], sin_BSP2[:, :, None, :]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x_BSHP.shape).astype(x_BSHP.dtype)
