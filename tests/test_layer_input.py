"""`execution.layer_input_format: e4m3` (model/layer_input.py): each layer's branches read an
e4m3 copy of its input in 1×128 tiles, and the backward keeps that copy — half the bytes of
the layer inputs offloaded to host memory — while the residual stream stays exact."""

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_trees_close

from europa_jax.model import layer_input
from europa_jax.parallel import fp8_rows, sharding
from europa_jax.run import loop
from europa_jax.train import train
from test_microbatches import gradients_of
from test_offload import step_jaxpr, with_offload


def with_execution(cfg, **kw):
    return dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, **kw))


def computed(cfg):
    """(loss, stats), gradients of seed 0's weights on the config's first batch."""
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    state = train.init_state(trainer, seed=0)
    host_batch = next(iter(loop.host_batch_iterator(cfg)))
    batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in host_batch.items()}
    return gradients_of(trainer, state, batch)


def test_the_copy_is_within_e4m3_s_bound_and_its_gradient_is_straight_through():
    x_BSD = jax.random.normal(jax.random.key(0), (2, 8, 256)) * jnp.exp(
        jax.random.normal(jax.random.key(1), (2, 8, 1)) * 3)  # rows of very different scale
    copy_BSD = layer_input.e4m3_copy(x_BSD)
    error_BSD = jnp.abs(copy_BSD - x_BSD)
    bound_BSD = fp8_rows.error_bound(x_BSD.reshape(16, 256)).reshape(x_BSD.shape)
    assert bool(jnp.all(error_BSD <= bound_BSD))
    assert float(error_BSD.max()) > 0  # it did round
    g_BSD = jax.random.normal(jax.random.key(2), x_BSD.shape)
    grad_BSD = jax.grad(lambda x: jnp.sum(layer_input.e4m3_copy(x) * g_BSD))(x_BSD)
    np.testing.assert_array_equal(grad_BSD, g_BSD)


@pytest.fixture(scope="module")
def exact_cfg(tiny_cfg):
    """The tiny model, its layer inputs offloaded in its compute dtype (float32)."""
    return with_offload(tiny_cfg, activations="offload_layer_inputs")


@pytest.fixture(scope="module")
def e4m3_cfg(exact_cfg):
    return with_execution(exact_cfg, layer_input_format="e4m3")


def saved_residuals(cfg) -> list[str]:
    """What the loss's backward keeps (`jax.ad_checkpoint.print_saved_residuals`'s lines:
    a type with its memory space, then where it comes from)."""
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    state, batch = trainer.abstract_state, train.abstract_batch(trainer)
    out = io.StringIO()
    with jax.set_mesh(trainer.mesh), contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            lambda params: trainer.loss(params, state.router_bias_LE, batch)[0], state.params)
    return out.getvalue().splitlines()


def test_the_backward_keeps_the_e4m3_tiles_instead_of_the_input(exact_cfg, e4m3_cfg):
    """Under `offload_layer_inputs` the layers' inputs go to host memory in the compute
    dtype; with e4m3 their tiles go instead, and nothing else is kept in their place (the
    exact input, on device, would make the saving a loss)."""
    exact, e4m3 = saved_residuals(exact_cfg), saved_residuals(e4m3_cfg)
    on_host = lambda lines: sorted(line.split()[0] for line in lines if "<host>" in line)
    on_device = lambda lines: sorted(line.split()[0] for line in lines if "<host>" not in line)
    assert on_device(e4m3) == on_device(exact)
    assert on_host(exact) and all(t.startswith("f32<host>") for t in on_host(exact))
    assert any(t.startswith("f8_e4m3fn<host>") for t in on_host(e4m3))
    assert all(t.startswith(("f8_e4m3fn<host>", "f32<host>")) for t in on_host(e4m3))


@pytest.mark.slow
def test_e4m3_inputs_move_the_loss_and_gradients_by_e4m3_s_rounding(exact_cfg, e4m3_cfg):
    (loss_exact, _), grads_exact = computed(exact_cfg)
    (loss_e4m3, _), grads_e4m3 = computed(e4m3_cfg)
    assert loss_e4m3 != loss_exact  # the branches did read a rounded copy
    np.testing.assert_allclose(loss_e4m3, loss_exact, rtol=2e-3)
    exact, e4m3 = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(t)])
                   for t in (grads_exact, grads_e4m3))
    cosine = exact @ e4m3 / np.linalg.norm(exact) / np.linalg.norm(e4m3)
    assert cosine > 0.995, cosine


def host_bytes(jaxpr: str) -> dict[str, int]:
    """Bytes of the values the step's program holds in host memory, by dtype."""
    sizes = {"f32": 4, "bf16": 2, "f8_e4m3fn": 1}
    out: dict[str, int] = {}
    for dtype, dims in re.findall(r"(f32|bf16|f8_e4m3fn)<host>\[([0-9,]*)\]", jaxpr):
        n = int(np.prod([int(d) for d in dims.split(",") if d]))
        out[dtype] = out.get(dtype, 0) + n * sizes[dtype]
    return out


@pytest.mark.slow
def test_the_offloaded_layer_inputs_are_e4m3_tiles_and_their_scales(exact_cfg, e4m3_cfg):
    """With `offload_layer_inputs`, the host holds each layer's input: in the compute dtype
    (float32 in the tiny model), or e4m3 with one float32 scale per tile (the tiny model's
    width, 32, is its tile) — 1 + 4/32 bytes per value against 4."""
    exact, e4m3 = host_bytes(step_jaxpr(exact_cfg)), host_bytes(step_jaxpr(e4m3_cfg))
    assert set(exact) == {"f32"} and set(e4m3) == {"f8_e4m3fn", "f32"}
    d = exact_cfg.model.d_model
    assert e4m3["f8_e4m3fn"] == exact["f32"] // 4
    assert e4m3["f32"] == e4m3["f8_e4m3fn"] // fp8_rows.tile_width(d) * 4


@pytest.mark.slow
def test_the_row_loop_reads_the_same_e4m3_copy(e4m3_cfg):
    """2 rows per device on 4 devices: one at a time through each layer (`execution.row_loop`,
    which rounds the rows' inputs once outside its loop) or together, the same loss and
    gradients."""
    from test_rows_per_device import ROWS, trainer_on, with_layout, with_row_loop

    results = []
    for on in (False, True):
        trainer = trainer_on(with_row_loop(with_layout(e4m3_cfg, 1, ROWS), on), 4)
        state = train.init_state(trainer, seed=0)
        host_batch = next(iter(loop.host_batch_iterator(trainer.cfg)))
        batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in host_batch.items()}
        results.append(gradients_of(trainer, state, batch))
    ((loss_together, _), grads_together), ((loss_loop, _), grads_loop) = results
    np.testing.assert_allclose(loss_loop, loss_together, rtol=1e-6)
    assert_trees_close(grads_loop, grads_together, rtol=2e-5, atol=1e-7)
