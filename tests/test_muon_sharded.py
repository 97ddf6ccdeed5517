"""Muon with one whole matrix per device: optax's numbers, all-to-alls instead of gathers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from europa_jax.config import MeshConfig, OptimConfig
from europa_jax.parallel import layout, sharding
from europa_jax.plan.program import gpu_target, hlo_report
from europa_jax.train import optim, train
from test_gpu_target import needs_toolchain


def optax_reference(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optimizer as it was built before the spread layout: optax.contrib.muon itself."""
    lr = optim.schedule(cfg, total_steps)
    muon = optax.contrib.muon(
        learning_rate=lr, ns_steps=cfg.muon_ns_steps, beta=cfg.muon_beta, eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay, muon_weight_dimension_numbers=optim.muon_dimension_numbers,
        consistent_rms=cfg.muon_consistent_rms)
    adamw = lambda wd: optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                                   weight_decay=wd)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), optax.partition(
        {"muon": muon, "adamw": adamw(cfg.weight_decay), "adamw_no_decay": adamw(0.0)},
        optim.labels))


def is_spec(x):
    return isinstance(x, P)


MESH_SHAPES = [(2, 4), (8, 1)]


@pytest.fixture(scope="module")
def trajectory(tiny_cfg):
    """Random parameters, three gradients, and optax.contrib.muon's updates on one device."""
    cfg = dataclasses.replace(tiny_cfg.optim, warmup_steps=1)  # a nonzero lr from step 0
    rng = np.random.default_rng(0)
    normal = lambda a: rng.standard_normal(a.shape).astype(a.dtype)
    params = jax.tree.map(normal, train.abstract_params(tiny_cfg))
    grads = [jax.tree.map(normal, params) for _ in range(3)]
    reference = optax_reference(cfg, 10)
    reference_step = jax.jit(_step(reference))
    p, s = jax.device_put((params, reference.init(params)), jax.devices()[0])
    updates = []
    for g in grads:
        p, s, u = reference_step(p, s, g)
        updates.append(u)
    return cfg, params, grads, updates, p


def _step(tx):
    def apply(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u
    return apply


@pytest.mark.slow
@pytest.mark.parametrize("data,expert", MESH_SHAPES)
def test_spread_muon_equals_optax_muon_on_the_model(tiny_cfg, trajectory, data, expert):
    """Three steps on the test-size model's real parameters (stacked experts, w_o split
    over both mesh axes, dense stacks padded with zero matrices) against optax unsharded."""
    cfg, params, grads, reference_updates, reference_params = trajectory
    mesh = sharding.make_mesh(MeshConfig(data=data, expert=expert))
    specs = layout.for_mesh(tiny_cfg.model, sharding.mesh_shape_of(mesh),
                            pad_multiple=tiny_cfg.execution.param_pad_multiple).specs(
        train.abstract_params(tiny_cfg))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
    spread = optim.build_optimizer(cfg, 10, mesh, specs)
    state_shardings = train.shardings_like_params(  # as the trainer lays out its state
        jax.eval_shape(spread.init, params), params, shardings, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        spread_step = jax.jit(_step(spread), in_shardings=(shardings, state_shardings, shardings),
                              out_shardings=(shardings, state_shardings, shardings))
        p = jax.device_put(params, shardings)
        s = jax.device_put(spread.init(params), state_shardings)
        for g, u_ref in zip(grads, reference_updates):
            p, s, u = spread_step(p, s, g)
            for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_ref)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(b)).max())
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(reference_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert p["moe_layers"]["moe"]["w_up"].sharding.spec == specs["moe_layers"]["moe"]["w_up"]


def test_stacked_experts_move_by_all_to_all_not_by_gathering_the_stack():
    """The update of one stacked expert leaf, compiled alone on the 2×4 mesh."""
    mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))
    shape_LEDF = (3, 8, 64, 32)
    spec = sharding.resolve_spec(("layers", "experts", "expert_embed", "expert_mlp"),
                                 shape_LEDF, sharding.mesh_shape_of(mesh))
    assert spec == P(None, "expert", "data", None)  # FSDP on a matrix axis
    stack_bytes = np.prod(shape_LEDF) * 4
    shard_bytes = stack_bytes / 8
    leaf = jax.ShapeDtypeStruct(shape_LEDF, jnp.float32, sharding=NamedSharding(mesh, spec))
    tree = {"moe": {"w_up": leaf}}
    cfg = OptimConfig()

    def compiled_update(tx):
        def update(g, s, p):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        state = jax.eval_shape(tx.init, tree)
        with jax.set_mesh(mesh):
            return jax.jit(update, out_shardings=(NamedSharding(mesh, spec), None)).lower(
                tree, state, tree).compile()

    spread = compiled_update(optim.build_optimizer(cfg, 10, mesh, {"moe": {"w_up": spec}}))
    found = hlo_report.collectives(spread.as_text(), mesh)
    # (a) nothing is gathered; (b) one all-to-all over `data` each way, half a shard each
    assert not [c for c in found if c.op == "all-gather"]
    a2a = [c for c in found if c.op == "all-to-all"]
    assert [c.axes for c in a2a] == [("data",), ("data",)]
    assert sum(c.bytes_per_device for c in a2a) == shard_bytes
    # each device orthogonalizes 3 of the 24 matrices (64×32): per Newton–Schulz step
    # X·Xᵀ and B·X (2·32²·64 each) and A·A (2·32³)
    assert hlo_report.dot_flops(spread.as_text()) == 3 * cfg.muon_ns_steps * (
        4 * 32**2 * 64 + 2 * 32**3)
    # (c) temporaries: a few shards, not the stack (optax's layout holds the whole stack)
    temp = spread.memory_analysis().temp_size_in_bytes
    assert temp <= 4 * shard_bytes
    gathered = compiled_update(optax_reference(cfg, 10)).memory_analysis().temp_size_in_bytes
    assert gathered >= stack_bytes


def ns_update(mesh, spec, shape, dtype: str, grads=None):
    """One Muon update of a stacked expert leaf with Newton–Schulz in `dtype`: the compiled
    program's text, and (given `grads`) the update."""
    params = {"moe": {"w_up": jax.ShapeDtypeStruct(shape, jnp.float32,
                                                     sharding=NamedSharding(mesh, spec))}}
    tx = optim.build_optimizer(OptimConfig(muon_ns_dtype=dtype, warmup_steps=0), 10, mesh,
                               {"moe": {"w_up": spec}})
    step = jax.jit(lambda g, s, p: tx.update(g, s, p)[0])
    state = jax.eval_shape(tx.init, params)
    with gpu_target.lowering(mesh):
        text = gpu_target.compile_lowered(step.lower(params, state, params), mesh).as_text()
    if grads is None:
        return text, None
    with jax.set_mesh(mesh):
        p = jax.tree.map(lambda g: g * 0.1, grads)
        return text, jax.device_get(step(grads, tx.init(p), p)["moe"]["w_up"])


@pytest.mark.slow
def test_newton_schulz_in_bfloat16_stays_close_to_float32():
    """`optim.muon_ns_dtype: bfloat16` (the reference Muon's): float32 momentum in, float32
    update out, pointing where the float32 one does. Newton–Schulz's quintic does not
    converge to UVᵀ (optax's docstring: singular values ~ Uniform(0.5, 1.5)), so bf16's
    rounding at each of its 5 steps moves them: measured 6.6 % apart by norm, cosine
    0.998."""
    mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))
    shape = (3, 8, 64, 32)
    spec = sharding.resolve_spec(("layers", "experts", "expert_embed", "expert_mlp"),
                                 shape, sharding.mesh_shape_of(mesh))
    grads = {"moe": {"w_up": jax.device_put(jax.random.normal(
        jax.random.key(0), shape, jnp.float32), NamedSharding(mesh, spec))}}
    _, exact = ns_update(mesh, spec, shape, "float32", grads)
    _, fast = ns_update(mesh, spec, shape, "bfloat16", grads)
    assert fast.dtype == exact.dtype == np.float32
    error = np.linalg.norm(fast - exact) / np.linalg.norm(exact)
    cosine = np.sum(fast * exact) / (np.linalg.norm(fast) * np.linalg.norm(exact))
    assert 0 < error < 0.1 and cosine > 0.99, (error, cosine)


@pytest.mark.slow
@needs_toolchain
def test_newton_schulz_in_bfloat16_moves_half_the_re_layouts_bytes_on_a_gpu():
    """Compiled for 8 GH200s (XLA:CPU widens bf16 buffers, a GPU does not): the
    re-layout's all-to-alls over `data` carry bf16, half the float32 bytes."""
    mesh = gpu_target.mesh(MeshConfig(data=2, expert=4), gpu_target.TARGETS["gh200"])
    shape = (3, 8, 64, 32)
    spec = sharding.resolve_spec(("layers", "experts", "expert_embed", "expert_mlp"),
                                 shape, sharding.mesh_shape_of(mesh))
    found = {dtype: [c for c in hlo_report.collectives(ns_update(mesh, spec, shape, dtype)[0],
                                                       mesh) if c.op == "all-to-all"]
             for dtype in ("float32", "bfloat16")}
    assert {c.dtype for c in found["float32"]} == {"f32"}
    assert {c.dtype for c in found["bfloat16"]} == {"bf16"}
    assert sum(c.bytes_per_device for c in found["bfloat16"]) == sum(
        c.bytes_per_device for c in found["float32"]) / 2 == np.prod(shape) * 4 / 8 / 2
