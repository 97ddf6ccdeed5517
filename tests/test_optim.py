"""Muon/AdamW labels, per-matrix Muon axes, the schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers

from europa_jax.config import OptimConfig
from europa_jax.config_loader import load_config
from europa_jax.train import optim
from europa_jax.train.train import abstract_params
from conftest import config_path


@pytest.fixture(scope="module")
def params(tiny_cfg):
    return abstract_params(tiny_cfg)


def flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))[0]
    return {jax.tree_util.keystr(p): v for p, v in leaves}


def test_labels_cover_every_parameter_exactly_once(params):
    labels = flat(optim.labels(params))
    assert set(labels) == set(flat(params))
    assert set(labels.values()) == {"muon", "adamw", "adamw_no_decay"}
    assert labels["['moe_layers']['moe']['w_gate']"] == "muon"  # routed experts
    assert labels["['moe_layers']['moe']['shared']['w_down']"] == "muon"
    assert labels["['dense_layers']['attention']['w_o']"] == "muon"
    assert labels["['moe_layers']['moe']['w_router']"] == "adamw"
    assert labels["['embedding']"] == labels["['lm_head']"] == "adamw"
    assert labels["['final_norm']['scale']"] == "adamw_no_decay"


def test_unknown_parameter_name_is_an_error():
    with pytest.raises(KeyError, match="'block.w_new' is not declared in europa_jax/param_table"):
        optim.labels({"block": {"w_new": jnp.zeros((2, 2))}})


def test_muon_orthogonalizes_each_layer_and_expert_separately(params):
    dims = flat(optim.muon_dimension_numbers(params))
    assert dims["['final_norm']['scale']"] is None
    experts = dims["['moe_layers']['moe']['w_up']"]  # [L, E, D, F]: batch L, E
    assert experts.reduction_axis == (2,) and experts.output_axis == (3,)
    w_q_b = dims["['moe_layers']['attention']['w_q_b']"]  # [L, Q, H, K]: Q × (H·K)
    assert w_q_b.reduction_axis == (1,) and w_q_b.output_axis == (2, 3)
    w_o = dims["['moe_layers']['attention']['w_o']"]  # [L, H, O, D]: (H·O) × D
    assert w_o.reduction_axis == (1, 2) and w_o.output_axis == (3,)


def test_muon_update_is_orthogonal_per_expert():
    """Stacked [L, E, D, F] update == independent 2-D Muon on each (layer, expert) matrix."""
    cfg = OptimConfig(learning_rate=1.0, weight_decay=0.0, clip_grad_norm=0.0, warmup_steps=0)
    grads = jax.random.normal(jax.random.key(0), (2, 3, 16, 8))
    tx = optim.build_optimizer(cfg, total_steps=10)

    def update(g):
        params = {"moe": {"w_up": jnp.zeros_like(g)}}
        return tx.update({"moe": {"w_up": g}}, tx.init(params), params)[0]["moe"]["w_up"]

    stacked = update(grads)
    for l in range(2):
        for e in range(3):
            np.testing.assert_allclose(stacked[l, e], update(grads[l, e]), rtol=1e-5, atol=1e-6)
    sv = np.linalg.svd(np.asarray(stacked[0, 0]), compute_uv=False)
    raw = np.linalg.svd(np.asarray(grads[0, 0]), compute_uv=False)
    assert sv.max() / sv.min() < 0.6 * raw.max() / raw.min()  # flattened spectrum
    rms = float(jnp.sqrt(jnp.mean(jnp.square(stacked))))  # consistent RMS 0.2 (Moonlight)
    assert 0.1 < rms < 0.3


def test_wsd_schedule():
    sched = optim.schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, decay_fraction=0.2,
                                       min_lr_ratio=0.1), total_steps=100)
    assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(0.5)
    assert float(sched(10)) == float(sched(79)) == 1.0
    assert float(sched(90)) == pytest.approx(0.55) and float(sched(100)) == pytest.approx(0.1)


def test_muon_fraction_of_real_configs():
    for name in ("europa-952b.yaml", "kimi-k2.yaml"):
        assert optim.muon_fraction(load_config(config_path(name)).model) > 0.99


@pytest.mark.slow
def test_optimizer_runs_on_model_params(params, tiny_cfg):
    real = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), params)
    tx = optim.build_optimizer(tiny_cfg.optim, 10)
    updates, _ = tx.update(real, tx.init(real), real)
    assert jax.tree.structure(updates) == jax.tree.structure(real)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
