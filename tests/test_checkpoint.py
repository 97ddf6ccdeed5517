"""Checkpoints: kill/resume bitwise, preemption, corrupt checkpoints, resharding, NaN policy,
one writer per run directory, failed saves."""

import contextlib
import dataclasses
import errno
import json
import logging
import os
import random
import re
import shutil
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

from europa_jax.cli import run_training
from europa_jax.config import CheckpointConfig, MeshConfig
from europa_jax.config_loader import load_config
from europa_jax.parallel import sharding
from europa_jax.store import checkpoint, run_lock, saved_checkpoints
from europa_jax.job import exit_codes
from europa_jax.run import loop
from europa_jax.store.save_outcome import save_error, SaveFailed, SaveOutcome
from europa_jax.train import train
from conftest import REPO, config_path, process_env, train_in_process

# Small enough that one compile is ~20 s on 2 cores; the compilation cache makes reruns ~5 s.
TINY = ["model.d_model=32", "model.q_lora_rank=16", "model.kv_lora_rank=16",
        "data.seq_len=64", "execution.attention_block_size=64", "execution.remat=none",
        "data.max_documents=40", "data.global_batch_size=8", "train.steps=8", "train.eval_every=0",
        "train.log_every=1", "checkpoint.every_steps=2"]


@pytest.fixture(scope="session")
def cli_env():
    """The environment of a `europa-jax` process: the CLI sizes the CPU device count from the
    config. It keeps the session's compilation cache (tests/conftest.py): the train step a
    run in this process compiled is read back by the processes, and the other way round (the
    device-count flag is not part of the cache key)."""
    return process_env()


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


def train_here(run_dir, *overrides):
    """What `europa-jax train` on the TINY config with `overrides` does, run in this process
    (cli.run_training): the exit code; its `europa-jax: …` lines and the summary go to this
    process's stderr and stdout. For tests whose subject is not the process around the run."""
    return run_training(load_config(config_path("tiny-cpu.yaml"), [*TINY, *overrides]),
                        str(run_dir))


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
    meta = saved_checkpoints.read_meta(step_dir)
    return {key: checkpoint.open_saved_array(step_dir, key).read().result()
            for key in meta["fingerprint"] if key.startswith("params.")}


def trajectory(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(run_dir)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run every interrupted one must equal, bitwise. Trained in this
    process, not a `europa-jax` one: the process is not what it checks, and the same config
    on the same 8 CPU devices compiles to the same program, so its bits are the CLI's."""
    run_dir = tmp_path_factory.mktemp("reference")
    train_in_process(run_dir, TINY)
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
    # The killed run's lock file stays, naming it; its lock died with it (run_lock.py).
    assert f'"pid": {proc.pid}' in (tmp_path / run_lock.LOCK_FILE).read_text()
    resumed_from = max(checkpoint.committed_steps(tmp_path), default=0)
    # The restart reads only what the kill left on disk: it runs in this process.
    assert train_here(tmp_path) == exit_codes.OK
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
    meta = saved_checkpoints.read_meta(saved_checkpoints.checkpoint_dir(tmp_path) / str(saved))
    assert meta["reason"] == "preempted" and saved >= 3
    assert len(metrics(tmp_path)) == saved  # the step in flight finished, nothing after it
    # the requeued run reads only the preemption's save: it runs in this process
    assert train_here(tmp_path, "checkpoint.every_steps=0") == exit_codes.OK
    assert_same_run(tmp_path, reference_run)


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_saves_says_so_in_one_line_and_the_rerun_resumes(
        tmp_path, cli_env, reference_run):
    """A user's Ctrl-C is a stop request like the scheduler's: no traceback, the step in
    flight saved, exit 130 (not the requeue code); the same command resumes exactly."""
    proc = start_cli(tmp_path, cli_env, "checkpoint.every_steps=0")
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == exit_codes.INTERRUPTED, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    (saved,) = checkpoint.committed_steps(tmp_path)
    assert f"europa-jax: interrupted (Ctrl-C): saved step {saved}; the same command " \
           "resumes from it" in err
    assert "Ctrl-C again to quit without saving" in err
    assert len(metrics(tmp_path)) == saved
    rc, _, err = run_cli(tmp_path, cli_env, "checkpoint.every_steps=0")
    assert rc == exit_codes.OK, err[-3000:]
    assert "no checkpoint in" not in err
    assert_same_run(tmp_path, reference_run)


@pytest.mark.slow
def test_a_resume_with_more_steps_says_what_changed_before_the_first_step(tmp_path, cli_env,
                                                                          capsys):
    """Without warm-up, 4 steps end on the decay's floor at step 4; 6 steps are still on
    the plateau there."""
    rc, _, err = run_cli(tmp_path, cli_env, "train.steps=4", "optim.warmup_steps=0")
    assert rc == exit_codes.OK, err[-3000:]
    assert f"no checkpoint in {tmp_path / 'checkpoints'}: starting at step 0" in err
    assert "compiling the train step for 8 devices, or read from the compilation cache in " \
           f"{cli_env['JAX_COMPILATION_CACHE_DIR']} if it holds it" in err  # not a silent minute
    # and what it was, once JAX has looked the program up (the session's cache may hold it)
    assert re.search(r"train step (compiled|read from the compilation cache) in \d+\.\d s", err)
    rc, _, err = run_cli(tmp_path, cli_env, "train.steps=6", "optim.warmup_steps=0")
    assert rc == exit_codes.OK, err[-3000:]
    assert "resuming step 4 with train.steps changed since it was saved: 4 → 6\n" in err
    assert "resuming step 4: the learning rate there moves from" in err
    (changed,) = [e for e in events(tmp_path) if e["event"] == "config_changed"]
    assert changed["step"] == 4 and changed["keys"] == ["train.steps"]
    assert changed["changes"] == {"train.steps": {"saved": 4, "now": 6}}  # what, not just where
    capsys.readouterr()  # the same command again, in this process: nothing left to train
    rc = train_here(tmp_path, "train.steps=6", "optim.warmup_steps=0")
    out, err = capsys.readouterr()
    assert rc == exit_codes.OK and json.loads(out) == {"steps": 6, "run_dir": str(tmp_path)}, \
        err[-3000:]
    assert f"europa-jax: {tmp_path} already holds step 6, the last: nothing to train" in err


@pytest.mark.slow
def test_a_run_saved_before_the_execution_section_resumes_as_it_was_saved(tmp_path, cli_env):
    """Checkpoints whose saved config holds `remat`, `attention_block_size`, … under
    `model:` (before `execution:` existed) resume: their keys move to `execution` on
    reading, so the resume sees only what the command changed."""
    train_in_process(tmp_path, [*TINY, "train.steps=2"])  # the run to be resumed: in process
    for step in checkpoint.committed_steps(tmp_path):
        path = checkpoint.checkpoint_dir(tmp_path) / str(step) / "meta" / "metadata"
        meta = json.loads(path.read_text())
        saved = meta["config"]
        saved["model"].update(saved.pop("execution"))  # the layout of the version before
        assert saved["model"]["remat"] == "none"
        path.write_text(json.dumps(meta))
    rc, _, err = run_cli(tmp_path, cli_env, "train.steps=3")
    assert rc == exit_codes.OK, err[-3000:]
    assert "resuming step 2 with train.steps changed since it was saved: 2 → 3\n" in err
    assert "execution." not in err and "moved to" not in err
    (changed,) = [e for e in events(tmp_path) if e["event"] == "config_changed"]
    assert changed["keys"] == ["train.steps"]
    assert [m["step"] for m in metrics(tmp_path)][-1] == 3


def test_a_second_ctrl_c_quits_at_once():
    from europa_jax.job.preemption import StopRequests
    before = signal.getsignal(signal.SIGINT)
    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"  # the first: a request, the step goes on
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # the loop's handlers are gone after it


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_the_run_stops_keeping_the_last_good_checkpoint(
        tmp_path, capsys):
    # A learning rate of 1e30 makes step 1's update overflow: every later loss is NaN. (In
    # this process: the policy is the subject; the exit code is run/outcome.py's mapping.)
    rc = train_here(tmp_path, "optim.learning_rate=1e30", "optim.warmup_steps=0",
                    "checkpoint.every_steps=1", "checkpoint.nan_policy=skip",
                    "checkpoint.max_consecutive_skips=2")
    err = capsys.readouterr().err
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


def wait_for_lock(proc, run_dir, timeout=300):
    """Until `proc` holds the run directory's lock (before it writes anything there)."""
    path = Path(run_dir) / run_lock.LOCK_FILE
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before locking: {proc.stderr.read()[-2000:]}")
        if path.exists() and f'"pid": {proc.pid}' in path.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} did not name pid {proc.pid} within {timeout} s")


@pytest.mark.slow
def test_a_second_train_on_the_run_directory_is_refused_and_the_first_is_unharmed(
        tmp_path, cli_env, reference_run):
    first = start_cli(tmp_path, cli_env)
    wait_for_lock(first, tmp_path)
    first.send_signal(signal.SIGSTOP)  # frozen while holding it: the second surely overlaps
    try:
        rc, _, err = run_cli(tmp_path, cli_env)
    finally:
        first.send_signal(signal.SIGCONT)
    assert rc == exit_codes.BAD_INPUT, err[-3000:]
    assert [line for line in err.splitlines() if "europa-jax" in line and "error" in line] == [
        f"europa-jax: error: {tmp_path}: in use by `europa-jax train` on {socket.gethostname()}, "
        f"pid {first.pid}, since " + err.split(", since ")[1].splitlines()[0]]
    assert "Traceback" not in err
    _, err = first.communicate(timeout=600)
    assert first.returncode == exit_codes.OK, err[-3000:]
    metrics(tmp_path)  # every line valid JSON: one writer
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert not [e for e in events(tmp_path) if e["event"] == "checkpoint_restored"]
    assert_same_run(tmp_path, reference_run)


@contextlib.contextmanager
def small_disk(path, size):
    """A tmpfs of `size` bytes mounted at `path`, and a function to resize it (root: CI
    runs as root; elsewhere the test is skipped, and the fault-hook variant still runs)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield lambda new_size: subprocess.run(
            ["mount", "-o", f"remount,size={new_size}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def disk_bytes(path):
    """Bytes the files under `path` take on disk (whole blocks, as a tmpfs counts them)."""
    return sum(p.stat().st_blocks * 512 for p in Path(path).rglob("*") if p.is_file())


# `europa-jax` whose step-4 save fails (ENOSPC) in its synchronous part, for machines where
# a small tmpfs cannot be mounted: a test-only fault, not a hook in the package.
FAULT_DRIVER = """
import errno, sys
from europa_jax.store import checkpoint
save = checkpoint.ProcessJsonHandler.save
def save_or_fail(self, directory, args):
    if directory.parent.name.split(".")[0] == "4":
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))
    return save(self, directory, args)
checkpoint.ProcessJsonHandler.save = save_or_fail
from europa_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["full_disk", "fault_hook"])
def test_a_failed_save_stops_the_run_in_one_line_and_a_resume_is_exact(
        tmp_path, cli_env, reference_run, fault):
    with contextlib.ExitStack() as stack:
        if fault == "full_disk":  # room for one checkpoint: step 4's background write fails
            room = 3 * max(disk_bytes(checkpoint.checkpoint_dir(reference_run) / str(step))
                           for step in checkpoint.committed_steps(reference_run)) // 2
            resize = stack.enter_context(small_disk(checkpoint.checkpoint_dir(tmp_path), room))
            rc, _, err = run_cli(tmp_path, cli_env)
        else:
            args = [a for item in TINY for a in ("--set", item)]
            done = subprocess.run([sys.executable, "-c", FAULT_DRIVER, "train",
                                   config_path("tiny-cpu.yaml"), "--run-dir", str(tmp_path),
                                   *args], cwd=REPO, env=cli_env, capture_output=True,
                                  text=True, timeout=600)
            rc, err = done.returncode, done.stderr
        assert rc == exit_codes.CRASH, err[-3000:]
        ckpt_dir = checkpoint.checkpoint_dir(tmp_path)
        assert [line for line in err.splitlines() if line.startswith("europa-jax")] == [
            f"europa-jax: error: checkpoint at step 4 failed: No space left on device [errno 28] "
            f"({ckpt_dir}); last good checkpoint: step 2"], err[-3000:]
        assert "Traceback" not in err, err[-3000:]  # Orbax's lines stay, not their tracebacks
        (failed,) = [e for e in events(tmp_path) if e["event"] == "checkpoint_failed"]
        assert (failed["step"], failed["last_good"], failed["action"]) == (4, 2, "stop")
        assert [p.name for p in ckpt_dir.iterdir()] == ["2"]  # the partial save removed
        if fault == "full_disk":
            resize(64 * 2**20)
        # the resume reads only the last good checkpoint: it runs in this process
        assert train_here(tmp_path) == exit_codes.OK
        assert {"event": "checkpoint_restored", "step": 2}.items() <= \
            [e for e in events(tmp_path) if e["event"] == "checkpoint_restored"][-1].items()
        assert_same_run(tmp_path, reference_run)


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
    assert saved_checkpoints.read_meta(step_dir)["reason"] == "preempted"
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
    cfg = dataclasses.replace(tiny_cfg, execution=dataclasses.replace(
        tiny_cfg.execution, remat="none", attention_block_size=tiny_cfg.data.seq_len))
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    state = train.init_state(trainer, seed=0)
    bias = jnp.asarray(np.random.default_rng(0).normal(size=state.router_bias_LE.shape),
                       jnp.float32)
    state = state.replace(router_bias_LE=jax.device_put(bias, trainer.state_shardings.router_bias_LE))
    batch = next(loop.host_batch_iterator(cfg))
    return cfg, trainer, state, batch


class Events(list):
    """A recording EventLog: the events in order, and the level each event was logged at."""

    def __init__(self):
        super().__init__()
        self.levels = {}

    def __call__(self, event, message=None, level=None, **fields):
        self.append({"event": event, **fields})
        self.levels[event] = level


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
    damaged = state_files(tmp_path, 2) if damage != "fingerprint" else []
    for path in damaged:
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
    if damage != "fingerprint":  # the damaged file named, not a cut-off TensorStore repr
        named = log[0]["error"].split(" reading ")[1].split(" (damaged")[0]
        assert named in {str(p.relative_to(checkpoint.checkpoint_dir(tmp_path)))
                         for p in damaged}, log[0]["error"]
    assert checkpoint.committed_steps(tmp_path) == [1]  # step 2 set aside, not deleted
    assert len(list((tmp_path / checkpoint.CORRUPT_SUBDIR).iterdir())) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.state.params),
                 jax.device_get(state.params))


def test_a_checkpoint_without_its_input_state_is_set_aside_like_any_corrupt_one(small, tmp_path):
    """Restored without its data/ item, a run would read the data from another position."""
    tiny_cfg, trainer, state, _ = small
    save_steps(tiny_cfg, tmp_path, trainer, state, [1, 2])
    shutil.rmtree(checkpoint.checkpoint_dir(tmp_path) / "2" / "data")
    log = Events()
    restored = checkpoint.Checkpointer(tiny_cfg, tmp_path, trainer).restore_latest(log)
    assert restored.step == 1 and restored.data_state == {"at": 1}
    assert log[0]["event"] == "checkpoint_skipped" and "input state" in log[0]["error"]
    assert log.levels["checkpoint_skipped"] == logging.WARNING  # shown under --quiet
    assert checkpoint.committed_steps(tmp_path) == [1]


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


@pytest.mark.slow
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
    assert saved_checkpoints.host_bit_sum(host) == fp["final_norm.scale"]
    flipped = host.copy()
    flipped.view(np.uint32)[3] ^= 1
    assert saved_checkpoints.host_bit_sum(flipped) != fp["final_norm.scale"]


@pytest.mark.slow
def test_a_failed_background_save_is_reported_cleaned_up_and_the_next_one_works(small, tmp_path):
    tiny_cfg, trainer, state, _ = small
    saver = None
    with small_disk(checkpoint.checkpoint_dir(tmp_path), 64 * 2**20) as resize:
        try:
            saver = checkpoint.Checkpointer(tiny_cfg, tmp_path, trainer)
            saver.save(1, state.replace(step=jnp.int32(1)), {"at": 1}, reason="test")
            assert saver.outcome(wait=True) == SaveOutcome(1)
            assert saver.outcome(wait=True) is None  # reported once
            resize(disk_bytes(checkpoint.checkpoint_dir(tmp_path)) + 64 * 2**10)  # full
            saver.save(2, state.replace(step=jnp.int32(2)), {"at": 2}, reason="test")
            failed = saver.outcome(wait=True)
            assert failed == SaveOutcome(2, "No space left on device [errno 28]",
                                                    checkpoint.checkpoint_dir(tmp_path), 1)
            assert [p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir()] == ["1"]
            resize(64 * 2**20)  # "continue": the next save is a save like any other
            saver.save(3, state.replace(step=jnp.int32(3)), {"at": 3}, reason="test")
            saver.close()
            saver = None
            assert checkpoint.committed_steps(tmp_path) == [1, 3]
            restored = checkpoint.Checkpointer(tiny_cfg, tmp_path, trainer).restore_latest(Events())
            assert restored.step == 3 and restored.data_state == {"at": 3}
        finally:
            if saver is not None:
                saver.manager.close()


class Outcomes:
    """A checkpointer whose saves have these outcomes, in turn."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)

    def outcome(self, wait=False):
        return self.outcomes.pop(0) if self.outcomes else None


def test_save_guard_reports_each_outcome_and_applies_on_save_error():
    failed = SaveOutcome(8, "No space left on device [errno 28]",
                                    Path("/runs/x/checkpoints"), 4)
    line = ("checkpoint at step 8 failed: No space left on device [errno 28] "
            "(/runs/x/checkpoints); last good checkpoint: step 4")
    for policy, ending, stops in [("stop", False, True), ("continue", False, False),
                                  ("continue", True, True)]:
        log = Events()
        guard = loop.SaveGuard(Outcomes(SaveOutcome(6), failed),
                               CheckpointConfig(on_save_error=policy), log)
        guard.check()
        if stops:
            with pytest.raises(SaveFailed) as raised:
                guard.check(ending=ending)
            assert str(raised.value) == line
        else:
            guard.check(ending=ending)
        assert log == [{"event": "checkpoint_saved", "step": 6},
                       {"event": "checkpoint_failed", "step": 8, "error": failed.error,
                        "last_good": 4, "action": "stop" if stops else "continue"}]
    guard = loop.SaveGuard(Outcomes(failed), CheckpointConfig(), Events())
    guard.check(raise_error=False)  # on the way out for another reason: reported, not raised


def test_save_error_puts_the_operating_systems_reason_first():
    tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local '
                             'file "/c/8.orbax-checkpoint-tmp/": Failed to write 54432 bytes to '
                             "file 11: No space left on device [os_error_code='28']")
    assert save_error(tensorstore) == "No space left on device [errno 28]"
    assert save_error(OSError(errno.EDQUOT, "quota")) == \
        f"{os.strerror(errno.EDQUOT)} [errno {errno.EDQUOT}]"
    assert save_error(TimeoutError("Timed out at a barrier\nmore")) == \
        "TimeoutError: Timed out at a barrier"


def test_a_save_reported_failed_after_its_commit_is_set_aside(small, tmp_path):
    tiny_cfg, trainer, state, _ = small
    saver = checkpoint.Checkpointer(tiny_cfg, tmp_path, trainer)
    saver.save(1, state.replace(step=jnp.int32(1)), {"at": 1}, reason="test")
    saver.save(2, state.replace(step=jnp.int32(2)), {"at": 2}, reason="test")
    wait = saver.manager.wait_until_finished

    def written_then_failed():  # e.g. a metadata write after the rename hit a full disk
        wait()
        raise OSError(errno.ENOSPC, "No space left on device")

    saver.manager.wait_until_finished = written_then_failed
    failed = saver.outcome(wait=True)
    saver.manager.wait_until_finished = wait
    saver.close()
    assert (failed.step, failed.last_good) == (2, 1)
    assert checkpoint.committed_steps(tmp_path) == [1]  # a resume takes the last good one
    assert [p.name.split("-")[0] for p in (tmp_path / checkpoint.CORRUPT_SUBDIR).iterdir()] \
        == ["2"]


def test_asyncio_s_unretrieved_failures_of_a_failed_save_are_dropped_whatever_their_kind():
    """One per array still being written when a save fails: Task, Future or, when several
    writes were gathered, _GatheringFuture (each with a traceback)."""
    from europa_jax.job import logs

    noise = logs._LibraryNoise()

    def record(message):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    for kind in ("Task", "Future", "_GatheringFuture"):
        assert not noise.filter(record(f"{kind} exception was never retrieved\nfuture: <...>"))
    assert noise.filter(record("Unclosed client session"))  # anything else stays
