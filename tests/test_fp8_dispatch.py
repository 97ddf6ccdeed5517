"""The MoE dispatch in FP8 (`comm.expert_exchange_dtype: fp8`, parallel/fp8_rows.py): e4m3
tiles of 128 values with a float32 scale each, the combine and the backward in bf16."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from europa_jax.model.experts.moe_dispatch import Layout
from europa_jax.parallel import comm, fp8_rows
from europa_jax.plan.price import exchange
from europa_jax.plan.program import hlo_report
from test_comm import BATCH, _moe_fn, ctx_for, mesh, moe_setup  # noqa: F401 (mesh: a fixture)
from test_moe import dense_reference


def test_rows_round_trip_within_e4m3s_resolution():
    """Rows of very different sizes (a zero row, a tiny one, one with an outlier): each
    value within half a step of 3 mantissa bits of itself, or half the subnormal step of
    its tile near zero; a tile of 128 values has its own scale."""
    key = jax.random.key(0)
    x_TD = jax.random.normal(key, (6, 256)) * jnp.array([1, 0, 1e-6, 1e4, 1, 3.0])[:, None]
    x_TD = x_TD.at[4, 7].set(500.0)  # an outlier: its tile's scale, not the other tile's
    q_TD, scale_TK = fp8_rows.quantize(x_TD)
    assert q_TD.dtype == jnp.float8_e4m3fn and scale_TK.shape == (6, 2)
    back = fp8_rows.dequantize(q_TD, scale_TK, jnp.float32)
    err = np.abs(np.asarray(back - x_TD))
    assert (err <= np.asarray(fp8_rows.error_bound(x_TD)) * (1 + 1e-6)).all()
    assert err.max() > 0 and not np.asarray(back[1]).any()  # the zero row stays zero
    # the outlier's tile got a coarser scale; the row's other tile kept its own
    assert float(scale_TK[4, 0]) == pytest.approx(500 / 448) and scale_TK[4, 1] < 0.02
    assert fp8_rows.tile_width(7168) == 128 and fp8_rows.tile_width(32) == 32


def sent(mesh, ctx, x_TD, experts_TU, e_local=4):
    """Layout.sent_rows on the 2×4 mesh, and the gradient of Σ rows · w through it."""
    capacity = x_TD.shape[0] // 8 * 2  # each device's tokens, any peer may get them all

    def body(x_local, e_local_TU, w_local):
        with comm.spmd(ctx):
            axis = comm.expert_axis()
            lay = Layout(e_local_TU, e_local, 0, capacity, axis)
            rows = lay.sent_rows(x_local)
            return rows, comm.psum_all(jnp.sum(rows * w_local))

    f = jax.shard_map(body, mesh=mesh, in_specs=(BATCH, BATCH, BATCH),
                      out_specs=(BATCH, P()), check_vma=False)
    w = jax.random.normal(jax.random.key(9), (8 * 4 * capacity, x_TD.shape[1]))
    rows, _ = f(x_TD, experts_TU, w)
    grad = jax.grad(lambda x: f(x, experts_TU, w)[1])(x_TD)
    return np.asarray(rows), np.asarray(grad)


@pytest.mark.slow
def test_the_dispatch_sends_e4m3_rows_and_its_gradient_goes_straight_through(mesh, tiny_cfg):
    """The rows a peer receives under fp8 are exactly the fp32 exchange's rows of
    dequantize(quantize(x)); the gradient back to the tokens is the one the fp32 exchange
    gives (straight through the rounding, in bf16 on the wire)."""
    ctx = lambda wire: ctx_for(mesh, tiny_cfg.model, expert_exchange="ragged",
                               expert_exchange_dtype=wire)
    x_TD = jax.random.normal(jax.random.key(1), (64, 256)) * 3
    experts_TU = jax.random.randint(jax.random.key(2), (64, 2), 0, 16)
    fp8_rows_, fp8_grad = sent(mesh, ctx("fp8"), x_TD, experts_TU)
    rounded = fp8_rows.dequantize(*fp8_rows.quantize(x_TD), jnp.float32)
    exact_rows, exact_grad = sent(mesh, ctx("fp32"), rounded, experts_TU)
    received = np.abs(exact_rows).sum(axis=1) > 0
    assert received.sum() > 32  # the test sends something
    np.testing.assert_array_equal(fp8_rows_[received], exact_rows[received])
    # the cotangent goes back in bf16: the fp32 exchange's gradient to bf16's resolution
    # (a token sums its rows' rounded cotangents: the bound is on the terms, not the sum)
    np.testing.assert_allclose(fp8_grad, exact_grad, atol=2**-7 * np.abs(exact_grad).max())
    assert np.abs(fp8_grad).max() > 0


@pytest.mark.slow
def test_an_fp8_dispatch_moe_stays_within_e4m3s_error_of_the_reference(mesh, tiny_cfg):
    """The MoE layer (ragged exchange, 2×4 mesh) with the dispatch in fp8: outputs and
    gradients near the dense reference, further than the fp32 exchange (which equals it)."""
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=1, topk_group=1)
    bias = jnp.zeros(16)
    ref = dense_reference(params, x, bias, cfg)
    runs = {}
    for wire in ("fp32", "fp8"):
        ep = _moe_fn(mesh, moe, boxed, ctx_for(mesh, moe.cfg, expert_exchange="ragged",
                                                expert_exchange_dtype=wire))
        y, _ = ep(params, x, bias)
        grads = jax.grad(lambda p: jnp.sum(jnp.sin(ep(p, x, bias)[0])))(params)
        runs[wire] = (np.asarray(y), grads)
    scale = np.abs(np.asarray(ref)).max()
    err = {w: np.abs(y - np.asarray(ref)).max() / scale for w, (y, _) in runs.items()}
    assert err["fp32"] < 1e-5 < err["fp8"] < 2**-4, err
    # gradients: each expert's weight gradient takes its e4m3-rounded inputs (as
    # DeepSeek-V3's do), and the loss's cotangent moves with the outputs
    for a, b in zip(jax.tree.leaves(runs["fp8"][1]), jax.tree.leaves(runs["fp32"][1])):
        a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
        assert np.isfinite(a).all()
        cosine = a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)
        assert cosine > 0.99 and np.abs(a - b).max() <= 2**-3 * np.abs(b).max() + 1e-7, cosine


def test_the_plan_prices_the_fp8_dispatch_at_one_byte_and_a_scale_per_128():
    assert exchange.wire_bytes("bf16") == 2
    assert exchange.wire_bytes("fp8") == pytest.approx((1 + 4 / 128 + 6) / 4)


@pytest.mark.slow
def test_the_gh200_program_dispatches_in_e4m3_and_combines_in_bf16(tiny_cfg):
    """The ragged exchanges of the GH200 program (the smoke widths, 8 GPUs): one carries
    e4m3 rows (the forward's dispatch), with its float32 scales; the rest bf16. (The
    program has an MTP module too: test_gpu_target's, compiled once for both.)"""
    from test_gpu_target import MISSING, compile_for_gpu, mtp_cfg

    if MISSING:
        pytest.skip(f"gpu extra missing: {MISSING}")
    step = compile_for_gpu(mtp_cfg(tiny_cfg))
    found = [c for c in hlo_report.collectives(step["text"], step["mesh"])
             if c.op == "ragged-all-to-all"]
    dtypes = {c.dtype for c in found}
    assert "f8e4m3fn" in dtypes and "bf16" in dtypes, dtypes


@pytest.mark.slow
def test_a_two_stage_dispatch_sends_fp8_across_nodes_and_stays_near_the_reference(tiny_cfg):
    """2 nodes × 4 with the dispatch through each expert's node (node_dispatch.py): both
    stages take the fp8 rows; the output within e4m3's error, gradients finite and near."""
    from europa_jax.config import MeshConfig
    from europa_jax.parallel import sharding

    wide = sharding.make_mesh(MeshConfig(data=1, expert=8))
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=1, topk_group=1)
    bias = jnp.zeros(16)
    ref = np.asarray(dense_reference(params, x, bias, cfg))
    ctx = dataclasses.replace(ctx_for(wide, moe.cfg, expert_dispatch="two_stage",
                                      expert_exchange="dense", expert_exchange_dtype="fp8"),
                              devices_per_node=4)
    ep = _moe_fn(wide, moe, boxed, ctx)
    y, stats = ep(params, x, bias)
    err = np.abs(np.asarray(y) - ref).max() / np.abs(ref).max()
    assert 0 < err < 2**-4, err
    assert int(stats["processed_copies"]) == int(stats["routed_copies"])
    grads = jax.grad(lambda p: jnp.sum(jnp.sin(ep(p, x, bias)[0])))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    # XLA:CPU may widen an e4m3 collective after its passes: the lowered program says
    lowered = ep.lower(params, x, bias).as_text().splitlines()
    assert [line for line in lowered if "all_to_all" in line and "f8E4M3FN" in line]
