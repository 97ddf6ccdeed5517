"""The complementary sequence-wise balance loss (DeepSeek-V3 §2.1.2, eq. 17-20;
`model.seq_aux_loss_weight`): its formula on known routings, its gradient, and its place
in the objective (whole batch or microbatches alike; the logged `loss` stays the LM's)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.config import ConfigError
from europa_jax.model.experts.moe import sequence_balance
from europa_jax.parallel import sharding
from europa_jax.train import train
from conftest import first_batch_and_initial_state, objective_gradients


def reference_balance(logits_BSE, experts_BSU, tokens_BS):
    """Eq. 17-20 token by token, expert by expert, for each row with tokens."""
    b, s, e = logits_BSE.shape
    k = experts_BSU.shape[-1]
    total, rows = 0.0, 0
    for row in range(b):
        kept = [t for t in range(s) if tokens_BS[row, t]]
        if not kept:
            continue
        rows += 1
        scores = 1.0 / (1.0 + np.exp(-logits_BSE[row].astype(np.float64)))
        balance = 0.0
        for i in range(e):
            f_i = e / (k * len(kept)) * sum(i in experts_BSU[row, t] for t in kept)
            p_i = sum(scores[t, i] / scores[t].sum() for t in kept) / len(kept)
            balance += f_i * p_i
        total += balance
    return total, rows


def test_the_balance_equals_its_formula_on_a_known_routing():
    rng = np.random.default_rng(0)
    logits_BSE = rng.normal(size=(3, 5, 6)).astype(np.float32)
    experts_BSU = np.stack([np.stack([rng.choice(6, 2, replace=False) for _ in range(5)])
                            for _ in range(3)]).astype(np.int32)
    tokens_BS = np.ones((3, 5), bool)
    tokens_BS[1, 3:] = False  # a row ending in padding: T = 3
    tokens_BS[2] = False  # a row of padding only: not a sequence
    total, rows = sequence_balance(jnp.asarray(logits_BSE), jnp.asarray(experts_BSU),
                                   jnp.asarray(tokens_BS))
    expected_total, expected_rows = reference_balance(logits_BSE, experts_BSU, tokens_BS)
    assert rows == expected_rows == 2
    np.testing.assert_allclose(total, expected_total, rtol=1e-6)


def test_balanced_routing_scores_one_and_one_expert_for_all_scores_n_over_k():
    # 4 experts, top-2, 2 tokens: the choices cover every expert once, equal scores → 1
    equal_BSE = jnp.zeros((1, 2, 4))
    total, _ = sequence_balance(equal_BSE, jnp.array([[[0, 1], [2, 3]]]), jnp.ones((1, 2)))
    np.testing.assert_allclose(total, 1.0, rtol=1e-6)
    # every token picks experts 0 and 1, and all the score mass is theirs: N_r / K_r = 2
    peaked_BSE = jnp.array([[[30.0, 30.0, -30.0, -30.0]] * 2])
    total, _ = sequence_balance(peaked_BSE, jnp.array([[[0, 1], [0, 1]]]), jnp.ones((1, 2)))
    np.testing.assert_allclose(total, 2.0, rtol=1e-6)


def test_the_gradient_flows_through_the_scores_with_the_choice_counts_constant():
    rng = np.random.default_rng(1)
    logits_BSE = rng.normal(size=(2, 4, 5))
    experts_BSU = jnp.asarray(np.argsort(-logits_BSE, axis=-1)[..., :2].astype(np.int32))
    tokens_BS = jnp.ones((2, 4), bool)

    def balance(logits):
        return sequence_balance(logits, experts_BSU, tokens_BS)[0]

    grad = jax.grad(balance)(jnp.asarray(logits_BSE, jnp.float32))
    assert np.abs(np.asarray(grad)).max() > 0
    eps = 1e-2
    for index in [(0, 0, 0), (1, 3, 4), (0, 2, 1)]:  # central differences, choices held
        step = np.zeros_like(logits_BSE)
        step[index] = eps
        numeric = (reference_balance(logits_BSE + step, np.asarray(experts_BSU), tokens_BS)[0]
                   - reference_balance(logits_BSE - step, np.asarray(experts_BSU),
                                       tokens_BS)[0]) / (2 * eps)
        np.testing.assert_allclose(grad[index], numeric, rtol=1e-3, atol=1e-6)


def test_the_weight_is_checked(tiny_cfg):
    with pytest.raises(ConfigError, match=r"model\.seq_aux_loss_weight: -0\.1 must be >= 0"):
        dataclasses.replace(tiny_cfg.model, seq_aux_loss_weight=-0.1)


ROWS = 32  # 4 rows per device: microbatches of 2 keep 2 each


@pytest.fixture(scope="module")
def batch_and_state(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, data=dataclasses.replace(tiny_cfg.data,
                                                                 global_batch_size=ROWS))
    return cfg, *first_batch_and_initial_state(cfg)


@pytest.mark.slow
def test_the_objective_adds_alpha_times_the_mean_balance_over_sequences(batch_and_state):
    cfg, batch, state = batch_and_state
    (loss_0, stats_0), grads_0 = objective_gradients(cfg, batch, state, seq_aux_loss_weight=0.0)
    (loss_a, stats_a), grads_a = objective_gradients(cfg, batch, state, seq_aux_loss_weight=0.5)
    assert "seq_aux_loss" not in stats_0 and loss_0 == stats_0["lm_loss"]
    np.testing.assert_allclose(stats_a["lm_loss"], stats_0["lm_loss"], rtol=1e-6)
    np.testing.assert_allclose(loss_a, stats_a["lm_loss"] + stats_a["seq_aux_loss"], rtol=1e-6)
    # α × Σ over MoE layers of a balance in (0, N_r / K_r], near 1 at initialization
    n_moe, most = cfg.model.n_moe_layers, cfg.model.n_routed_experts / cfg.model.top_k
    assert 0.5 * 0.5 * n_moe < stats_a["seq_aux_loss"] < 0.5 * most * n_moe
    # The aux loss reaches the routers and what feeds them: not the last MoE layer's
    # experts, whose output no router reads (the stacked layers: last index).
    moe_0, moe_a = grads_0["moe_layers"]["moe"], grads_a["moe_layers"]["moe"]
    assert not np.allclose(moe_a["w_router"], moe_0["w_router"])
    assert not np.allclose(moe_a["w_down"][0], moe_0["w_down"][0])
    np.testing.assert_allclose(moe_a["w_down"][-1], moe_0["w_down"][-1], rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_microbatches_give_the_whole_batch_s_aux_loss_and_gradients(batch_and_state):
    cfg, batch, state = batch_and_state
    (loss_1, stats_1), grads_1 = objective_gradients(cfg, batch, state, seq_aux_loss_weight=0.5)
    (loss_2, stats_2), grads_2 = objective_gradients(cfg, batch, state, 2, seq_aux_loss_weight=0.5)
    np.testing.assert_allclose(stats_2["seq_aux_loss"], stats_1["seq_aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(loss_2, loss_1, rtol=1e-5)
    np.testing.assert_allclose(grads_2["moe_layers"]["moe"]["w_router"],
                               grads_1["moe_layers"]["moe"]["w_router"], rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_a_step_logs_the_lm_loss_as_loss_and_the_aux_loss_beside_it(batch_and_state):
    cfg, batch, state = batch_and_state
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_aux_loss_weight=0.5))
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    with jax.set_mesh(trainer.mesh):
        _, metrics = jax.device_get(train.jit_train_step(trainer)(
            jax.tree.map(lambda x: x.copy(), state), batch))
    (_, stats), _ = objective_gradients(cfg, batch, state, seq_aux_loss_weight=0.5)
    np.testing.assert_allclose(metrics["loss"], stats["lm_loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["seq_aux_loss"], stats["seq_aux_loss"], rtol=1e-5)
