"""The cached decoder (model/decode.py): the prompt in one step, then one position per
step against multi-head latent attention's cache, gives the uncached forward's logits at
every position — dense and MoE layers, scanned or unrolled, float32 and bfloat16, layer
inputs read exact or as e4m3 copies — and
caches A + P numbers per token and layer. (Sampling with it: tests/test_sample.py.)"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import split_changes
from europa_jax.interop.sample import sampling_configs
from europa_jax.model.decode import CachedTransformer, LatentCache
from europa_jax.model.transformer import Transformer, init_router_bias

S = 96          # the row
PROMPT = 40     # positions the first step takes at once


def setup(tiny_cfg, **changes):
    """(the sampler's model and execution with `changes` as `cfg.model`, `cfg.execution`,
    parameters, router bias, a row of tokens, the uncached forward's logits of it)."""
    model_cfg, execution = split_changes(*sampling_configs(tiny_cfg), **changes)
    cfg = types.SimpleNamespace(model=model_cfg, execution=execution)
    tokens_1S = jax.random.randint(jax.random.key(1), (1, S), 0, cfg.model.vocab_size)
    # a router bias that moves choices, so routing differences would show
    bias_LE = 0.3 * jax.random.normal(jax.random.key(2), init_router_bias(cfg.model).shape)
    model = Transformer(cfg.model, cfg.execution)
    segments_1S, positions_1S = jnp.ones((1, S), jnp.int32), jnp.arange(S)[None]
    params = model.init(jax.random.key(0), tokens_1S, segments_1S, positions_1S,
                        bias_LE)["params"]
    full_1SV, _ = jax.jit(lambda p: model.apply({"params": p}, tokens_1S, segments_1S,
                                                positions_1S, bias_LE))(params)
    return cfg, params, bias_LE, tokens_1S, full_1SV


def cached_logits(cfg, params, bias_LE, tokens_1S, dtype):
    """The last position's logits after the prompt's step, then after each one-token step."""
    step = jax.jit(lambda p, t, c: CachedTransformer(cfg.model, cfg.execution).apply(
        {"params": p}, t, c, bias_LE))
    cache = LatentCache.empty(cfg.model, 1, S, dtype)
    logits_1V, cache = step(params, tokens_1S[:, :PROMPT], cache)
    out = [logits_1V]
    for i in range(PROMPT, S):
        logits_1V, cache = step(params, tokens_1S[:, i:i + 1], cache)
        out.append(logits_1V)
    return jnp.stack(out, axis=1), cache


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers, layer_input_format",
                         [(True, "compute_dtype"), (False, "compute_dtype"), (True, "e4m3")])
def test_every_step_gives_the_uncached_forward_s_logits(tiny_cfg, scan_layers,
                                                        layer_input_format):
    """(With `e4m3` the layers' branches read e4m3 copies of their inputs, rounded per
    position: the cached steps must round as the forward does.)"""
    cfg, params, bias_LE, tokens_1S, full_1SV = setup(tiny_cfg, scan_layers=scan_layers,
                                                      layer_input_format=layer_input_format)
    assert cfg.model.n_dense_layers and cfg.model.n_moe_layers
    got_1TV, cache = cached_logits(cfg, params, bias_LE, tokens_1S, jnp.float32)
    want_1TV = full_1SV[:, PROMPT - 1:]
    real = np.arange(full_1SV.shape[-1]) < cfg.model.vocab_size
    np.testing.assert_allclose(np.asarray(got_1TV)[..., real], np.asarray(want_1TV)[..., real],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(jnp.argmax(got_1TV, -1), jnp.argmax(want_1TV, -1))
    # what MLA caches: the latent and the shared RoPE key, per layer and position
    n_layers = cfg.model.n_dense_layers + cfg.model.n_moe_layers
    assert cache.latent_LBSA.shape == (n_layers, 1, S, cfg.model.kv_lora_rank)
    assert cache.k_rope_LBSP.shape == (n_layers, 1, S, cfg.model.qk_rope_head_dim)
    assert int(cache.length) == S


@pytest.mark.slow
def test_in_bfloat16_the_steps_stay_within_bfloat16_s_rounding(tiny_cfg):
    cfg, params, bias_LE, tokens_1S, full_1SV = setup(tiny_cfg, compute_dtype="bfloat16")
    got_1TV, _ = cached_logits(cfg, params, bias_LE, tokens_1S, jnp.bfloat16)
    want_1TV = full_1SV[:, PROMPT - 1:, :cfg.model.vocab_size]
    err = np.abs(np.asarray(got_1TV[..., :cfg.model.vocab_size]) - np.asarray(want_1TV)).max()
    assert err < 0.05 * float(np.abs(want_1TV).max())
    # the same choice wherever the uncached forward's top two are not within the error
    top2 = np.sort(np.asarray(want_1TV), -1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * err
    assert clear.mean() > 0.5
    np.testing.assert_array_equal(np.argmax(got_1TV, -1)[clear], np.argmax(want_1TV, -1)[clear])

