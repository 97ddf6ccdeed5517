"""RoPE/YaRN and RMSNorm."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from europa_jax.config import RopeScalingConfig
from europa_jax.model.layers import apply_rope, rope_inv_freq, rope_tables, yarn_mscale


def test_rope_scores_depend_only_on_relative_position(tiny_cfg):
    cfg = tiny_cfg.model
    p = cfg.qk_rope_head_dim
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, p))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, p))

    def score(m, n):
        cos_q, sin_q = rope_tables(jnp.array([[m]]), cfg)
        cos_k, sin_k = rope_tables(jnp.array([[n]]), cfg)
        return float(jnp.sum(apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)))

    np.testing.assert_allclose(score(5, 2), score(103, 100), rtol=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-4


def test_rope_rotates_interleaved_pairs():
    x = jnp.arange(8.0).reshape(1, 1, 1, 8)
    angle = jnp.full((1, 1, 4), math.pi / 2)
    out = apply_rope(x, jnp.cos(angle), jnp.sin(angle))
    # A quarter turn maps each pair (a, b) to (-b, a).
    np.testing.assert_allclose(out.reshape(-1), [-1, 0, -3, 2, -5, 4, -7, 6], atol=1e-6)


def test_yarn_keeps_high_and_scales_low_frequencies():
    scaling = RopeScalingConfig(type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                beta_fast=32.0, beta_slow=1.0)
    base, _ = rope_inv_freq(64, 10000.0, RopeScalingConfig())
    yarn, magnitude = rope_inv_freq(64, 10000.0, scaling)
    np.testing.assert_allclose(yarn[:4], base[:4], rtol=1e-6)  # many rotations: unchanged
    np.testing.assert_allclose(yarn[-4:], base[-4:] / 32.0, rtol=1e-6)  # few: interpolated
    assert np.all(np.diff(np.asarray(yarn / base)) <= 1e-7)  # a monotone ramp between
    assert magnitude == 1.0  # mscale == mscale_all_dim: DeepSeek-V3 puts it in the softmax
    assert math.isclose(yarn_mscale(32.0, 1.0), 0.1 * math.log(32.0) + 1.0)


def test_yarn_attention_factor_when_mscales_differ():
    scaling = RopeScalingConfig(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.707)
    _, magnitude = rope_inv_freq(64, 10000.0, scaling)
    assert math.isclose(magnitude, yarn_mscale(40.0, 1.0) / yarn_mscale(40.0, 0.707))


def test_rope_tables_follow_positions_not_token_index(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg.model)
    cos_a, _ = rope_tables(jnp.array([[0, 1, 2, 0, 1]]), cfg)
    np.testing.assert_array_equal(cos_a[0, 3], cos_a[0, 0])
