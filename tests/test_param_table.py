"""The parameter table against the model it describes, and what derives from it."""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from europa_jax import param_table
from europa_jax.config import ExecutionConfig, ModelConfig
from europa_jax.config_loader import MOVED, load_config
from europa_jax.model.layers import weight
from europa_jax.parallel import comm, layout, sharding
from europa_jax.store import checkpoint
from europa_jax.train import optim, train
from conftest import config_path

CONFIGS = ["tiny-cpu.yaml", "small-cpu.yaml", "europa-952b.yaml", "kimi-k2.yaml",
           "deepseek-v3.yaml"]
MTP = ["model.mtp_layers=2"]  # two multi-token prediction modules (model/mtp.py)


@pytest.mark.parametrize("name,overrides", [(name, []) for name in CONFIGS]
                         + [("tiny-cpu.yaml", MTP), ("kimi-k2.yaml", MTP),
                            ("tiny-cpu.yaml", MTP + ["execution.scan_layers=false"])])
def test_every_parameter_of_the_model_has_its_row_and_the_row_its_shape(name, overrides):
    """The model's own tree (eval_shape of its init) against the table: each leaf's row,
    stacked over exactly the layers its `where` says (the MTP modules' blocks hold the
    MoE blocks' rows and their own), in the stored shape of its declared shape; and no row
    with parameters that the model does not create."""
    cfg = load_config(config_path(name), overrides)
    m = cfg.model
    unsharded = layout.for_mesh(m, pad_multiple=cfg.execution.param_pad_multiple)
    seen = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(train.abstract_params(cfg))[0]:
        stack, role = param_table.split_path(path)
        row = param_table.row(role)
        lead = leaf.shape[:len(leaf.shape) - len(row.axes)]
        assert tuple(leaf.shape[len(lead):]) == unsharded[role].stored_shape, path
        if stack is None:
            assert row.where == "model", path
        else:
            assert param_table.stack_holds(stack, row), path
        seen[role] = seen.get(role, 0) + (lead[0] if lead else 1)
    for role, row in param_table.ROWS.items():
        copies = param_table.layer_count(row, m) + param_table.mtp_count(row, m)
        if param_table.size(row, m) and copies:
            assert seen.get(role) == copies, role
        else:
            assert role not in seen, role


def test_tiny_cpu_holds_every_kind_of_row():
    """The default config has dense and MoE layers and a shared expert, and with an MTP
    module every row of the table, so the suite's tiny runs exercise them all."""
    cfg = load_config(config_path("tiny-cpu.yaml"), MTP)
    roles = {param_table.split_path(path)[1] for path, _ in
             jax.tree_util.tree_flatten_with_path(train.abstract_params(cfg))[0]}
    assert roles == set(param_table.ROWS)


def test_the_router_is_the_only_float32_on_disk_and_it_is_float32_everywhere(tiny_cfg):
    """`ROUTING` is the one statement of the fact; each consumer reads it from the table."""
    on_disk = [role for role, row in param_table.ROWS.items() if row.precision.float32_export]
    assert on_disk == ["moe.w_router"]
    assert param_table.ROUTER_BIAS.precision is param_table.ROUTING
    router = param_table.row("moe.w_router").precision
    assert router.wire == "fp32" and router.float32_compute
    # the entry cast of a low-precision step keeps it (and the norms) float32
    tree = {"moe_layers": {"moe": {"w_router": jnp.zeros(2), "w_gate": jnp.zeros(2)},
                           "mlp_norm": {"scale": jnp.zeros(2)}}}
    ctx = comm.SpmdContext(layout=layout.for_mesh(tiny_cfg.model, pad_multiple=1),
                           comm=dataclasses.replace(
        tiny_cfg.comm, weight_gather_dtype="fp8", grad_reduce_dtype="bf16",
        expert_exchange="dense"))
    cast = comm.cast_for_entry(tree, ctx)
    assert cast["moe_layers"]["moe"]["w_router"].dtype == jnp.float32
    assert cast["moe_layers"]["mlp_norm"]["scale"].dtype == jnp.float32
    assert cast["moe_layers"]["moe"]["w_gate"].dtype == jnp.bfloat16


class WithExtraWeight(nn.Module):
    """A block component with one weight more than the table knows (a throwaway model
    change, as a new weight would be)."""

    ROLE = "moe"
    cfg: ModelConfig
    ex: ExecutionConfig

    @nn.compact
    def __call__(self, x_BD):
        return x_BD @ weight(self, "w_extra")


@pytest.fixture
def tiny_model(tiny_cfg):
    return tiny_cfg.model


def test_an_undeclared_weight_is_an_error_when_the_model_is_traced(tiny_model):
    with pytest.raises(KeyError, match="'moe.w_extra' is not declared in europa_jax/param_table"):
        WithExtraWeight(tiny_model, ExecutionConfig()).init(jax.random.key(0),
                                                            jnp.ones((2, tiny_model.d_model)))


def test_one_row_gives_a_new_weight_its_layout_optimizer_and_precision(tiny_model, monkeypatch):
    """Adding a weight is the model change and one row: the row alone gives it its shape,
    sharding, gather, optimizer group and Muon matrix."""
    row = param_table.Param(shape=lambda m: (m.d_model, 2 * m.d_model), axes=("embed", "mlp"),
                            optimizer="muon", muon_axes=(1, 1),
                            hf=param_table.HF("mlp.extra_proj.weight", 1), where="moe_layers")
    monkeypatch.setitem(param_table.ROWS, "moe.w_extra", row)
    layout._for_mesh.cache_clear()  # layouts are cached per model and mesh
    try:
        params = WithExtraWeight(tiny_model, ExecutionConfig()).init(
            jax.random.key(0), jnp.ones((2, tiny_model.d_model)))["params"]
        d = tiny_model.d_model
        assert params["w_extra"].shape == (d, 2 * d)
        tree = {"moe_layers": {"moe": params}}
        assert optim.labels(tree)["moe_layers"]["moe"]["w_extra"] == "muon"
        dims = optim.muon_dimension_numbers(tree)["moe_layers"]["moe"]["w_extra"]
        assert dims.reduction_axis == (0,) and dims.output_axis == (1,)
        on_mesh = layout.for_mesh(tiny_model, {"data": 2, "expert": 4},
                                  pad_multiple=1)["moe.w_extra"]
        assert on_mesh.spec == sharding.resolve_spec(("embed", "mlp"), (d, 2 * d),
                                                     {"data": 2, "expert": 4})
        assert on_mesh.gather and on_mesh.local_shape != on_mesh.stored_shape
    finally:
        layout._for_mesh.cache_clear()


def test_layout_of_a_stacked_leaf_must_match_its_row(tiny_model):
    on_mesh = layout.for_mesh(tiny_model, {"data": 2, "expert": 4}, pad_multiple=1)
    bad = {"moe_layers": {"moe": {"w_router": jax.ShapeDtypeStruct((3, 5, 7), jnp.float32)}}}
    with pytest.raises(ValueError, match=r"moe_layers.moe.w_router has shape \(3, 5, 7\)"):
        on_mesh.specs(bad)


STATE_LAYOUT = os.path.join(os.path.dirname(__file__), "data", "train_state_layout.json")


@pytest.mark.parametrize("name", ["tiny-cpu", "tiny-cpu unrolled, storage padded ×3"])
def test_the_train_state_keeps_the_layout_older_checkpoints_were_saved_in(name):
    """Leaf keys, dtypes and shapes of the whole train state (parameters, Muon/AdamW
    state, router bias, step) as the code before the parameter table wrote them
    (tests/data/train_state_layout.json): what Orbax needs to restore those checkpoints."""
    expected = json.load(open(STATE_LAYOUT))[name]
    # its settings as that code named them (`model.scan_layers`), under their keys of now
    sets = [MOVED.get(key, key) + "=" + value
            for key, value in (item.split("=", 1) for item in expected["set"])]
    cfg = load_config(config_path("tiny-cpu.yaml"), sets)
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    got = {checkpoint.leaf_key(path): [str(leaf.dtype), list(leaf.shape)] for path, leaf in
           jax.tree_util.tree_flatten_with_path(trainer.abstract_state)[0]}
    assert got == expected["leaves"]
