"""Building blocks shared by attention and MLPs: parameters, RMSNorm, RoPE/YaRN, SwiGLU.

Shape suffixes: the project's legend (europa_jax/__init__.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from europa_jax import param_table
from europa_jax.config import ExecutionConfig, ModelConfig, RopeScalingConfig
from europa_jax.model.fp8 import fp8_linear
from europa_jax.parallel import comm, layout

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# Set while a layer runs its rows one at a time (row_loop.py): its parameters arrive
# already gathered, and `weight` neither gathers them again nor expects a shard.
_GATHERED: contextvars.ContextVar[bool] = contextvars.ContextVar("gathered", default=False)


@contextlib.contextmanager
def weights_gathered():
    token = _GATHERED.set(True)
    try:
        yield
    finally:
        _GATHERED.reset(token)


def gathered_shape(on_mesh: layout.ParamLayout) -> tuple[int, ...]:
    """The shape `comm.gather_weight` gives a shard of this layout: the gathered dims
    whole (the stored shape, padding included), the kept expert sharding still split."""
    ctx = comm.current()
    shape = list(on_mesh.local_shape)
    for dim, axes in on_mesh.gather:
        shape[dim] *= math.prod(ctx.mesh_shape[a] for a in axes)
    return tuple(shape)


def unsharded(cfg: ModelConfig, ex: ExecutionConfig) -> layout.Layout:
    """Every parameter's layout outside an SPMD step (no mesh; storage padding kept)."""
    return layout.for_mesh(cfg, pad_multiple=ex.param_pad_multiple)


def ready_to_compute(w_local: jax.Array, role: str, cfg: ModelConfig,
                     ex: ExecutionConfig) -> jax.Array:
    """A stored shard gathered for this layer, in its compute dtype (padding kept)."""
    ctx = comm.current()
    row = param_table.row(role)
    on_mesh = (ctx.layout if ctx else unsharded(cfg, ex))[role]
    compute = jnp.float32 if row.precision.float32_compute else DTYPES[ex.compute_dtype]
    return comm.gather_weight(w_local, on_mesh.gather, compute, min_wire=row.precision.wire)


def weight(module: nn.Module, name: str) -> jax.Array:
    """The parameter `name` of `module`, returned ready to compute with.

    Everything about it but its use comes from its row in the parameter table (param_table.py),
    found by its role (`role_of`): shape, logical axes, init, precision. The stored
    parameter (float32 master, in the layout of the SPMD context's mesh, layout.py) is
    gathered to its full shape for this layer by `comm.gather_weight` — FSDP, in
    fp8/bf16/fp32 as configured — and cast to the compute dtype (float32 where the table
    says so). Outside the SPMD step it is only cast.
    """
    cfg: ModelConfig = module.cfg
    ex: ExecutionConfig = module.ex
    role = role_of(module, name)
    row = param_table.row(role)
    ctx = comm.current()
    on_mesh = (ctx.layout if ctx else unsharded(cfg, ex))[role]
    initializer = {"normal": nn.initializers.normal(cfg.init_std),
                   "ones": nn.initializers.ones}[row.init]
    if on_mesh.stored_shape != on_mesh.model_shape:  # the padding is zeros; the rest as if unpadded
        initializer = _zero_padded(initializer, on_mesh.model_shape, on_mesh.stored_shape)
    if _GATHERED.get():  # gathered by the layer's row loop, once for all its rows
        w = module.param(name, initializer, gathered_shape(on_mesh), DTYPES[cfg.param_dtype])
    else:
        # Under SPMD the module sees its shard; Flax checks the stored shape against this.
        w = module.param(name, initializer, on_mesh.local_shape, DTYPES[cfg.param_dtype])
        w = ready_to_compute(w, role, cfg, ex)
    if on_mesh.stored_shape != on_mesh.model_shape:  # padded dims are gathered whole: drop it
        w = w[tuple(slice(0, n) for n in on_mesh.model_shape)]
    return w


def role_of(module: nn.Module, name: str) -> str:
    """A parameter's role in the table (param_table.py): its path inside a decoder block
    (`attention.w_q_b`) or, for the model's own parameters, inside the model.

    The path is read up to the nearest block or model (classes marked `ROLE_ROOT`); a
    block component used on its own (tests) starts the path with its `ROLE` instead.
    """
    names = [name]
    while not getattr(module, "ROLE_ROOT", False):
        if not isinstance(module.parent, nn.Module):  # a component used on its own
            names.append(type(module).ROLE)
            break
        names.append(module.name)
        module = module.parent
    return ".".join(reversed(names))


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
    ex: ExecutionConfig

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        scale_D = weight(self, "scale")
        x32_BSD = x_BSD.astype(jnp.float32)
        var_BS1 = jnp.mean(jnp.square(x32_BSD), axis=-1, keepdims=True)
        y_BSD = x32_BSD * jax.lax.rsqrt(var_BS1 + self.cfg.rms_norm_eps)
        return (scale_D * y_BSD).astype(x_BSD.dtype)


class SwiGLU(nn.Module):
    """Gated MLP (Shazeer 2020): down(silu(x·gate) ⊙ x·up). Dense layers and the shared expert."""

    ROLE = "mlp"  # used on its own: a dense layer's MLP
    cfg: ModelConfig
    ex: ExecutionConfig

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        w_gate_DF = weight(self, "w_gate")
        w_up_DF = weight(self, "w_up")
        w_down_FD = weight(self, "w_down")
        fp8 = self.ex.fp8_gemms
        if fp8 == "none":
            gate_BSF = jnp.einsum("bsd,df->bsf", x_BSD, w_gate_DF)
            up_BSF = jnp.einsum("bsd,df->bsf", x_BSD, w_up_DF)
            return jnp.einsum("bsf,fd->bsd", nn.silu(gate_BSF) * up_BSF, w_down_FD)
        gate_BSF, up_BSF = fp8_linear.matmuls_of_one_input(x_BSD, (w_gate_DF, w_up_DF), fp8)
        return fp8_linear.matmul(nn.silu(gate_BSF) * up_BSF, w_down_FD, fp8)


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
