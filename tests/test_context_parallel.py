"""Attention context parallelism over a node's part of `expert` (comm.AttentionGroup) on
CPU meshes of 2 nodes × 4 devices (2×4; 1×8 with the expert axis over both nodes): the
node's rows computed together, each GPU a slice of the heads, against the unsplit
attention (values, gradients, QK-clip's logit max), the model's training losses, and the
collectives of the lowered step."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import assert_trees_close, train_for, with_settings
from europa_jax.config import ConfigError, MeshConfig
from europa_jax.model.attention import MLAttention
from europa_jax.model.layers import rope_tables
from europa_jax.parallel import comm, sharding
from europa_jax.plan.program import hlo_report
from test_comm import BATCH, ctx_for, lowered_step_hlo, mesh  # noqa: F401 - fixture

S = 64


def packed_rows(b: int, seed: int = 0):
    """Segment ids and in-document positions of `b` packed rows: documents of random
    lengths (some longer than the others' whole rows), one row all padding (segment 0)
    and a padded tail, as data/pipeline.py lays them out."""
    rng = np.random.default_rng(seed)
    seg_BS = np.zeros((b, S), np.int32)
    pos_BS = np.zeros((b, S), np.int32)
    for r in range(b):
        if r == 5:
            continue  # a padding row: every position segment 0
        start, doc = 0, 1
        end = S - (7 if r == 2 else 0)  # row 2 ends in padding
        while start < end:
            n = int(min(end - start, rng.integers(3, 40) if r % 3 else S))
            seg_BS[r, start:start + n] = doc
            pos_BS[r, start:start + n] = np.arange(n)
            start, doc = start + n, doc + 1
    return jnp.asarray(seg_BS), jnp.asarray(pos_BS)


def attention_setup(tiny_cfg, n_heads):
    """(the Config, its layer's inputs and parameters)."""
    cfg = with_settings(tiny_cfg, compute_dtype="float32", n_heads=n_heads, attention="dense")
    b = 8
    x_BSD = jax.random.normal(jax.random.key(1), (b, S, cfg.model.d_model))
    seg_BS, pos_BS = packed_rows(b)
    cos, sin = rope_tables(pos_BS, cfg.model)
    boxed = MLAttention(cfg.model, cfg.execution).init(jax.random.key(0), x_BSD, seg_BS, cos,
                                                       sin)["params"]
    return cfg, x_BSD, seg_BS, pos_BS, boxed


def split_attention(mesh, cfg, boxed, context_parallel: bool):
    """jit(shard_map(MLAttention)) on the mesh: (out [B, S, D], each device's reported
    logit max [8, H]) of the rows' attention, this device's rows and positions in."""
    cfg = with_settings(cfg, attention_context_parallel=context_parallel)
    ctx = ctx_for(mesh, cfg.model)
    specs = ctx.layout.specs({"attention": boxed})["attention"]
    layer = MLAttention(cfg.model, cfg.execution, report_logit_max=True)

    def body(params, x_BSD, seg_BS, pos_BS):
        with comm.spmd(ctx):
            group = comm.attention_group(cfg.execution.attention_context_parallel)
            cos, sin = rope_tables(group.gather_rows(pos_BS), cfg.model)
            out_BSD, logit_max_H = layer.apply({"params": params}, x_BSD,
                                               group.gather_rows(seg_BS), cos, sin)
            return out_BSD, logit_max_H[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, BATCH, BATCH, BATCH),
                                 out_specs=(BATCH, BATCH), check_vma=False))


def unsplit_attention(cfg, params, x_BSD, seg_BS, pos_BS):
    cos, sin = rope_tables(pos_BS, cfg.model)
    return MLAttention(cfg.model, cfg.execution, report_logit_max=True).apply(
        {"params": params}, x_BSD, seg_BS, cos, sin)


@pytest.mark.slow
@pytest.mark.parametrize("n_heads,expert", [(4, 4), (8, 4), (4, 8)])  # 1 or 2 heads per
def test_attention_over_the_node_equals_unsplit_values_gradients_and_logit_max(  # GPU
        tiny_cfg, n_heads, expert):
    """expert = 8: the axis spans both nodes and each node's 4 GPUs share its rows."""
    mesh = sharding.make_mesh(MeshConfig(data=8 // expert, expert=expert))
    cfg, x_BSD, seg_BS, pos_BS, boxed = attention_setup(tiny_cfg, n_heads)
    params = nn.unbox(boxed)
    f = split_attention(mesh, cfg, boxed, context_parallel=True)
    out_BSD, logit_max_JH = f(params, x_BSD, seg_BS, pos_BS)
    ref_BSD, _ = unsplit_attention(cfg, params, x_BSD, seg_BS, pos_BS)
    np.testing.assert_allclose(out_BSD, ref_BSD, rtol=1e-5, atol=1e-6)
    # each device reports, per head, the max over its node's rows (4 rows per node)
    for node in range(2):
        rows = slice(4 * node, 4 * node + 4)
        _, node_max_H = unsplit_attention(cfg, params, x_BSD[rows], seg_BS[rows], pos_BS[rows])
        for device in range(4 * node, 4 * node + 4):
            np.testing.assert_allclose(logit_max_JH[device], node_max_H, rtol=1e-6)

    weights_BSD = jax.random.normal(jax.random.key(2), ref_BSD.shape)

    def loss(attend):
        return lambda p, x: jnp.sum(jnp.sin(attend(p, x)) * weights_BSD)

    grads = jax.jit(jax.grad(loss(lambda p, x: f(p, x, seg_BS, pos_BS)[0]), argnums=(0, 1)))(
        params, x_BSD)
    ref_grads = jax.grad(loss(lambda p, x: unsplit_attention(cfg, p, x, seg_BS, pos_BS)[0]),
                         argnums=(0, 1))(params, x_BSD)
    assert_trees_close(grads, ref_grads, rtol=2e-5, atol=2e-6)


def test_without_context_parallelism_each_device_reports_its_own_rows(tiny_cfg, mesh):
    cfg, x_BSD, seg_BS, pos_BS, boxed = attention_setup(tiny_cfg, 4)
    params = nn.unbox(boxed)
    out_BSD, logit_max_JH = split_attention(mesh, cfg, boxed, False)(params, x_BSD, seg_BS,
                                                                     pos_BS)
    for device in (0, 6):
        rows = slice(device, device + 1)
        _, own_H = unsplit_attention(cfg, params, x_BSD[rows], seg_BS[rows], pos_BS[rows])
        np.testing.assert_allclose(logit_max_JH[device], own_H, rtol=1e-6)
    assert np.all(np.isneginf(logit_max_JH[5]))  # the padding row sees no real query


def with_context_parallel(cfg, on=True):
    return dataclasses.replace(cfg, execution=dataclasses.replace(
        cfg.execution, attention_context_parallel=on))


@pytest.mark.slow
def test_training_losses_match_the_run_without_context_parallelism(tiny_cfg):
    cfg = with_settings(tiny_cfg, compute_dtype="float32")
    _, losses = train_for(cfg, 4)
    _, cp_losses = train_for(with_context_parallel(cfg), 4)
    np.testing.assert_allclose(cp_losses, losses, rtol=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_the_lowered_step_exchanges_latents_over_expert_only(tiny_cfg, mesh):
    """The new collectives, all over `expert` and sized by the latents (q_lora, kv_lora,
    RoPE key dims), never by the heads' q/k/v: per layer the q and kv latents' gathers
    (forward, the layer's remat, and again in the backward instead of being kept), the
    RoPE key's (forward and remat), their gradients' reduce-scatters; the outputs'
    all-to-all (forward, remat, the backward's recompute for w_o and its transpose); once
    per step the positions' and segment ids' gathers."""
    cfg = tiny_cfg
    m, mesh_cfg = cfg.model, cfg.mesh
    base, cp = (hlo_report.collectives(lowered_step_hlo(c, mesh), mesh)
                for c in (cfg, with_context_parallel(cfg)))

    def total(collectives, op, axes=None, dtype=None):
        return sum(c.bytes_per_device for c in collectives if c.op == op
                   and (axes is None or c.axes == axes) and (dtype is None or c.dtype == dtype))

    def new(op, dtype=None):
        return total(cp, op, ("expert",), dtype) - total(base, op, ("expert",), dtype)

    rows = cfg.data.global_batch_size // mesh_cfg.n_devices  # per device
    peers, layers = mesh_cfg.expert - 1, m.n_layers
    per_token = rows * S * 4  # f32 bytes of one value per token of my rows
    q, kv, rope = (w * per_token for w in (m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim))
    # a gather's bytes are what this device receives (peers × its input)
    logit_max = layers * m.n_heads // mesh_cfg.expert * 4 * peers  # QK-clip's, not recomputed
    assert new("all-gather", "f32") == layers * (3 * (q + kv) + 2 * rope) * peers + logit_max
    assert new("reduce-scatter") == layers * (q + kv + rope) * peers
    heads_out = m.n_heads * m.v_head_dim * per_token
    assert new("all-to-all") == 4 * layers * heads_out * peers / mesh_cfg.expert
    assert new("all-gather", "s32") == 2 * per_token * peers  # positions, segment ids
    # nothing new crosses nodes
    for op in ("all-gather", "reduce-scatter", "all-to-all", "all-reduce"):
        for axes in (("data",), ("data", "expert")):
            assert total(cp, op, axes) == total(base, op, axes), (op, axes)
    assert sum(c.infiniband_bytes for c in cp) == sum(c.infiniband_bytes for c in base) > 0


@pytest.mark.slow
def test_over_an_expert_axis_across_nodes_the_latents_stay_inside_each_node(tiny_cfg):
    """1×8 (2 nodes of 4): the attention's collectives run over each node's 4 devices of
    the expert axis (`expert:4`), every byte on NVLink; the same bytes as on 2×4."""
    cfg = dataclasses.replace(tiny_cfg, mesh=MeshConfig(data=1, expert=8))
    wide = sharding.make_mesh(cfg.mesh)
    base, cp = (hlo_report.collectives(lowered_step_hlo(c, wide), wide)
                for c in (cfg, with_context_parallel(cfg)))
    new = [c for c in cp if c.axes == ("expert:4",)]
    assert {c.op for c in new} == {"all-gather", "reduce-scatter", "all-to-all"}
    assert all(c.infiniband_bytes == 0 for c in new)
    assert not [c for c in base if c.axes == ("expert:4",)]
    assert sum(c.infiniband_bytes for c in cp) == sum(c.infiniband_bytes for c in base)
    narrow = sharding.make_mesh(tiny_cfg.mesh)
    on_node = hlo_report.collectives(lowered_step_hlo(with_context_parallel(tiny_cfg), narrow),
                                     narrow)
    only_cp = lambda found, axes: sum(c.bytes_per_device for c in found if c.axes == axes
                                      and c.op in ("reduce-scatter", "all-to-all"))
    narrow_base = hlo_report.collectives(lowered_step_hlo(tiny_cfg, narrow), narrow)
    assert only_cp(new, ("expert:4",)) == only_cp(on_node, ("expert",)) - only_cp(
        narrow_base, ("expert",))


def test_heads_that_do_not_split_over_the_node_are_a_config_error(tiny_cfg):
    with pytest.raises(ConfigError, match="execution.attention_context_parallel.*n_heads=6"):
        with_context_parallel(dataclasses.replace(
            tiny_cfg, model=dataclasses.replace(tiny_cfg.model, n_heads=6)))
