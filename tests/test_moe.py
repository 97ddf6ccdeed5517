"""Router invariants and the MoE layer against a dense per-token reference."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.config import ExecutionConfig
from europa_jax.model import kernels
from europa_jax.model.experts.expert_matmul import compute_local_experts, grouped_swiglu
from europa_jax.model.experts import moe_dispatch
from europa_jax.model.experts.moe import MoE, route
from europa_jax.model.experts.moe_dispatch import Layout
from europa_jax.parallel.comm import ExpertAxis


@pytest.fixture
def moe_cfg(tiny_cfg):
    return dataclasses.replace(tiny_cfg.model, n_routed_experts=16, top_k=4, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5)


def test_router_picks_k_distinct_experts_inside_topk_groups(moe_cfg):
    logits = jax.random.normal(jax.random.key(0), (256, 16))
    bias = jax.random.normal(jax.random.key(1), (16,)) * 0.1
    weights, experts = route(logits, bias, moe_cfg)
    experts = np.asarray(experts)
    assert experts.shape == (256, 4)
    assert all(len(set(row)) == 4 for row in experts)
    groups = experts // (16 // moe_cfg.n_group)
    assert all(len(set(row)) <= moe_cfg.topk_group for row in groups)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 2.5, rtol=1e-5)


def test_router_group_choice_uses_top2_sum(moe_cfg):
    # Group 0 has one huge expert, group 1 two good ones: sum-of-top-2 prefers group 1.
    cfg = dataclasses.replace(moe_cfg, topk_group=1, top_k=2)
    logits = jnp.full((1, 16), -5.0).at[0, 0].set(5.0).at[0, 4].set(2.0).at[0, 5].set(2.0)
    _, experts = route(logits, jnp.zeros(16), cfg)
    assert set(np.asarray(experts[0])) == {4, 5}


def test_bias_changes_selection_not_gate_weights(moe_cfg):
    cfg = dataclasses.replace(moe_cfg, n_group=1, topk_group=1)
    logits = jax.random.normal(jax.random.key(2), (64, 16))
    w0, e0 = route(logits, jnp.zeros(16), cfg)
    bias = jnp.zeros(16).at[3].set(10.0)  # force expert 3 into every selection
    w1, e1 = route(logits, bias, cfg)
    assert np.all(np.any(np.asarray(e1) == 3, axis=1))
    assert not np.array_equal(np.asarray(e0), np.asarray(e1))
    # Gate weights are the *unbiased* sigmoid scores of the chosen experts, normalized.
    scores = jax.nn.sigmoid(logits)
    chosen = jnp.take_along_axis(scores, e1, axis=-1)
    np.testing.assert_allclose(w1, chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-5)


def dense_reference(params, x_BSD, bias_E, cfg, keep_TU=None):
    """Every token through its chosen experts one by one: no sorting, no grouping.
    `keep_TU` [T, U] bool: only these copies (a capacity's dropped ones left out)."""
    x_TD = x_BSD.reshape(-1, cfg.d_model)
    weights_TU, experts_TU = route(x_TD @ params["w_router"], bias_E, cfg)
    if keep_TU is not None:
        weights_TU = jnp.where(keep_TU, weights_TU, 0.0)

    def expert(e, x_D):
        h = jax.nn.silu(x_D @ params["w_gate"][e]) * (x_D @ params["w_up"][e])
        return h @ params["w_down"][e]

    def token(x_D, w_U, e_U):
        return sum(w_U[j] * expert(e_U[j], x_D) for j in range(cfg.top_k))

    routed = jax.vmap(token)(x_TD, weights_TU, experts_TU)
    s = params["shared"]
    shared = (jax.nn.silu(x_TD @ s["w_gate"]) * (x_TD @ s["w_up"])) @ s["w_down"]
    return (routed + shared).reshape(x_BSD.shape)


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot", "tokamax"])
def test_moe_equals_dense_reference(moe_cfg, impl):
    """tokamax: the GPU default's call, here on tokamax's XLA fallback (its Mosaic GPU kernel
    is compiled for a GH200 in test_gpu_target.py)."""
    if impl == "tokamax" and not kernels.tokamax_available():
        pytest.skip("tokamax (the gpu extra) is not installed")
    cfg = moe_cfg
    ex = ExecutionConfig(compute_dtype="float32", grouped_matmul=impl)
    x = jax.random.normal(jax.random.key(3), (2, 32, cfg.d_model))
    bias = jax.random.normal(jax.random.key(4), (16,)) * 0.01
    moe = MoE(cfg, ex)
    params = jax.tree.map(lambda p: p * 10, moe.init(jax.random.key(5), x, bias)["params"])
    params = jax.tree.map(lambda b: b.unbox() if hasattr(b, "unbox") else b, params,
                          is_leaf=lambda b: hasattr(b, "unbox"))
    out, stats = moe.apply({"params": params}, x, bias)
    np.testing.assert_allclose(out, dense_reference(params, x, bias, cfg), rtol=2e-5, atol=2e-5)
    assert int(stats["processed_copies"]) == 2 * 32 * cfg.top_k  # dropless
    g = jax.grad(lambda p: jnp.sum(jnp.sin(moe.apply({"params": p}, x, bias)[0])))(params)
    g_ref = jax.grad(lambda p: jnp.sum(jnp.sin(dense_reference(p, x, bias, cfg))))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("assignment", ["random", "all_to_one", "empty_experts"])
def test_blocked_grouped_matmul_equals_ragged_dot(assignment):
    m, d, f, e = 96, 8, 6, 5
    rng = np.random.default_rng(0)
    sizes = {"random": rng.multinomial(m, np.ones(e) / e),
             "all_to_one": np.eye(e, dtype=int)[2] * m,
             "empty_experts": np.array([0, 50, 0, 46, 0])}[assignment]
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    w1, w2 = (jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32) for _ in range(2))
    w3 = jnp.asarray(rng.normal(size=(e, f, d)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    ref = grouped_swiglu(x, w1, w2, w3, sizes, impl="ragged_dot")
    out = grouped_swiglu(x, w1, w2, w3, sizes, impl="blocked", block_rows=16)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    if assignment == "empty_experts":  # rows past sum(sizes) are zeros in both
        short = sizes.at[3].set(40)
        out = grouped_swiglu(x, w1, w2, w3, short, impl="blocked", block_rows=16)
        np.testing.assert_array_equal(out[90:], 0)
        np.testing.assert_allclose(out[:90], ref[:90], rtol=1e-5, atol=1e-5)


def test_layout_sends_one_row_per_destination_device():
    # 8 experts on 2 devices (4 each). Token 0 → experts 1, 2 (both device 0): one row.
    experts = jnp.asarray([[1, 2], [1, 5], [6, 7]])
    lay = Layout(experts, 4, 0, 3, ExpertAxis(2))
    assert np.asarray(lay.dest_TU).tolist() == [[0, 0], [0, 1], [1, 1]]
    assert np.asarray(lay.kept_TJ).tolist() == [[True, False], [True, True], [False, True]]
    # region j starts at j·capacity; rows fill it in token order; empty slots → token 3
    assert np.asarray(lay.token_S).tolist() == [0, 1, 3, 1, 2, 3]
    assert np.asarray(lay.send_counts_J).tolist() == [2, 2]
    assert np.asarray(Layout.rows_per_peer(experts, 4, 2)).tolist() == [2, 2]


def test_rows_past_the_capacity_go_in_the_next_round():
    experts = jnp.asarray([[0], [0], [0], [1]])
    lay = Layout(experts, 1, 0, 2, ExpertAxis(2))
    assert np.asarray(lay.kept_TJ[:, 0]).tolist() == [True, True, False, False]
    assert np.asarray(lay.token_S).tolist() == [0, 1, 3, 4]  # 4: empty
    assert np.asarray(Layout.rows_per_peer(experts, 1, 2)).tolist() == [3, 1]
    later = Layout(experts, 1, 2, 2, ExpertAxis(2))  # round 1: row numbers 2, 3
    assert np.asarray(later.kept_TJ).tolist() == [[False, False], [False, False],
                                                  [True, False], [False, False]]
    assert np.asarray(later.token_S).tolist() == [2, 4, 4, 4]  # the third row opens it


@pytest.mark.parametrize("n_group,topk_group,expected", [(1, 1, 4 * (1 - 495 / 1820)),
                                                         (4, 2, 2.0), (4, 1, 1.0)])
def test_exchange_capacity_from_the_expected_destinations(moe_cfg, n_group, topk_group,
                                                          expected):
    # 16 experts top-4 on 4 devices: uniform k-of-E, or whole-device groups
    cfg = dataclasses.replace(moe_cfg, n_group=n_group, topk_group=topk_group)
    assert moe_dispatch.expected_destinations(cfg, 4) == pytest.approx(expected)
    ex = ExecutionConfig()
    capacity, drops = moe_dispatch.exchange_capacity(64, cfg, ex, 4)
    assert capacity == min(64, int(np.ceil(ex.moe_buffer_factor * 64 * expected / 4)))
    assert not drops and moe_dispatch.exchange_capacity(64, cfg, ex, 1) == (64, False)
    assert moe_dispatch.exchange_capacity(
        64, dataclasses.replace(cfg, moe_capacity_factor=0.5), ex, 4) == (32, True)


def test_compute_local_experts_ignores_rows_without_local_experts():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    w1, w2 = (jnp.asarray(rng.normal(size=(3, 8, 5)), jnp.float32) for _ in range(2))
    w3 = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    experts = jnp.asarray([[0, 2], [-1, -1], [1, -1], [2, 2]])
    weights = jnp.asarray([[0.5, 0.25], [9.0, 9.0], [2.0, 9.0], [1.0, 1.0]])
    y, sizes = compute_local_experts(x, experts, weights, w1, w2, w3, impl="blocked")

    def expert(e, v):
        return (jax.nn.silu(v @ w1[e]) * (v @ w2[e])) @ w3[e]

    np.testing.assert_allclose(y[0], 0.5 * expert(0, x[0]) + 0.25 * expert(2, x[0]), rtol=1e-5)
    np.testing.assert_array_equal(y[1], 0)
    np.testing.assert_allclose(y[2], 2.0 * expert(1, x[2]), rtol=1e-5)
    np.testing.assert_allclose(y[3], 2.0 * expert(2, x[3]), rtol=1e-5)
    assert np.asarray(sizes).tolist() == [1, 1, 3]


def test_blocked_backward_keeps_no_weight_copy_per_block():
    """Each block multiplies by one expert's matrix; the backward must re-index the
    weights, not save a [D, F] slice per block (that stack was ~0.5 TB per europa-952b
    MoE layer on 65,536 tokens)."""
    from europa_jax.plan.program import hlo_report

    e, d, f, m, rows = 4, 64, 512, 512, 8
    n_blocks = -(-(m + e * (rows - 1)) // rows)

    def loss(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD):
        sizes_E = jnp.array([100, 50, 200, 100], jnp.int32)
        return grouped_swiglu(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, sizes_E, impl="blocked",
                              block_rows=rows).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(1, 2, 3))).lower(
        jnp.ones((m, d)), jnp.ones((e, d, f)), jnp.ones((e, d, f)), jnp.ones((e, f, d))).compile()
    biggest = hlo_report.largest_buffers(compiled.as_text(), n=1)[0]
    assert biggest["bytes"] < n_blocks * d * f * 4 / 4, biggest


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [8, 16])
def test_chunked_moe_equals_one_dispatch(moe_cfg, chunk):
    """moe_chunk_tokens: same outputs, gradients and counts as dispatching every token at
    once, whatever the chunk."""
    cfg = moe_cfg
    ex = ExecutionConfig(compute_dtype="float32", grouped_matmul="blocked")
    x = jax.random.normal(jax.random.key(3), (2, 32, cfg.d_model))
    bias = jax.random.normal(jax.random.key(4), (16,)) * 0.01
    whole, chunked = MoE(cfg, ex), MoE(cfg, dataclasses.replace(ex, moe_chunk_tokens=chunk))
    params = nn.unbox(whole.init(jax.random.key(5), x, bias)["params"])
    params = jax.tree.map(lambda p: p * 10, params)
    (y, stats), (y_c, stats_c) = (m.apply({"params": params}, x, bias) for m in (whole, chunked))
    np.testing.assert_allclose(y_c, y, rtol=1e-5, atol=1e-6)
    for key in ("processed_copies", "routed_copies", "expert_counts_E"):
        np.testing.assert_array_equal(stats_c[key], stats[key])
    grad = lambda m: jax.grad(lambda p: jnp.sum(jnp.sin(m.apply({"params": p}, x, bias)[0])))(
        params)
    for a, b in zip(jax.tree.leaves(grad(chunked)), jax.tree.leaves(grad(whole))):
        # float32 sums over other chunks, in another order: to 1e-5 of the leaf's scale
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))
