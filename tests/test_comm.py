"""Expert parallelism and FSDP traffic on a 2×4 CPU mesh against unsharded references."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from europa_jax.config import CommConfig, MeshConfig
from europa_jax.model.experts.moe import MoE
from europa_jax.parallel import comm, layout, sharding
from europa_jax.plan.program import hlo_report
from europa_jax.train import train
from test_moe import dense_reference
from conftest import assert_trees_close, with_settings

MESH = MeshConfig(data=2, expert=4)
BATCH = P(("data", "expert"))


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(MESH)


def ctx_for(mesh, model, **comm_kw):
    """The SPMD context of `model`'s parameters on `mesh`, dense exchange unless told."""
    # (tiny-cpu's execution.param_pad_multiple: 1, nothing stored padded)
    return comm.SpmdContext(layout=layout.for_mesh(model, sharding.mesh_shape_of(mesh),
                                                   pad_multiple=1),
                            comm=CommConfig(**{"expert_exchange": "dense", **comm_kw}))


# ----------------------------------------------------------------------------- FSDP gather


def gathered(mesh, w, axes, ctx):
    """gather_weight inside shard_map, used by every device on its own data x_i.

    Returns (the full weight device 0 saw, d/dW Σ_i Σ sin(W)·x_i): the gradient needs
    every device's contribution, i.e. the gather's transpose (reduce-scatter) and, for
    replicated axes, shard_map's own sum.
    """
    spec = sharding.resolve_spec(axes, w.shape, ctx.mesh_shape)
    x = jax.random.normal(jax.random.key(7), (8, *w.shape))

    def body(w_local, x_local):
        with comm.spmd(ctx):
            full = comm.gather_weight(w_local, layout.gather_plan(axes, spec), jnp.float32)
            return full[None], comm.psum_all(jnp.sum(jnp.sin(full) * x_local[0]))

    f = jax.shard_map(body, mesh=mesh, in_specs=(spec, BATCH),
                      out_specs=(BATCH, P()), check_vma=False)
    full, _ = f(w, x)
    grad = jax.grad(lambda w: f(w, x)[1])(w)
    return full[0], grad, jnp.cos(w) * x.sum(0)


@pytest.mark.parametrize("axes,shape", [(("embed", "mlp"), (16, 24)), (("kv_lora",), (12,)),
                                        (("norm",), (10,))])
def test_fp32_gather_is_exact_and_its_gradient_sums_every_device(mesh, axes, shape, tiny_cfg):
    w = jax.random.normal(jax.random.key(0), shape)
    full, grad, expected = gathered(mesh, w, axes, ctx_for(mesh, tiny_cfg.model))
    np.testing.assert_array_equal(full, w)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)


def test_fp8_gather_error_is_bounded_by_e4m3_resolution(mesh, tiny_cfg):
    w = jax.random.normal(jax.random.key(1), (16, 24))
    full, grad, expected = gathered(
        mesh, w, ("embed", "mlp"),
        ctx_for(mesh, tiny_cfg.model, weight_gather_dtype="fp8", grad_reduce_dtype="bf16"))
    rel = np.abs(np.asarray(full - w)) / np.abs(np.asarray(w)).max()
    assert 0 < rel.max() < 2**-4  # e4m3: 3 mantissa bits (one scale for the whole tensor)
    # d/dW of Σ sin(fp8(W))·x is cos(fp8(W))·Σx (straight-through), summed in bf16.
    expected = jnp.cos(full) * (expected / jnp.cos(w))
    np.testing.assert_allclose(grad, expected, atol=1e-2 * np.abs(np.asarray(expected)).max())


def test_expert_weights_keep_their_expert_sharding(mesh):
    axes = ("experts", "expert_embed", "expert_mlp")
    resolved = layout.resolve(axes, (8, 6, 4), 1, sharding.mesh_shape_of(mesh))
    assert resolved.gather == ((1, ("data",)),)  # only the FSDP part is gathered
    assert resolved.local_shape == (2, 3, 4)


# ----------------------------------------------------------------------------- MoE exchange


def moe_setup(tiny_cfg, **changes):
    both = with_settings(tiny_cfg, **{"grouped_matmul": "blocked", "compute_dtype": "float32",
                                      "n_routed_experts": 16, "top_k": 4, **changes})
    cfg = both.model
    moe = MoE(cfg, both.execution)
    x = jax.random.normal(jax.random.key(3), (8, 16, cfg.d_model))
    boxed = moe.init(jax.random.key(5), x, jnp.zeros(16))["params"]
    params = jax.tree.map(lambda p: p * 10, nn.unbox(boxed))  # sharper routing
    return cfg, moe, x, boxed, params


def moe_on_mesh(mesh, moe, boxed, params, x, bias, ctx):
    return _moe_fn(mesh, moe, boxed, ctx)(params, x, bias)


_COMPILED = {}


def _moe_fn(mesh, moe, boxed, ctx):
    """jit(shard_map(MoE.apply)) — compiled once per model, execution and context."""
    key = (moe.cfg, moe.ex, ctx)
    if key not in _COMPILED:
        specs = ctx.layout.specs({"moe": boxed})["moe"]  # roles: the module's path in a block

        def body(p, x_local, b):
            with comm.spmd(ctx):
                return moe.apply({"params": p}, x_local, b)

        _COMPILED[key] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, BATCH, P()),
                                               out_specs=(BATCH, P()), check_vma=False))
    return _COMPILED[key]


def assert_gradients_match_dense(ep, params, x, bias, cfg):
    """The parameters' gradients of Σ sin(MoE output) on the mesh equal the dense
    reference's."""
    grad = lambda f: jax.grad(lambda p: jnp.sum(jnp.sin(f(p))))(params)
    g_ep = grad(lambda p: ep(p, x, bias)[0])
    g_ref = grad(lambda p: dense_reference(p, x, bias, cfg))
    for a, b in zip(jax.tree.leaves(g_ep), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


ROUTINGS = {
    "random": lambda e: jnp.zeros(e),
    "all_to_one_expert": lambda e: jnp.zeros(e).at[5].set(100.0),
    "all_to_one_device": lambda e: jnp.zeros(e).at[8:12].set(100.0),  # device 2's experts
    "empty_experts": lambda e: jnp.zeros(e).at[jnp.arange(0, e, 2)].set(-100.0),
}


@pytest.fixture(scope="module")
def ep_and_reference(tiny_cfg, mesh):
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=1, topk_group=1)
    ep = _moe_fn(mesh, moe, boxed, ctx_for(mesh, moe.cfg))
    ref = jax.jit(functools.partial(dense_reference, cfg=cfg))
    loss = lambda f: jax.jit(jax.grad(lambda p, x, b: jnp.sum(jnp.sin(f(p, x, b)))))
    return cfg, x, params, ep, ref, loss(lambda p, x, b: ep(p, x, b)[0]), loss(ref)


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_expert_parallel_moe_equals_dense_reference(ep_and_reference, routing):
    cfg, x, params, ep, ref, ep_grad, ref_grad = ep_and_reference
    bias = ROUTINGS[routing](16)
    y, stats = ep(params, x, bias)
    np.testing.assert_allclose(y, ref(params, x, bias), rtol=1e-5, atol=1e-5)
    assert int(stats["processed_copies"]) == int(stats["routed_copies"]) == 8 * 16 * 4
    counts = np.asarray(stats["expert_counts_E"])
    if routing == "all_to_one_device":  # 16 rows per peer against 15 slots: a second round
        assert int(stats["overflow_rounds"]) == 8
    if routing == "all_to_one_expert":
        assert counts[5] == 8 * 16
    if routing == "empty_experts":
        assert np.all(counts[::2] == 0)
    g_ep, g_ref = ep_grad(params, x, bias), ref_grad(params, x, bias)
    assert_trees_close(g_ep, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_chunked_expert_parallel_moe_equals_dense_reference(tiny_cfg, mesh):
    """moe_chunk_tokens on the mesh: each chunk exchanged and computed on its own (2 chunks
    of 8 tokens per device here), same outputs and gradients as the dense reference."""
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=1, topk_group=1,
                                           moe_chunk_tokens=8)
    bias = ROUTINGS["all_to_one_device"](16)  # the worst case for per-chunk buffers
    ep = _moe_fn(mesh, moe, boxed, ctx_for(mesh, moe.cfg))
    y, stats = ep(params, x, bias)
    np.testing.assert_allclose(y, dense_reference(params, x, bias, cfg), rtol=1e-5, atol=1e-5)
    assert int(stats["processed_copies"]) == int(stats["routed_copies"]) == 8 * 16 * 4
    assert_gradients_match_dense(ep, params, x, bias, cfg)


@pytest.mark.parametrize("routing", ["random", "all_to_one_device"])
def test_bounded_buffers_with_overflow_rounds_equal_dense_reference(tiny_cfg, mesh, routing):
    """Exchange rounds of a quarter of the expected rows (so most dispatches need more
    rounds, each a `lax.cond` the expert group agrees on) and expert windows so small that
    they overflow, through the library path (`ragged_dot` here): the dense reference's
    outputs and gradients, dropless, and the overflow counted."""
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=1, topk_group=1,
                                           grouped_matmul="ragged_dot", moe_buffer_factor=0.3,
                                           moe_expert_groups=2)
    bias = ROUTINGS[routing](16)
    ep = _moe_fn(mesh, moe, boxed, ctx_for(mesh, moe.cfg))
    y, stats = ep(params, x, bias)
    np.testing.assert_allclose(y, dense_reference(params, x, bias, cfg), rtol=1e-5, atol=1e-5)
    assert int(stats["processed_copies"]) == int(stats["routed_copies"]) == 8 * 16 * 4
    assert int(stats["overflow_rounds"]) > 0 and int(stats["dispatches"]) == 8
    assert_gradients_match_dense(ep, params, x, bias, cfg)


def test_group_limited_routing_sends_each_token_to_at_most_topk_group_devices(tiny_cfg, mesh):
    # n_group = 4 = expert axis: a group is one device's experts.
    rows = {}
    for groups in (1, 2):
        cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=4, topk_group=groups)
        y, stats = moe_on_mesh(mesh, moe, boxed, params, x, jnp.zeros(16), ctx_for(mesh, moe.cfg))
        np.testing.assert_allclose(y, dense_reference(params, x, jnp.zeros(16), cfg),
                                   rtol=1e-5, atol=1e-5)
        rows[groups] = int(stats["exchanged_rows"])
    tokens = 8 * 16
    assert rows[1] <= tokens * 3 / 4  # ≤ 1 device per token; 3 of 4 are remote
    assert rows[2] <= tokens * 2 and rows[1] < rows[2]
    assert rows[2] < tokens * 4 * 3 / 4  # fewer rows than one per remote expert copy


def test_capacity_factor_drops_and_reports_it(tiny_cfg, mesh):
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=1, topk_group=1,
                                           moe_capacity_factor=0.5)
    bias = ROUTINGS["all_to_one_device"](16)
    _, stats = moe_on_mesh(mesh, moe, boxed, params, x, bias, ctx_for(mesh, moe.cfg))
    dropped = 1 - int(stats["processed_copies"]) / int(stats["routed_copies"])
    # Every token wants one row on device 2 (16 per source); capacity ceil(0.5·16·4/4) = 8.
    assert dropped == pytest.approx(0.5)


# ----------------------------------------------------------------------------- lowered step HLO


def lowered_step_hlo(cfg, mesh, spmd=None):
    trainer = train.build_trainer(cfg, mesh)
    if spmd is not None:
        trainer = dataclasses.replace(trainer, spmd=spmd)
    with jax.set_mesh(mesh):
        lowered = train.jit_train_step(trainer).lower(trainer.abstract_state,
                                                      train.abstract_batch(trainer))
    return lowered.compiler_ir("hlo").as_hlo_text()


def with_comm(cfg, **kw):
    return dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, **kw))


@pytest.mark.slow
def test_lowered_step_collectives_dtypes_and_axes(tiny_cfg, mesh):
    cfg = with_comm(tiny_cfg, weight_gather_dtype="fp8", grad_reduce_dtype="bf16",
                    expert_exchange_dtype="bf16")
    found = hlo_report.collectives(lowered_step_hlo(cfg, mesh), mesh)
    by_op = lambda op: [c for c in found if c.op == op]
    a2a = by_op("all-to-all")
    assert a2a and all(c.axes == ("expert",) for c in a2a)  # never across `data`
    assert {c.dtype for c in a2a if c.dtype not in ("s32", "f32")} == {"bf16"}
    gathers = {c.dtype for c in by_op("all-gather")}
    # bf16: embedding and LM head; f32: the router (its choices are discrete)
    assert "f8e4m3fn" in gathers and gathers <= {"f8e4m3fn", "bf16", "f32"}
    f32_bytes = sum(c.bytes_per_device for c in by_op("all-gather") if c.dtype == "f32")
    m = cfg.model  # the router [D, E] of each MoE layer, gathered in forward and recompute
    assert f32_bytes == m.n_moe_layers * 2 * m.d_model * m.n_routed_experts * 4 * 7 / 8
    assert {c.dtype for c in by_op("reduce-scatter")} == {"bf16"}

    fp32 = hlo_report.collectives(lowered_step_hlo(tiny_cfg, mesh), mesh)
    assert {c.dtype for c in fp32 if c.op in ("all-gather", "reduce-scatter")} == {"f32"}
    fp32_bytes = sum(c.bytes_per_device for c in fp32 if c.op == "all-gather")
    fp8_bytes = sum(c.bytes_per_device for c in by_op("all-gather"))
    assert fp8_bytes < 0.4 * fp32_bytes


def test_on_a_cpu_mesh_the_ragged_exchange_is_its_model_over_expert(tiny_cfg, mesh):
    """XLA:CPU has no ragged all-to-all: on a CPU mesh `ragged` lowers to the model's
    collectives (parallel/ragged_model.py), over `expert` only. (The GPU program's
    `ragged-all-to-all` and its groups: tests/test_gpu_target.py.)"""
    trainer_ctx = ctx_for(mesh, tiny_cfg.model, expert_exchange="ragged")
    hlo = lowered_step_hlo(tiny_cfg, mesh, spmd=trainer_ctx)
    found = hlo_report.collectives(hlo, mesh)
    assert not [c for c in found if c.op == "ragged-all-to-all"]
    gathers = [c for c in found if c.op == "all-gather" and c.axes == ("expert",)]
    assert gathers  # the model's gathered operands


@pytest.mark.parametrize("routing", ["random", "all_to_one_device", "empty_experts"])
def test_the_ragged_exchange_equals_the_dense_reference(tiny_cfg, mesh, routing):
    """The GPU's exchange (ragged_all_to_all, its CPU model here) with rounds of a quarter
    of the expected rows, overflow rounds, peers that send nothing, and overflowing expert
    windows: the dense reference's outputs and gradients, every copy processed."""
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=1, topk_group=1,
                                           grouped_matmul="ragged_dot", moe_buffer_factor=0.3,
                                           moe_expert_groups=2)
    bias = ROUTINGS[routing](16)
    ep = _moe_fn(mesh, moe, boxed, ctx_for(mesh, moe.cfg, expert_exchange="ragged"))
    y, stats = ep(params, x, bias)
    np.testing.assert_allclose(y, dense_reference(params, x, bias, cfg), rtol=1e-5, atol=1e-5)
    assert int(stats["processed_copies"]) == int(stats["routed_copies"]) == 8 * 16 * 4
    assert int(stats["overflow_rounds"]) > 0
    assert_gradients_match_dense(ep, params, x, bias, cfg)
