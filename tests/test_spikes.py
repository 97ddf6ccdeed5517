"""Loss spikes (run/spikes.py): a spiking step rolls the run back to its last checkpoint and
training goes on past the bad batch; a run that keeps spiking stops with exit 3 and never
saves the damage; the rule against the last healthy steps and before them."""

import math

import pytest

from europa_jax.config import CheckpointConfig, ConfigError
from europa_jax.config_loader import load_config
from europa_jax.store import checkpoint
from europa_jax.job import exit_codes
from europa_jax.run import spikes
from conftest import config_path
from test_checkpoint import cli_env, events, metrics, run_cli  # noqa: F401


def step(loss, grad_norm=1.0, finite=True):
    return {"loss": loss, "grad_norm": grad_norm, "finite": finite}


class Steps:
    """A guard fed numbered steps: `steps(loss, …)` checks the next one."""

    def __init__(self, guard):
        self.guard, self.n = guard, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.guard.check(self.n, step(*args, **kwargs))


def test_a_spike_is_judged_against_the_healthy_steps_before_it():
    guard = spikes.SpikeGuard(CheckpointConfig(spike_window=16), vocab_size=257)
    check = Steps(guard)
    uniform = math.log(257)
    # before MIN_HISTORY healthy steps: only twice a uniform prediction's loss is a spike
    assert check(1.9 * uniform) is None
    assert "ln(vocab)" in check(2.1 * uniform)
    assert check(float("nan"), finite=False) is None  # guards.py's, not ours
    for i in range(20):
        assert check(3.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i % 2)) is None
    assert len(guard.window) == 16  # the last spike_window healthy steps
    assert check(3.05) is None  # within the floor of 10 % over the mean
    why = check(4.0)
    assert why.startswith("loss 4 > ") and "6σ of the last 16 steps" in why
    assert check(3.0, grad_norm=50.0).startswith("grad_norm 50 > ")
    assert len(guard.window) == 17 - 1  # spikes do not join the window


def test_after_a_rollback_the_window_holds_only_the_restored_weights_steps():
    """A spike at step 285 of a run that never saved rolls back to the initial weights;
    the trained steps' window must go with them, or the first step's loss (5.6 against a
    trained 2.3) is a spike, and so on until the run stops (found in a run with
    checkpoint.every_steps: 0)."""
    guard = spikes.SpikeGuard(CheckpointConfig(spike_window=128), vocab_size=257)
    for n in range(1, 285):
        assert guard.check(n, step(2.3 + 0.05 * (n % 4), 0.8)) is None
    assert guard.check(285, step(2.3, grad_norm=3.1)).startswith("grad_norm")
    guard.restored(200)  # back to a checkpoint of step 200: steps 201… leave
    assert [row[0] for row in guard.window] == list(range(157, 201))  # of the last 128
    guard.restored(0)  # back to the initial weights: nothing is left to judge by
    assert not guard.window
    assert guard.check(1, step(5.6, 8.0)) is None  # an untrained model's first step


def test_rollbacks_without_a_save_between_them_stop_the_run():
    guard = spikes.SpikeGuard(CheckpointConfig(max_spike_rollbacks=2), vocab_size=257)
    guard.rolled_back(5, "why", 4)
    guard.saved()
    for _ in range(2):
        guard.rolled_back(7, "why", 4)
    with pytest.raises(spikes.SpikeStop, match=r"step 7: why; 2 rollbacks since the last "
                                                r"checkpoint did not help .* the last "
                                                r"checkpoint, step 4, was saved before any"):
        guard.rolled_back(7, "why", 4)


def test_skipped_steps_and_set_aside_checkpoints_are_warnings_not_info():
    """--quiet shows warnings: a skipped step and a set-aside checkpoint must be among them."""
    import logging

    from europa_jax.run.guards import NonFiniteGuard

    seen = []
    NonFiniteGuard(CheckpointConfig()).check(
        3, {"finite": False, "loss": float("nan"), "grad_norm": 1.0},
        lambda event, message=None, *, level=logging.INFO, **fields: seen.append((event, level)))
    assert seen == [("nonfinite", logging.WARNING)]


def test_bad_spike_settings_are_one_line():
    with pytest.raises(ConfigError, match="checkpoint.spike_window: -1"):
        load_config(config_path("tiny-cpu.yaml"), ["checkpoint.spike_window=-1"])
    assert not load_config(config_path("tiny-cpu.yaml"),
                           ["checkpoint.spike_window=0"]).checkpoint.spike_window


@pytest.mark.slow
def test_a_bad_batch_s_spike_rolls_back_and_the_run_goes_on_past_it(tmp_path, cli_env):  # noqa: F811
    env = {**cli_env, "EUROPA_JAX_INJECT_SPIKE": "30"}
    # a short window: in 36 steps the loss still falls fast (5.6 → 3.7), and 6σ of a long
    # window of a falling loss is wide (a step-30 loss of 6.2 under the last 29 steps' 8.3)
    rc, _, err = run_cli(tmp_path, env, "train.steps=36", "checkpoint.every_steps=8",
                         "checkpoint.spike_window=8")
    assert rc == exit_codes.OK, err[-3000:]
    records = metrics(tmp_path)
    (spike,) = [e for e in events(tmp_path) if e["event"] == "loss_spike"]
    assert spike["step"] == 30 and spike["rolled_back_to"] == 24, (spike, records[20:31])
    assert "rolled back to the checkpoint of step 24" in err
    steps = [r["step"] for r in records]
    assert steps == list(range(1, 31)) + list(range(25, 37))  # the spike's record is kept
    assert checkpoint.committed_steps(tmp_path)[-1] == 36


@pytest.mark.slow
def test_a_learning_rate_that_blows_up_stops_with_exit_3_and_saves_no_damage(tmp_path,
                                                                             cli_env):  # noqa: F811
    rc, _, err = run_cli(tmp_path, cli_env, "optim.learning_rate=1000", "optim.warmup_steps=0",
                         "train.steps=16", "checkpoint.every_steps=1", "checkpoint.keep=1")
    assert rc == exit_codes.NONFINITE, err[-3000:]
    assert "WARNING rank 0/1 europa_jax.run.loop: checkpoint.keep: 1 keeps a single " \
           "checkpoint" in err  # a warning: it shows under --quiet too
    (line,) = [x for x in err.splitlines() if x.startswith("europa-jax")]
    assert "rollbacks since the last checkpoint did not help" in line, line
    rolled = [e for e in events(tmp_path) if e["event"] == "loss_spike"]
    assert len(rolled) == 3  # the fourth spike stops the run
    saved = checkpoint.committed_steps(tmp_path)
    assert all(s < rolled[0]["step"] for s in saved), (saved, rolled)  # saved before any spike
