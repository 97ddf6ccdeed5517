"""Checkpoints: kill/resume bitwise, preemption, corrupt checkpoints, resharding, NaN policy."""

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.config import MeshConfig
from europa_jax.parallel import sharding
from europa_jax.run import checkpoint, exit_codes, loop
from europa_jax.train import train
from conftest import REPO, config_path, process_env

# Small enough that one compile is ~20 s on 2 cores; the compilation cache makes reruns ~5 s.
TINY = ["model.d_model=32", "model.q_lora_rank=16", "model.kv_lora_rank=16",
        "data.seq_len=64", "model.attention_block_size=64", "model.remat=none",
        "data.max_documents=40", "data.global_batch_size=8", "train.steps=8", "train.eval_every=0",
        "train.log_every=1", "checkpoint.every_steps=2"]


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory):
    env = process_env()  # the CLI sizes the CPU device count from the config
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    return env


def start_cli(run_dir, env, *overrides, **popen):
    args = [sys.executable, "-m", "europa_jax.cli", "train", config_path("tiny-cpu.yaml"),
            "--run-dir", str(run_dir)]
    for item in [*TINY, *overrides]:
        args += ["--set", item]
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def run_cli(run_dir, env, *overrides):
    proc = start_cli(run_dir, env, *overrides)
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def events(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "events.jsonl").read_text().splitlines()]


def wait_for_step(proc, run_dir, step, timeout=300):
    path = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}: {proc.stderr.read()[-2000:]}")
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def saved_params(run_dir, step):
    step_dir = checkpoint.checkpoint_dir(run_dir) / str(step)
    meta = checkpoint.read_meta(step_dir)
    return {key: checkpoint.open_saved_array(step_dir, key).read().result()
            for key in meta["fingerprint"] if key.startswith("params.")}


def trajectory(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(run_dir)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cli_env):
    run_dir = tmp_path_factory.mktemp("reference")
    rc, _, err = run_cli(run_dir, cli_env)
    assert rc == exit_codes.OK, err[-3000:]
    return run_dir


def assert_same_run(run_dir, reference_run):
    assert trajectory(run_dir) == trajectory(reference_run)  # bitwise: floats compared exactly
    final, expected = saved_params(run_dir, 8), saved_params(reference_run, 8)
    assert final.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(final[key], expected[key], err_msg=key)


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_restart_equals_an_uninterrupted_run(
        tmp_path, cli_env, reference_run):
    kill_after = random.Random().randint(2, 7)
    print(f"killing after step {kill_after}")
    proc = start_cli(tmp_path, cli_env)
    wait_for_step(proc, tmp_path, kill_after)
    proc.send_signal(signal.SIGKILL)  # no handler can run: whatever is on disk must do
    proc.wait()
    resumed_from = max(checkpoint.committed_steps(tmp_path), default=0)
    rc, _, err = run_cli(tmp_path, cli_env)
    assert rc == exit_codes.OK, err[-3000:]
    if resumed_from:
        assert {"event": "checkpoint_restored", "step": resumed_from}.items() <= \
            [e for e in events(tmp_path) if e["event"] == "checkpoint_restored"][-1].items()
    assert_same_run(tmp_path, reference_run)


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_exits_for_requeue_and_resumes(
        tmp_path, cli_env, reference_run):
    proc = start_cli(tmp_path, cli_env, "checkpoint.every_steps=0")  # only the preemption save
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == exit_codes.PREEMPTED, err[-3000:]
    (saved,) = checkpoint.committed_steps(tmp_path)
    meta = checkpoint.read_meta(checkpoint.checkpoint_dir(tmp_path) / str(saved))
    assert meta["reason"] == "preempted" and saved >= 3
    assert len(metrics(tmp_path)) == saved  # the step in flight finished, nothing after it
    rc, _, err = run_cli(tmp_path, cli_env, "checkpoint.every_steps=0")
    assert rc == exit_codes.OK, err[-3000:]
    assert_same_run(tmp_path, reference_run)


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_the_run_stops_keeping_the_last_good_checkpoint(
        tmp_path, cli_env):
    # A learning rate of 1e30 makes step 1's update overflow: every later loss is NaN.
    rc, _, err = run_cli(tmp_path, cli_env, "optim.learning_rate=1e30", "optim.warmup_steps=0",
                         "checkpoint.every_steps=1", "checkpoint.nan_policy=skip",
                         "checkpoint.max_consecutive_skips=2")
    assert rc == exit_codes.NONFINITE, err[-3000:]
    nonfinite = [e for e in events(tmp_path) if e["event"] == "nonfinite"]
    assert [e["action"] for e in nonfinite] == ["skip", "skip", "stop"]
    first_bad = nonfinite[0]["step"]
    # Skipped steps change nothing but the step count; the stopping step is never saved.
    assert checkpoint.committed_steps(tmp_path)[-1] == nonfinite[-1]["step"] - 1
    before = saved_params(tmp_path, first_bad - 1)
    after = saved_params(tmp_path, nonfinite[-1]["step"] - 1)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
        assert np.all(np.isfinite(after[key])), key
    assert "checkpoint.nan_policy=skip" in err


MULTI_PROCESS_DRIVER = """
import sys, jax
port, process_id, config, run_dir, *overrides = sys.argv[1:]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))
from europa_jax.cli import run_training
from europa_jax.config_loader import load_config
sys.exit(run_training(load_config(config, overrides), run_dir))
"""


def start_two_processes(run_dir, env, *overrides):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [subprocess.Popen([sys.executable, "-c", MULTI_PROCESS_DRIVER, str(port), str(i),
                              config_path("tiny-cpu.yaml"), str(run_dir), *TINY, *overrides],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for i in range(2)]


@pytest.mark.slow
def test_two_processes_agree_on_the_step_when_only_one_is_signalled(
        tmp_path, cli_env, reference_run):
    procs = start_two_processes(tmp_path, cli_env, "checkpoint.every_steps=0")
    wait_for_step(procs[0], tmp_path, 3)
    procs[1].send_signal(signal.SIGUSR1)  # process 0 never sees a signal
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [exit_codes.PREEMPTED] * 2, errs[0][-2000:]
    (saved,) = checkpoint.committed_steps(tmp_path)
    step_dir = checkpoint.checkpoint_dir(tmp_path) / str(saved)
    assert sorted(p.name for p in (step_dir / "data").glob("process_*")) == [
        "process_0-of-2.json", "process_1-of-2.json"]
    assert checkpoint.read_meta(step_dir)["reason"] == "preempted"
    assert len(metrics(tmp_path)) == saved
    procs = start_two_processes(tmp_path, cli_env, "checkpoint.every_steps=0")
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [exit_codes.OK] * 2, errs[0][-2000:]
    got, want = trajectory(tmp_path), trajectory(reference_run)
    assert [s for s, *_ in got] == [s for s, *_ in want]
    np.testing.assert_allclose([r[1:] for r in got], [r[1:] for r in want], rtol=1e-5)


# ----------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def small(tiny_cfg):
    """A cheap-to-compile 2×4 config, its trainer, an initial state and a batch."""
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(
        tiny_cfg.model, remat="none", attention_block_size=tiny_cfg.data.seq_len))
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    state = train.init_state(trainer, seed=0)
    bias = jnp.asarray(np.random.default_rng(0).normal(size=state.router_bias_LE.shape),
                       jnp.float32)
    state = state.replace(router_bias_LE=jax.device_put(bias, trainer.state_shardings.router_bias_LE))
    batch = next(loop.host_batch_iterator(cfg))
    return cfg, trainer, state, batch


class Events(list):
    def __call__(self, event, **fields):
        self.append({"event": event, **fields})


def on_mesh(tiny_cfg, mesh_cfg, devices=None):
    cfg = dataclasses.replace(tiny_cfg, mesh=mesh_cfg)
    return train.build_trainer(cfg, sharding.make_mesh(mesh_cfg, devices))


def loss_on(trainer, state, batch):
    batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
    with jax.set_mesh(trainer.mesh):
        return float(jax.jit(lambda s, b: trainer.loss(s.params, s.router_bias_LE, b)[0])(
            state, batch))


def test_restore_onto_other_meshes_and_device_counts_is_exact(small, tmp_path):
    tiny_cfg, trainer, state, batch = small
    saver = checkpoint.Checkpointer(tiny_cfg, tmp_path, trainer)
    saver.save(1, state, {"position": 7}, reason="test")
    saver.close()
    expected = jax.device_get(state)
    devices = jax.devices()
    for mesh_cfg, devs in [(MeshConfig(data=4, expert=2), devices),
                           (MeshConfig(data=1, expert=8), devices),
                           (MeshConfig(data=1, expert=4), devices[:4])]:
        other = on_mesh(tiny_cfg, mesh_cfg, devs)
        restored = checkpoint.Checkpointer(other.cfg, tmp_path, other).restore_latest(Events())
        assert restored.step == 1 and restored.data_state == {"position": 7}
        for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(
                other.state_shardings)):
            assert got.sharding == want
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.state), expected)
    # Identical losses: the restored state runs exactly like the original moved to the mesh.
    moved = jax.device_put(state, other.state_shardings)
    assert loss_on(other, restored.state, batch) == loss_on(other, moved, batch)


def save_steps(cfg, run_dir, trainer, state, steps):
    saver = checkpoint.Checkpointer(cfg, run_dir, trainer)
    for step in steps:
        saver.save(step, state.replace(step=jnp.int32(step)), {"at": step}, reason="test")
    saver.close()


def state_files(run_dir, step):
    item = checkpoint.checkpoint_dir(run_dir) / str(step) / "state"
    return [p for p in item.rglob("*") if p.is_file() and "/d/" in str(p)]


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "fingerprint"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(small, tmp_path, damage):
    tiny_cfg, trainer, state, _ = small
    save_steps(tiny_cfg, tmp_path, trainer, state, [1, 2])
    if damage == "fingerprint":  # bits that read fine but are not the bits that were saved
        meta_path = checkpoint.checkpoint_dir(tmp_path) / "2" / "meta" / "metadata"
        meta = json.loads(meta_path.read_text())
        key = "params.moe_layers.moe.w_up"
        meta["fingerprint"][key] = (meta["fingerprint"][key] + 1) % 2**32
        meta_path.write_text(json.dumps(meta))
    for path in state_files(tmp_path, 2) if damage != "fingerprint" else []:
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            path.write_bytes(data[: len(data) // 2])
        else:
            mid = len(data) // 2
            data[mid:mid + 64] = os.urandom(64)
            path.write_bytes(data)
    log = Events()
    restored = checkpoint.Checkpointer(tiny_cfg, tmp_path, trainer).restore_latest(log)
    assert restored.step == 1 and restored.data_state == {"at": 1}
    assert [e["event"] for e in log] == ["checkpoint_skipped", "checkpoint_restored"]
    assert log[0]["step"] == 2
    assert checkpoint.committed_steps(tmp_path) == [1]  # step 2 set aside, not deleted
    assert len(list((tmp_path / checkpoint.CORRUPT_SUBDIR).iterdir())) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.state.params),
                 jax.device_get(state.params))


def test_no_usable_checkpoint_is_a_clear_error_not_a_fresh_start(small, tmp_path):
    tiny_cfg, trainer, state, _ = small
    save_steps(tiny_cfg, tmp_path, trainer, state, [1])
    for path in state_files(tmp_path, 1):
        path.write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match=r"no usable checkpoint \(step 1: "):
        checkpoint.Checkpointer(tiny_cfg, tmp_path, trainer).restore_latest(Events())


def test_an_unfinished_save_is_never_listed_and_is_cleaned_up(small, tmp_path):
    tiny_cfg, trainer, state, _ = small
    save_steps(tiny_cfg, tmp_path, trainer, state, [1])
    partial = checkpoint.checkpoint_dir(tmp_path) / "2.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "junk").write_bytes(b"half a save")
    restored = checkpoint.Checkpointer(tiny_cfg, tmp_path, trainer).restore_latest(Events())
    assert restored.step == 1 and not partial.exists()


def test_a_checkpoint_of_another_model_is_refused_not_skipped(small, tmp_path):
    tiny_cfg, trainer, state, _ = small
    save_steps(tiny_cfg, tmp_path, trainer, state, [1])
    other_cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model,
                                                                        expert_ffn_dim=32))
    other = train.build_trainer(other_cfg, trainer.mesh)
    with pytest.raises(checkpoint.IncompatibleCheckpoint,
                       match=r"model\.expert_ffn_dim=16 but the config has model\.expert_ffn_dim=32"):
        checkpoint.Checkpointer(other_cfg, tmp_path, other).restore_latest(Events())
    assert checkpoint.committed_steps(tmp_path) == [1]


def test_a_nonfinite_step_leaves_the_state_unchanged_but_counts(small):
    tiny_cfg, trainer, state, batch = small
    state = jax.tree.map(jnp.copy, state)  # the step donates its input
    batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
    token = int(np.asarray(batch["tokens"])[0, 0])
    poisoned = state.params["embedding"].at[token].set(jnp.nan)
    state = state.replace(params={**state.params, "embedding": poisoned})
    before = jax.device_get(state)
    with jax.set_mesh(trainer.mesh):
        after, metrics = train.jit_train_step(trainer)(state, batch)
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["loss"]))
    assert int(after.step) == int(before.step) + 1
    after = jax.device_get(after)
    for a, b in zip(jax.tree.leaves((after.params, after.opt_state, after.router_bias_LE)),
                    jax.tree.leaves((before.params, before.opt_state, before.router_bias_LE))):
        np.testing.assert_array_equal(a, b)


def test_fingerprint_is_sharding_independent_and_sees_one_bit(small):
    tiny_cfg, trainer, state, _ = small
    fp = checkpoint.fingerprint(state.params)
    single = jax.device_put(jax.device_get(state.params), jax.devices()[0])
    assert checkpoint.fingerprint(single) == fp
    host = np.asarray(jax.device_get(state.params["final_norm"]["scale"]))
    assert checkpoint.host_bit_sum(host) == fp["final_norm.scale"]
    flipped = host.copy()
    flipped.view(np.uint32)[3] ^= 1
    assert checkpoint.host_bit_sum(flipped) != fp["final_norm.scale"]
