"""The sharded train step: mesh-independent numerics, learning, metrics, CLI."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.config import MeshConfig
from europa_jax.parallel import sharding
from europa_jax.run import loop
from europa_jax.train import train
from conftest import assert_trees_close, cli, config_path, train_for


def fixed_batch(cfg):
    it = loop.host_batch_iterator(cfg)
    return next(it)


def loss_and_grads_on(cfg, mesh_cfg, devices):
    cfg = dataclasses.replace(cfg, mesh=mesh_cfg)
    mesh = sharding.make_mesh(mesh_cfg, devices)
    trainer = train.build_trainer(cfg, mesh)
    state = train.init_state(trainer, seed=0)
    batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in fixed_batch(cfg).items()}
    bias = jnp.asarray(np.random.default_rng(0).normal(size=state.router_bias_LE.shape) * 0.01,
                       jnp.float32)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(jax.value_and_grad(lambda p: trainer.loss(p, bias, batch)[0]))(
            state.params)
    return jax.device_get((loss, grads))


@pytest.fixture(scope="module")
def single_device_reference(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, execution=dataclasses.replace(tiny_cfg.execution,
                                                                      remat="none"))
    return cfg, loss_and_grads_on(cfg, MeshConfig(data=1, expert=1), jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("data,expert", [(2, 4), (1, 8), (8, 1)])
def test_same_loss_and_gradients_on_every_mesh_layout(single_device_reference, data, expert):
    """FSDP + expert parallelism with fp32 communication changes nothing but the layout."""
    cfg, (loss1, grads1) = single_device_reference
    loss, grads = loss_and_grads_on(cfg, MeshConfig(data=data, expert=expert), jax.devices())
    np.testing.assert_allclose(loss, loss1, rtol=1e-5)
    assert_trees_close(grads, grads1, rtol=2e-3, atol=2e-6)


@pytest.mark.slow
def test_fp8_gathers_track_fp32_over_50_steps(tiny_cfg):
    """Stated tolerance: the fp8/bf16 loss curve stays within 2 % of the fp32 one."""
    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=50))
    fp32 = np.array(train_for(cfg, 50)[1])
    low = dataclasses.replace(cfg, comm=dataclasses.replace(
        cfg.comm, weight_gather_dtype="fp8", grad_reduce_dtype="bf16",
        expert_exchange_dtype="bf16"))
    fp8 = np.array(train_for(low, 50)[1])
    gap = np.abs(fp8 - fp32) / fp32
    print(f"fp8 vs fp32 loss over 50 steps: max rel gap {gap.max():.4f}, "
          f"final {fp32[-1]:.4f} vs {fp8[-1]:.4f}")
    assert fp32[-1] < fp32[0] - 0.5  # it learned
    assert gap.max() < 0.02 and not np.array_equal(fp8, fp32)


@pytest.mark.slow
def test_repeated_steps_lower_the_loss_on_a_fixed_batch(tiny_cfg):
    tiny_cfg = dataclasses.replace(tiny_cfg, optim=dataclasses.replace(tiny_cfg.optim,
                                                                       warmup_steps=0))
    mesh = sharding.make_mesh(tiny_cfg.mesh)
    trainer = train.build_trainer(tiny_cfg, mesh)
    state = train.init_state(trainer, seed=0)
    batch = {k: jax.device_put(v, trainer.batch_sharding)
             for k, v in fixed_batch(tiny_cfg).items()}
    step = train.jit_train_step(trainer)
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(6):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            assert float(metrics["moe_dropped_fraction"]) == 0.0
    assert losses[-1] < losses[0] - 0.5, losses
    assert int(state.step) == 6
    assert np.any(np.asarray(state.router_bias_LE) != 0)  # balancing bias moved


def test_train_state_is_sharded_as_the_rules_say(tiny_cfg):
    mesh = sharding.make_mesh(tiny_cfg.mesh)
    trainer = train.build_trainer(tiny_cfg, mesh)
    state = train.init_state(trainer, seed=0)
    w_up = state.params["moe_layers"]["moe"]["w_up"]
    assert w_up.sharding.spec == jax.sharding.PartitionSpec(None, "expert", "data", None)
    local = w_up.addressable_shards[0].data.shape
    assert local == (w_up.shape[0], w_up.shape[1] // 4, w_up.shape[2] // 2, w_up.shape[3])


@pytest.mark.slow
def test_cli_train_writes_metrics_jsonl(tmp_path):
    result = cli("train", config_path("tiny-cpu.yaml"), "--run-dir", str(tmp_path),
                     "--set", "train.steps=3", "--set", "train.log_every=1",
                     "--set", "model.d_model=32", "--set", "data.seq_len=128")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s_per_device",
                "mfu", "expert_load_max_over_mean", "moe_dropped_fraction",
                "attention_cost_max_over_mean", "node_attention_cost_max_over_mean"):
        assert all(np.isfinite(r[key]) for r in records), key
    assert records[-1]["moe_dropped_fraction"] == 0.0 and records[-1]["mfu"] > 0
    assert "step 3/3" in result.stderr  # log lines when not on a terminal


@pytest.mark.slow
def test_cli_count_europa_matches_the_recipe():
    result = cli("count", config_path("europa-952b.yaml"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert abs(report["total_params"] / 951.9e9 - 1) < 0.005
    assert abs(report["active_params"] / 32.8e9 - 1) < 0.005
    assert report["muon_fraction"] >= 0.99


@pytest.mark.slow
def test_cli_bad_config_is_one_line_and_nonzero(tmp_path):
    result = cli("train", config_path("tiny-cpu.yaml"), "--set", "model.top_k=99")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "model.top_k: 99 > model.n_routed_experts=16" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
