"""The whole model: shapes, scan == unrolled, causality and document isolation end to end."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.model.transformer import init_router_bias, Transformer


def inputs(cfg, b=2, s=32, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (b, s), 0, cfg.vocab_size)
    seg = np.ones((b, s), np.int32)
    seg[0, 12:] = 2
    pos = np.concatenate([np.arange(12), np.arange(s - 12)])[None].repeat(b, 0)
    pos[1] = np.arange(s)
    return tokens, jnp.asarray(seg), jnp.asarray(pos)


@pytest.fixture(scope="module")
def model_and_params(tiny_cfg):
    cfg = tiny_cfg.model
    model = Transformer(cfg, dataclasses.replace(tiny_cfg.execution, remat="none"))
    tokens, seg, pos = inputs(cfg)
    params = nn.unbox(model.init(jax.random.key(0), tokens, seg, pos,
                                 init_router_bias(cfg))["params"])
    return cfg, model, params


def test_shapes_and_padded_vocab(model_and_params):
    cfg, model, params = model_and_params
    tokens, seg, pos = inputs(cfg)
    logits, stats = model.apply({"params": params}, tokens, seg, pos, init_router_bias(cfg))
    assert logits.shape == (2, 32, cfg.padded_vocab_size) and logits.dtype == jnp.float32
    assert stats["expert_counts_E"].shape == (cfg.n_moe_layers, cfg.n_routed_experts)
    assert params["moe_layers"]["moe"]["w_gate"].shape == (
        cfg.n_moe_layers, cfg.n_routed_experts, cfg.d_model, cfg.expert_ffn_dim)
    assert np.all(np.asarray(logits[..., cfg.vocab_size:]) < -1e29)  # padding never predicted


def test_scanned_equals_unrolled(model_and_params):
    cfg, model, params = model_and_params
    tokens, seg, pos = inputs(cfg)
    bias = jax.random.normal(jax.random.key(1), (cfg.n_moe_layers, cfg.n_routed_experts)) * 0.01
    unrolled_ex = dataclasses.replace(model.ex, scan_layers=False)
    unrolled = {k: v for k, v in params.items() if not k.endswith("_layers")}
    for stack, n in (("dense_layers", cfg.n_dense_layers), ("moe_layers", cfg.n_moe_layers)):
        for i in range(n):
            unrolled[f"{stack}_{i}"] = jax.tree.map(lambda x: x[i], params[stack])
    out_scan, stats_scan = model.apply({"params": params}, tokens, seg, pos, bias)
    out_loop, stats_loop = Transformer(cfg, unrolled_ex).apply({"params": unrolled}, tokens,
                                                               seg, pos, bias)
    np.testing.assert_allclose(out_loop, out_scan, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(stats_loop["expert_counts_E"], stats_scan["expert_counts_E"])


def test_causal_no_gradient_from_future_tokens(model_and_params):
    cfg, model, params = model_and_params
    tokens, seg, pos = inputs(cfg)
    seg = jnp.ones_like(seg)
    pos = jnp.broadcast_to(jnp.arange(32), (2, 32))
    embed = params["embedding"]
    t = 9

    def logit_t(embedding):
        p = {**params, "embedding": embedding}
        return model.apply({"params": p}, tokens, seg, pos, init_router_bias(cfg))[0][:, t].sum()

    g = jax.grad(logit_t)(embed)
    future = np.setdiff1d(np.asarray(tokens[:, t + 1:]), np.asarray(tokens[:, :t + 1]))
    past = np.asarray(tokens[:, :t + 1]).ravel()
    assert np.all(np.asarray(g)[future] == 0)
    assert np.any(np.asarray(g)[past] != 0)


def test_changing_one_document_leaves_the_other_unchanged(model_and_params):
    cfg, model, params = model_and_params
    tokens, seg, pos = inputs(cfg)
    bias = init_router_bias(cfg)
    out, _ = model.apply({"params": params}, tokens, seg, pos, bias)
    tokens2 = tokens.at[0, 12:].set((tokens[0, 12:] + 7) % cfg.vocab_size)  # edit document 2
    out2, _ = model.apply({"params": params}, tokens2, seg, pos, bias)
    np.testing.assert_array_equal(np.asarray(out2[0, :12]), np.asarray(out[0, :12]))
    assert not np.allclose(out2[0, 12:], out[0, 12:])
    np.testing.assert_array_equal(np.asarray(out2[1]), np.asarray(out[1]))
