"""Logical-axis rules: every parameter of the real configs gets a dividing sharding."""

import math
from types import SimpleNamespace

import jax
import pytest
from jax.sharding import PartitionSpec as P

from europa_jax import param_table
from europa_jax.config import ConfigError, MeshConfig
from europa_jax.config_loader import load_config
from europa_jax.parallel import layout, sharding
from europa_jax.train.train import abstract_params
from conftest import config_path

MESH_96x4 = {"data": 96, "expert": 4}


def boxed_leaves(cfg):
    """(path, leaf): each parameter's logical names (its row's, `layers` first where
    stacked) and its stored shape (`.value.shape`)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]:
        axes = param_table.row_of_path(path).axes
        names = ("layers",) * (len(leaf.shape) - len(axes)) + axes
        out.append((jax.tree_util.keystr(path), SimpleNamespace(names=names, value=leaf)))
    return out


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "europa-952b.yaml", "kimi-k2.yaml",
                                  "deepseek-v3.yaml"])
def test_the_layout_is_the_rules_applied_to_each_stored_parameter(name):
    """layout.py resolves each role once per mesh; for every leaf, stacked or not, that is
    what the rules give its logical names and stored shape."""
    cfg = load_config(config_path(name))
    specs = layout.for_mesh(cfg.model, MESH_96x4,
                            pad_multiple=cfg.execution.param_pad_multiple).specs(
        abstract_params(cfg))
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(boxed_leaves(cfg), flat_specs):
        assert spec == sharding.resolve_spec(leaf.names, leaf.value.shape, MESH_96x4), path


def mesh_size(entry):
    axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
    return math.prod(MESH_96x4[a] for a in axes)


@pytest.mark.parametrize("name", ["europa-952b.yaml", "kimi-k2.yaml", "deepseek-v3.yaml"])
def test_every_parameter_divides_the_384_gpu_mesh(name):
    cfg = load_config(config_path(name))
    total = replicated_bytes = 0
    for path, leaf in boxed_leaves(cfg):
        shape = leaf.value.shape
        spec = sharding.resolve_spec(leaf.names, shape, MESH_96x4)
        for size, entry in zip(shape, spec):
            assert size % mesh_size(entry) == 0, (path, shape, spec)
        n = math.prod(shape)
        total += n
        if sharding.replicated_over(spec, MESH_96x4):
            replicated_bytes += n
    # The routed experts (98 % of weights) must be split over all 384 GPUs; what stays
    # copied over `data` (o_proj/kv_b have no factor 3, norms) is a small remainder.
    assert replicated_bytes / total < 0.05


def stored_leaves(cfg):
    """(path, logical names, stored shape) of every parameter."""
    return [(path, leaf.names, leaf.value.shape) for path, leaf in boxed_leaves(cfg)]


def test_europa_stores_every_weight_sharded_over_all_nodes():
    """param_pad_multiple: 96 pads the two weights without a factor 3; only the norm
    vectors (replicated by their rule) are copied."""
    cfg = load_config(config_path("europa-952b.yaml"))
    stored = {path: (names, shape) for path, names, shape in stored_leaves(cfg)}
    assert stored["['moe_layers']['attention']['w_o']"][1] == (59, 64, 128, 7200)
    assert stored["['moe_layers']['attention']['w_kv_b']"][1] == (59, 576, 64, 256)
    assert stored["['moe_layers']['attention']['w_q_b']"][1] == (59, 1536, 64, 192)  # as is
    for path, (names, shape) in stored.items():
        spec = sharding.resolve_spec(names, shape, MESH_96x4)
        copied = sharding.replicated_over(spec, MESH_96x4)
        assert not copied or names[-1] == "norm", (path, shape, spec)


def test_storage_padding_pads_the_dimension_that_pads_least():
    pad = sharding.storage_shape
    assert pad(("heads", "head_dim", "embed"), (64, 128, 7168), 96) == (64, 128, 7200)
    assert pad(("kv_lora", "heads", "head_dim"), (512, 64, 256), 96) == (576, 64, 256)
    assert pad(("embed", "q_lora"), (7168, 1536), 96) == (7168, 1536)  # 1536 = 16·96
    assert pad(("norm",), (7168,), 96) == (7168,)  # norms are not sharded at all
    assert pad(("experts", "expert_embed", "expert_mlp"), (384, 7168, 2048), 96) == (
        384, 7168, 2048)  # Kimi: the experts take `data` (fallback rule)
    assert pad(("heads", "head_dim", "embed"), (64, 128, 7168), 1) == (64, 128, 7168)


@pytest.mark.slow
def test_padded_storage_trains_exactly_like_unpadded(tiny_cfg):
    """Zero padding is invisible to the model: the same losses and the same weights (where
    they exist), with the padding still zero after Muon and AdamW steps."""
    import dataclasses

    import numpy as np
    from flax import traverse_util

    from conftest import split_padding, train_for

    padded_cfg = dataclasses.replace(tiny_cfg, execution=dataclasses.replace(
        tiny_cfg.execution, param_pad_multiple=3))
    state, losses = train_for(tiny_cfg, 3)
    padded_state, padded_losses = train_for(padded_cfg, 3)
    np.testing.assert_allclose(padded_losses, losses, rtol=1e-5)
    flat = traverse_util.flatten_dict(jax.device_get(state.params))
    padded_flat = traverse_util.flatten_dict(jax.device_get(padded_state.params))
    n_padded = 0
    for key, w in flat.items():
        p = padded_flat[key]
        if p.shape != w.shape:
            n_padded += 1
            p, padding = split_padding(p, w.shape)
            assert not np.any(padding), key  # the padding stayed zero
        np.testing.assert_allclose(p, w, rtol=2e-4, atol=1e-6, err_msg=str(key))
    assert n_padded >= 5  # the test covers Muon matrices and AdamW leaves that pad


def test_europa_expert_and_kv_a_layouts():
    cfg = load_config(config_path("europa-952b.yaml"))
    leaves = dict(boxed_leaves(cfg))
    kv_a = leaves["['moe_layers']['attention']['w_kv_a']"]
    assert sharding.resolve_spec(kv_a.names, kv_a.value.shape, MESH_96x4) == P(
        None, "expert", "data")
    w_up = leaves["['moe_layers']['moe']['w_up']"]  # [L, E, D, F]: E over nodes' GPUs
    assert sharding.resolve_spec(w_up.names, w_up.value.shape, MESH_96x4) == P(
        None, "expert", None, "data")
    embedding = leaves["['embedding']"]  # padded vocab divides all 384 devices
    assert sharding.resolve_spec(embedding.names, embedding.value.shape, MESH_96x4) == P(
        ("data", "expert"), None)


def test_unknown_logical_axis_is_an_error():
    with pytest.raises(KeyError, match="no sharding rule"):
        sharding.resolve_spec(("embed", "bogus"), (8, 8), {"data": 2, "expert": 4})


def test_non_dividing_dimension_is_replicated_not_mis_sharded():
    spec = sharding.resolve_spec(("embed",), (6,), {"data": 4, "expert": 1})
    assert spec == P(None)
    assert sharding.replicated_over(spec, {"data": 4, "expert": 1}) == ("data",)


def test_make_mesh_rejects_wrong_device_count():
    with pytest.raises(ConfigError, match="but there are 8 devices"):
        sharding.make_mesh(MeshConfig(data=3, expert=2))


def test_mesh_expert_axis_is_consecutive_devices():
    mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))
    ids = [[d.id for d in row] for row in mesh.devices]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_kimi_experts_fall_back_to_splitting_experts_over_nodes():
    cfg = load_config(config_path("kimi-k2.yaml"))
    w_up = dict(boxed_leaves(cfg))["['moe_layers']['moe']['w_up']"]  # F=2048: no factor 3
    spec = sharding.resolve_spec(w_up.names, w_up.value.shape, MESH_96x4)
    assert spec == P(None, ("expert", "data"), None, None)


class FakeDevice:
    def __init__(self, id, process_index):
        self.id, self.process_index = id, process_index

    def __repr__(self):
        return f"d{self.id}@p{self.process_index}"


def test_one_process_per_node_rows_are_each_process_devices():
    devices = [FakeDevice(i, i // 4) for i in reversed(range(16))]  # 4 nodes × 4 GPUs
    grid = sharding.arrange_devices(devices, MeshConfig(data=4, expert=4))
    assert [[d.process_index for d in row] for row in grid] == [[p] * 4 for p in range(4)]
    assert [d.id for d in grid[1]] == [4, 5, 6, 7]


def test_one_process_per_gpu_groups_consecutive_ranks_of_a_node():
    devices = [FakeDevice(i, i) for i in range(8)]  # 8 ranks, 4 per node
    nodes = {p: f"node{p // 4}" for p in range(8)}
    grid = sharding.arrange_devices(devices, MeshConfig(data=2, expert=4), nodes)
    assert [[d.process_index for d in row] for row in grid] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Ranks interleaved across nodes (cyclic placement) are regrouped by node.
    cyclic = {p: f"node{p % 2}" for p in range(8)}
    grid = sharding.arrange_devices(devices, MeshConfig(data=2, expert=4), cyclic)
    assert [[d.process_index for d in row] for row in grid] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_group_crossing_nodes_is_refused_unless_allowed():
    devices = [FakeDevice(i, i // 2) for i in range(8)]  # 4 nodes × 2 GPUs
    with pytest.raises(ConfigError, match=r"mesh\.expert: 4 puts devices of nodes \['0', '1'\]"):
        sharding.arrange_devices(devices, MeshConfig(data=2, expert=4))
    grid = sharding.arrange_devices(devices, MeshConfig(data=2, expert=4,
                                                        allow_cross_node_experts=True))
    assert grid.shape == (2, 4)
