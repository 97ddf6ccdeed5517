"""An expert axis across nodes: the MoE over 8 CPU devices as 2 nodes × 4 and 4 nodes × 2
(node-limited routing: a group per node) against the dense reference, what the config
refuses, and the links the plan reads off a known program's replica groups."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from europa_jax.config import ConfigError, MeshConfig
from europa_jax.model.experts import moe_dispatch
from europa_jax.model.experts.moe import route
from europa_jax.parallel import sharding
from europa_jax.plan.price import hardware, step_time, step_work
from europa_jax.plan.program import hlo_report, links
from europa_jax.plan import plan
from europa_jax.plan.program.step_compile import collective_numbers
from test_comm import ROUTINGS, _moe_fn, assert_gradients_match_dense, ctx_for, moe_setup
from test_moe import dense_reference
from conftest import config_path

E, K = 16, 4  # test_comm.moe_setup: 16 experts, top-4, 8 rows of 16 tokens


@pytest.fixture(scope="module")
def wide_mesh():
    return sharding.make_mesh(MeshConfig(data=1, expert=8))  # one row of 8 devices


def nodes_per_token(cfg, params, x, bias, devices_per_node):
    _, experts_TU = route(x.reshape(-1, cfg.d_model) @ params["w_router"], bias, cfg)
    node_TU = np.asarray(experts_TU) // (E // 8) // devices_per_node
    return np.array([len(set(row)) for row in node_TU])


@pytest.mark.parametrize("devices_per_node,n_group,topk_group", [
    (4, 1, 1),  # 2 nodes × 4, routing unlimited
    (4, 2, 1),  # 2 nodes × 4, each token's experts on one node
    (2, 4, 2),  # 4 nodes × 2, on at most 2 of them
])
def test_moe_over_an_expert_axis_across_nodes_equals_the_dense_reference(
        tiny_cfg, wide_mesh, devices_per_node, n_group, topk_group):
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=n_group, topk_group=topk_group)
    bias = jax.random.normal(jax.random.key(7), (E,)) * 0.01
    ep = _moe_fn(wide_mesh, moe, boxed, ctx_for(wide_mesh, moe.cfg))
    y, stats = ep(params, x, bias)
    np.testing.assert_allclose(y, dense_reference(params, x, bias, cfg), rtol=1e-5, atol=1e-5)
    assert int(stats["processed_copies"]) == int(stats["routed_copies"]) == 8 * 16 * K
    nodes = nodes_per_token(cfg, params, x, bias, devices_per_node)
    if n_group > 1:  # node-limited
        assert nodes.max() <= topk_group
    else:
        assert nodes.max() > 1
    assert_gradients_match_dense(ep, params, x, bias, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("devices_per_node,n_group,topk_group,routing,exchange", [
    (4, 2, 1, "random", "dense"),  # 2 nodes × 4, node-limited
    (2, 4, 2, "random", "dense"),  # 4 nodes × 2, on at most 2 of them
    (4, 1, 1, "random", "dense"),  # 2 nodes × 4, routing unlimited
    (2, 1, 1, "all_to_one_device", "dense"),  # one GPU's experts: the second stage overflows
    (4, 1, 1, "random", "ragged"),  # the GPU's exchange (its CPU model), both stages
    (2, 1, 1, "all_to_one_device", "ragged"),
])
def test_two_stage_dispatch_equals_the_dense_reference(tiny_cfg, wide_mesh, devices_per_node,
                                                       n_group, topk_group, routing, exchange):
    """Through each expert's node first (node_dispatch.py): outputs and gradients of the
    dense reference, every copy processed, and the first stage's all-to-alls between the
    devices at one place of each node, the second's inside each node."""
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=n_group, topk_group=topk_group)
    bias = ROUTINGS[routing](E) + jax.random.normal(jax.random.key(7), (E,)) * 0.01
    ctx = dataclasses.replace(ctx_for(wide_mesh, moe.cfg, expert_dispatch="two_stage",
                                      expert_exchange=exchange),
                              devices_per_node=devices_per_node)
    ep = _moe_fn(wide_mesh, moe, boxed, ctx)
    y, stats = ep(params, x, bias)
    np.testing.assert_allclose(y, dense_reference(params, x, bias, cfg), rtol=1e-5, atol=1e-5)
    assert int(stats["processed_copies"]) == int(stats["routed_copies"]) == 8 * 16 * K
    if routing == "all_to_one_device":  # dropless past the second stage's round 0
        assert int(stats["overflow_rounds"]) > 0
    assert_gradients_match_dense(ep, params, x, bias, cfg)
    if exchange == "ragged":
        return  # the model's collectives are no GPU's: the links below are the dense ones'
    nodes = 8 // devices_per_node
    text = ep.lower(params, x, bias).compile().as_text()
    found = hlo_report.collectives(text, wide_mesh, devices_per_node=devices_per_node)
    token_rows = [c for c in found if c.op == "all-to-all" and c.dtype == "f32"
                  and c.bytes_per_device > 0]
    across = [c for c in token_rows if c.infiniband_bytes == pytest.approx(c.bytes_per_device)]
    inside = [c for c in token_rows if c.infiniband_bytes == 0]
    assert across and inside and len(across) + len(inside) == len(token_rows)
    # stage 1's token rows: 16 tokens' to each node, d_model wide, f32, (N−1)/N of them leave
    rows = nodes * 16 * cfg.d_model * 4 * (nodes - 1) / nodes
    assert any(c.bytes_per_device / c.count == pytest.approx(rows) for c in across)
    assert max(c.bytes_per_device / c.count for c in across) == pytest.approx(rows)


def test_with_a_capacity_the_dropped_rows_are_exactly_the_counted_ones(tiny_cfg, wide_mesh):
    """moe_capacity_factor over 8 devices: rows to a peer past its capacity (in token
    order) are dropped; the output is the reference over the kept copies only and
    `processed_copies` counts exactly them."""
    cfg, moe, x, boxed, params = moe_setup(tiny_cfg, n_group=2, topk_group=1,
                                           moe_capacity_factor=0.5)
    bias = jnp.zeros(E).at[:4].set(100.0)  # every token wants device 0 and 1's experts
    y, stats = _moe_fn(wide_mesh, moe, boxed, ctx_for(wide_mesh, moe.cfg))(params, x, bias)
    capacity, drops = moe_dispatch.exchange_capacity(16, cfg, moe.ex, 8)
    assert drops and capacity == math.ceil(0.5 * 16 * K / 8)
    x_TD = x.reshape(-1, cfg.d_model)
    weights_TU, experts_TU = route(x_TD @ params["w_router"], bias, cfg)
    dest_TU = np.asarray(experts_TU) // (E // 8)
    keep_TU = np.zeros(dest_TU.shape, bool)
    for device in range(8):  # device i holds batch row i: tokens 16i … 16i + 15
        tokens = range(16 * device, 16 * device + 16)
        for peer in range(8):
            wanting = [t for t in tokens if peer in dest_TU[t]]
            for t in wanting[:capacity]:
                keep_TU[t] |= dest_TU[t] == peer
    assert 0 < keep_TU.sum() < keep_TU.size
    assert int(stats["processed_copies"]) == int(keep_TU.sum())
    kept_ref = dense_reference(params, x, bias, cfg, keep_TU=jnp.asarray(keep_TU))
    np.testing.assert_allclose(y, kept_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ep,n_group,topk_group", [(8, 2, 1), (8, 4, 2), (16, 4, 2),
                                                   (8, 1, 1), (4, 8, 2)])
def test_expected_destinations_match_uniform_routing(tiny_cfg, ep, n_group, topk_group):
    """The plan's devices per token (what sizes buffers and prices the exchange) against
    routing of i.i.d. random scores, 64 experts top-8."""
    cfg = dataclasses.replace(tiny_cfg.model, n_routed_experts=64, top_k=8, n_group=n_group,
                              topk_group=topk_group)
    logits = jax.random.normal(jax.random.key(0), (20000, 64))
    _, experts_TU = route(logits, jnp.zeros(64), cfg)
    dest_TU = np.asarray(experts_TU) // (64 // ep)
    measured = np.mean([len(set(row)) for row in dest_TU])
    assert moe_dispatch.expected_destinations(cfg, ep) == pytest.approx(measured, rel=0.03)


def test_the_config_asks_for_whole_nodes_and_node_aligned_groups(tiny_cfg):
    with pytest.raises(ConfigError, match=r"mesh.expert: 6 spans nodes .* multiple of "
                                          r"mesh.devices_per_node=4"):
        MeshConfig(data=1, expert=6)
    assert MeshConfig(data=1, expert=8).expert_nodes == 2
    assert MeshConfig(data=1, expert=8, devices_per_node=2).node_group == 2
    with pytest.raises(ConfigError, match=r"model.n_group: 2 is not a multiple of the 4 nodes"):
        dataclasses.replace(tiny_cfg, mesh=MeshConfig(data=1, expert=8, devices_per_node=2),
                            model=dataclasses.replace(tiny_cfg.model, n_group=2, topk_group=1))
    with pytest.raises(ConfigError, match=r"n_heads=6 is not divisible by the 4 GPUs"):
        dataclasses.replace(tiny_cfg, mesh=MeshConfig(data=1, expert=8),
                            model=dataclasses.replace(tiny_cfg.model, n_heads=6),
                            execution=dataclasses.replace(tiny_cfg.execution,
                                                          attention_context_parallel=True))


# ----------------------------------------------------------------------------- links


def known_program(mesh):
    """An all-gather over `data`, an all-to-all over `expert`, a reduce-scatter over both,
    a ring permute over `expert`: f32[8, 16] per device (512 bytes)."""
    def body(x):
        g = jax.lax.all_gather(x, "data", axis=0, tiled=True)
        a = jax.lax.all_to_all(x, "expert", 0, 0, tiled=True)
        r = jax.lax.psum_scatter(jnp.tile(x, (8, 1)), ("data", "expert"), scatter_dimension=0,
                                 tiled=True)
        n = mesh.shape["expert"]
        p = jax.lax.ppermute(x, "expert", [(i, (i + 1) % n) for i in range(n)])
        return g.sum() + a.sum() + r.sum() + p.sum()

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("data", "expert")), out_specs=P(),
                                check_vma=False))
    return f.lower(jnp.ones((64, 16))).compiler_ir("hlo").as_hlo_text()


@pytest.mark.parametrize("expert", [4, 8])
def test_links_are_read_off_the_replica_groups_of_8_devices_over_2_nodes(expert):
    mesh = sharding.make_mesh(MeshConfig(data=8 // expert, expert=expert))
    found = {c.op: c for c in hlo_report.collectives(known_program(mesh), mesh)}
    share = {op: c.infiniband_bytes / c.bytes_per_device for op, c in found.items()
             if c.bytes_per_device}
    # 2×4: `expert` is a node, `data` pairs the nodes' GPUs; 1×8: `expert` spans both
    assert share["all-to-all"] == (0.0 if expert == 4 else pytest.approx(4 / 7))
    assert share["collective-permute"] == (0.0 if expert == 4 else pytest.approx(2 / 8))
    assert share["reduce-scatter"] == pytest.approx(1 / 7)  # hierarchical: (n−1)/(N−1)
    if expert == 4:
        assert share["all-gather"] == 1.0 and found["all-gather"].bytes_per_device == 512
    assert found["reduce-scatter"].bytes_per_device == 512 * 7
    assert links.shape_of_groups([[0, 1, 4, 5]], 4) == (2, 2)
    assert links.inter_node_share("all-gather", [[0, 1, 4, 5]], 4) == pytest.approx(1 / 3)
    assert links.inter_node_share("all-to-all", [[0, 1, 4, 5]], 4) == pytest.approx(2 / 3)


def test_the_plan_charges_each_link_its_part():
    gh = hardware.GH200_JUPITER
    cfg_mesh = MeshConfig(data=1, expert=8)
    mesh = sharding.make_mesh(cfg_mesh)
    numbers = collective_numbers(hlo_report.summarize(hlo_report.collectives(
        known_program(mesh), mesh)), "collective/step")

    class Cfg:  # what _rows reads of a config
        mesh = cfg_mesh

    rows = {r["op"]: r for r in plan._rows(numbers, "collective/step", gh, Cfg)}
    a2a = rows["all-to-all"]
    assert a2a["link"] == "nvlink+infiniband"
    assert a2a["infiniband_bytes"] == pytest.approx(a2a["bytes_per_device"] * 4 / 7)
    assert a2a["infiniband_s"] == pytest.approx(
        a2a["infiniband_bytes"] / (gh.network_bandwidth * gh.infiniband.expected))
    assert a2a["nvlink_s"] == pytest.approx(
        a2a["nvlink_bytes"] / (3 * gh.nvlink_pair_bandwidth * gh.nvlink.expected))
    # the estimate charges each link the parts of every collective (step_work.py)
    work = step_time.StepWork(
        dense_gemms=(), grouped_gemms=(), attention_forward_flops=0.0,
        attention_backward_flops=0.0, memory_bytes=0.0, update_bytes=0.0, to_host_bytes=0.0,
        to_device_bytes=0.0, nvlink_peers=3, **step_work._links(list(rows.values())))
    seconds = step_time.price(work, gh, "expected")
    assert seconds["infiniband"] == pytest.approx(sum(r["infiniband_s"] for r in rows.values()))
    assert seconds["nvlink"] == pytest.approx(sum(r["nvlink_s"] for r in rows.values()))


@pytest.mark.slow
def test_the_plan_prices_a_two_stage_exchange_by_the_nodes_a_token_visits():
    """europa-952b at expert parallelism 64 (16 nodes, a token on ≤ 4): direct, a row per
    destination GPU crosses the network (60 of 64 on other nodes); two-stage, a row per
    node visited. Its first stage's ragged exchange (all between nodes) is charged at the
    nodes' fill, the second at round 0's."""
    from europa_jax.config_loader import load_config
    from europa_jax.plan.price import exchange
    from europa_jax.plan.program import gpu_program

    sets = ["mesh.data=6", "mesh.expert=64", "mesh.allow_cross_node_experts=true",
            "model.n_group=16", "model.topk_group=4", "execution.moe_chunk_tokens=16384"]
    direct = load_config(config_path("europa-952b.yaml"), sets)
    two = load_config(config_path("europa-952b.yaml"), sets + ["comm.expert_dispatch=two_stage"])
    gh = hardware.GH200_JUPITER
    d, s = exchange.summary(direct, {}, gh), exchange.summary(two, {}, gh)
    assert d["dispatch"] == "direct" and s["dispatch"] == "two_stage"
    assert d["routed_bytes_per_step"] == s["routed_bytes_per_step"]  # the same rows
    assert d["routed_infiniband_bytes_per_step"] == pytest.approx(
        d["routed_bytes_per_step"] * 60 / 64)
    nodes = s["expected_nodes_per_token"]
    assert nodes == pytest.approx(4.0)  # node-limited: its 4 groups' nodes (an upper bound)
    assert s["routed_infiniband_bytes_per_step"] == pytest.approx(
        s["routed_bytes_per_step"] * nodes * 15 / 16 / s["expected_destinations"])
    assert s["node_stage_fill"] == pytest.approx(4 / 16)
    assert s["expected_fill"] == pytest.approx(0.8, rel=1e-3)  # 1 / moe_buffer_factor
    first = hlo_report.Collective("ragged-all-to-all", ("expert:16",), "bf16", 100.0, 1.0, 100.0)
    second = hlo_report.Collective("ragged-all-to-all", ("expert:4",), "bf16", 100.0, 1.0, 0.0)
    assert gpu_program.exchange_fill(first, two) == pytest.approx(0.25)
    assert gpu_program.exchange_fill(second, two) == pytest.approx(0.8, rel=1e-3)
    assert gpu_program.exchange_fill(first, direct) == pytest.approx(0.8, rel=1e-3)
    with pytest.raises(ConfigError, match=r"comm.expert_dispatch: two_stage needs an expert "
                                          r"axis across nodes; mesh.expert=4"):
        load_config(config_path("europa-952b.yaml"), ["comm.expert_dispatch=two_stage"])
