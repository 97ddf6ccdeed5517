"""Gradient accumulation (`train.microbatches`, train.gradients): the global batch in
pieces inside the step gives the whole batch's loss, gradients, router-bias update and
parameters; the split moves no rows between devices; an accumulated run resumes bitwise."""

import dataclasses
import signal

import jax
import numpy as np
import pytest

from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.model.experts.moe import updated_router_bias
from europa_jax.parallel import offload, sharding
from europa_jax.store import checkpoint
from europa_jax.job import exit_codes
from europa_jax.run import loop
from europa_jax.train import train
from conftest import assert_trees_close, config_path, train_in_process
from test_checkpoint import (TINY, assert_same_run, cli_env, metrics, start_cli,  # noqa: F401
                             train_here, wait_for_step)

ROWS = 32  # 4 rows per device of the 2 × 4 mesh


def with_microbatches(tiny_cfg, m: int):
    return dataclasses.replace(
        tiny_cfg, data=dataclasses.replace(tiny_cfg.data, global_batch_size=ROWS),
        train=dataclasses.replace(tiny_cfg.train, microbatches=m))


@pytest.fixture(scope="module")
def steps(tiny_cfg):
    """For m = 1, 2, 4: the trainer, the same initial state and the same global batch."""
    out = {}
    for m in (1, 2, 4):
        cfg = with_microbatches(tiny_cfg, m)
        mesh = sharding.make_mesh(cfg.mesh)
        trainer = train.build_trainer(cfg, mesh)
        state = train.init_state(trainer, seed=0)
        with jax.set_mesh(mesh):
            _, batch = next(iter(loop.device_batches(trainer, loop.host_batch_iterator(cfg))))
        out[m] = (trainer, state, batch)
    return out


def gradients_of(trainer, state, batch):
    def grads(state, batch):
        params = offload.to_device(state.params, trainer.state_shardings.params)
        return train.gradients(trainer, params, state.router_bias_LE, batch)

    with jax.set_mesh(trainer.mesh):
        return jax.device_get(jax.jit(grads)(state, batch))


@pytest.fixture(scope="module")
def whole_batch_gradients(steps):
    """m = 1's ((loss, stats), gradients): what every split is compared with, computed once."""
    return gradients_of(*steps[1])


@pytest.mark.slow
@pytest.mark.parametrize("m", [2, 4])
def test_accumulated_gradients_loss_and_stats_are_the_whole_batch_s(steps, whole_batch_gradients,
                                                                    m):
    (loss_1, stats_1), grads_1 = whole_batch_gradients
    (loss_m, stats_m), grads_m = gradients_of(*steps[m])
    np.testing.assert_allclose(loss_m, loss_1, rtol=1e-5)
    assert_trees_close(grads_m, grads_1, rtol=1e-5, atol=1e-7)
    # counts are integers summed over the pieces: exactly the whole batch's
    for key in ("expert_counts_E", "routed_copies", "processed_copies", "dispatches"):
        factor = m if key == "dispatches" else 1  # a dispatch per piece
        np.testing.assert_array_equal(stats_m[key], factor * stats_1[key], err_msg=key)
    np.testing.assert_allclose(stats_m["attention_logit_max_LH"],
                               stats_1["attention_logit_max_LH"], rtol=1e-5)
    bias = steps[1][1].router_bias_LE
    np.testing.assert_array_equal(
        updated_router_bias(bias, stats_m["expert_counts_E"], 0.01),
        updated_router_bias(bias, stats_1["expert_counts_E"], 0.01))


def step_of(trainer, state, batch):
    """(new state, metrics) of one train step, as host arrays (on a copy: the step donates)."""
    with jax.set_mesh(trainer.mesh):
        new, metrics_ = train.jit_train_step(trainer)(jax.tree.map(lambda x: x.copy(), state),
                                                     batch)
        return jax.device_get((new, metrics_))


@pytest.fixture(scope="module")
def whole_batch_step(steps):
    """m = 1's step: what every split is compared with, computed once."""
    return step_of(*steps[1])


@pytest.mark.slow
@pytest.mark.parametrize("m", [2, 4])
def test_one_accumulated_step_updates_the_parameters_as_the_whole_batch(steps, whole_batch_step,
                                                                        m):
    new_1, metrics_1 = whole_batch_step
    new_m, metrics_m = step_of(*steps[m])
    np.testing.assert_allclose(metrics_m["loss"], metrics_1["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics_m["grad_norm"], metrics_1["grad_norm"], rtol=1e-5)
    np.testing.assert_array_equal(new_m.router_bias_LE, new_1.router_bias_LE)
    for a, b in zip(jax.tree.leaves(new_1.params), jax.tree.leaves(new_m.params), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_the_split_moves_no_rows_between_devices(steps):
    """Each piece is a slice of every device's own rows: no collective in the split."""
    trainer, _, batch = steps[4]
    with jax.set_mesh(trainer.mesh):
        text = jax.jit(lambda b: train.microbatches(trainer, b)).lower(batch).compile().as_text()
        pieces = jax.jit(lambda b: train.microbatches(trainer, b))(batch)
    for op in ("all-to-all", "all-gather", "collective-permute", "all-reduce"):
        assert op not in text, op
    tokens = np.asarray(batch["tokens"])
    rows_per_device = ROWS // 8
    for i in range(4):
        expected = tokens.reshape(8, rows_per_device, -1)[:, i:i + 1].reshape(8, -1)
        np.testing.assert_array_equal(np.asarray(pieces["tokens"][i]), expected)


def test_microbatches_that_do_not_divide_a_device_s_rows_are_a_config_error():
    with pytest.raises(ConfigError, match=r"train.microbatches: 3 does not divide the 2 rows "
                                          r"each device holds \(data.global_batch_size 16 over "
                                          r"8 devices\)"):
        load_config(config_path("tiny-cpu.yaml"), ["train.microbatches=3"])
    with pytest.raises(ConfigError, match="train.microbatches"):
        load_config(config_path("tiny-cpu.yaml"), ["train.microbatches=0"])


ACCUMULATED = ["data.global_batch_size=16", "train.microbatches=2"]


@pytest.mark.slow
def test_a_preempted_accumulated_run_resumes_bitwise(tmp_path_factory, cli_env):  # noqa: F811
    # The uninterrupted run, in this process (as test_checkpoint's reference_run: the same
    # program and bits as the CLI's, whose compile the processes then read from the cache).
    reference = tmp_path_factory.mktemp("accumulated")
    train_in_process(reference, [*TINY, *ACCUMULATED])
    run_dir = tmp_path_factory.mktemp("preempted")
    proc = start_cli(run_dir, cli_env, *ACCUMULATED, "checkpoint.every_steps=0")
    wait_for_step(proc, run_dir, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == exit_codes.PREEMPTED, err[-3000:]
    assert checkpoint.committed_steps(run_dir)[-1] == len(metrics(run_dir)) < 8
    # the requeued run reads only the preemption's save: it runs in this process
    assert train_here(run_dir, *ACCUMULATED, "checkpoint.every_steps=0") == exit_codes.OK
    assert_same_run(run_dir, reference)
