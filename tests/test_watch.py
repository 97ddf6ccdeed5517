"""Watching a run: validation loss, TensorBoard events, profiler trace, memory, logs, report."""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, config_path
from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.data import sources as data_sources

SMALL = ["model.d_model=32", "model.q_lora_rank=16", "model.kv_lora_rank=16",
         "data.seq_len=64", "execution.attention_block_size=64", "execution.remat=none",
         "data.max_documents=60", "data.global_batch_size=8", "train.steps=4",
         "train.log_every=1", "checkpoint.every_steps=2", "data.validation_fraction=0.2",
         "train.eval_every=2", "train.eval_batches=2", "train.profile_steps=[2,3]"]


def train_cli(run_dir, *overrides, flags=()):
    args = [sys.executable, "-m", "europa_jax.cli", "train", config_path("tiny-cpu.yaml"),
            "--run-dir", str(run_dir), *flags]
    for item in [*SMALL, *overrides]:
        args += ["--set", item]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)


def scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc, [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    """A tiny run with validation and a profile, killed after step 4's save is removed and
    resumed from step 2 with --quiet: what a user sees after a restart."""
    run_dir = tmp_path_factory.mktemp("watched") / "run"
    first = train_cli(run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    losses_before = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl")
                                            .read_text().splitlines()) if "loss" in r]
    shutil.rmtree(run_dir / "checkpoints" / "4")  # the resume starts again from step 2
    second = train_cli(run_dir, "train.profile_steps=[]", flags=["--quiet"])
    assert second.returncode == 0, second.stderr[-3000:]
    return run_dir, first, second, losses_before


@pytest.mark.slow
def test_validation_loss_is_logged_on_the_same_batches(watched_run):
    run_dir, _, _, _ = watched_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]  # once each, after the resume too
    for r in val:
        assert np.isfinite(r["val_loss"]) and r["val_tokens"] > 0
        assert r["val_perplexity"] == pytest.approx(np.exp(r["val_loss"]), rel=1e-6)
    assert len({r["val_tokens"] for r in val}) == 1  # the same validation batches each time


@pytest.mark.slow
def test_tensorboard_reads_every_scalar_once_after_a_resume(watched_run):
    run_dir, _, _, losses_before = watched_run
    acc, loss = scalars(run_dir, "loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4]  # steps 3-4 of the first try purged
    # the resumed run repeats steps 3-4 bitwise from the step-2 checkpoint
    assert [v for _, v in loss] == pytest.approx(losses_before, rel=1e-6)
    _, val = scalars(run_dir, "val_loss")
    assert [s for s, _ in val] == [2, 4]
    tags = acc.Tags()["scalars"]
    for tag in ("grad_norm", "lr", "tokens_per_s_per_device", "mfu",
                "expert_load_max_over_mean_per_layer/layer_0",
                "router_bias_spread_per_layer/layer_1"):
        assert tag in tags, tag
    assert any(t.startswith("config") for t in acc.Tags()["tensors"])  # the config as text


@pytest.mark.slow
def test_profile_steps_write_a_trace(watched_run):
    run_dir, first, _, _ = watched_run
    traces = list((run_dir / "profile" / "process-0").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    assert "profiling steps 2-3" in first.stderr


@pytest.mark.slow
def test_memory_after_the_first_step_matches_the_state(watched_run):
    from europa_jax.parallel import offload, sharding
    from europa_jax.train import train

    run_dir, first, _, _ = watched_run
    memory = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "memory"]
    assert [m["step"] for m in memory] == [1, 3]  # the first step of each invocation
    cfg = load_config(config_path("tiny-cpu.yaml"), SMALL)
    state = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh)).abstract_state
    expected = sum(n for part in offload.state_bytes(state).values() for n in part.values())
    assert sum(memory[0]["state_bytes_per_device"].values()) == expected
    assert "memory after step 1: train state per device: device" in first.stderr


@pytest.mark.slow
def test_log_lines_carry_time_level_rank_and_throughput(watched_run):
    _, first, _, _ = watched_run
    lines = [line for line in first.stderr.splitlines() if "europa_jax" in line]
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING) rank 0/1 europa_jax\.")
    assert lines and all(stamp.match(line) for line in lines), first.stderr[-3000:]
    step_lines = [line for line in lines if " step 3/4 " in line]
    assert step_lines and "tokens/s/device" in step_lines[0] and "mfu" in step_lines[0]
    assert any("val_loss" in line for line in lines)


@pytest.mark.slow
def test_quiet_shows_no_info_lines(watched_run):
    # the resume ran with --quiet: its restore, steps and validation log no INFO line
    # (the first invocation's did: test_log_lines_carry_time_level_rank_and_throughput)
    _, _, second, _ = watched_run
    assert " INFO " not in second.stderr


@pytest.mark.slow
def test_report_of_the_run(watched_run, tmp_path):
    run_dir, _, _, _ = watched_run
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "europa_jax.cli", "report", str(run_dir),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    import matplotlib.image

    for name in ("loss.png", "lr.png", "grad_norm.png", "throughput.png", "experts.png",
                 "attention_logits.png", "attention_balance.png"):
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 100 and image.std() > 0.01, name
    assert "restarts: 1" in done.stdout and "best val loss:" in done.stdout


@pytest.mark.slow
def test_report_of_a_missing_run_is_a_one_line_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "europa_jax.cli", "report",
                           str(tmp_path / "nope")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert str(tmp_path / "nope") in done.stderr


# ----------------------------------------------------------------------------- the split


def test_split_is_disjoint_deterministic_and_the_requested_fraction():
    train_a, val_a = data_sources.split_documents(20_000, 0.1, seed=3)
    train_b, val_b = data_sources.split_documents(20_000, 0.1, seed=3)
    assert np.array_equal(val_a, val_b) and np.array_equal(train_a, train_b)
    assert not set(train_a) & set(val_a) and len(train_a) + len(val_a) == 20_000
    assert abs(len(val_a) / 20_000 - 0.1) < 0.01
    # a document keeps its side when the corpus grows; another seed is another split
    _, val_grown = data_sources.split_documents(40_000, 0.1, seed=3)
    assert np.array_equal(val_grown[val_grown < 20_000], val_a)
    assert not np.array_equal(data_sources.split_documents(20_000, 0.1, seed=4)[1], val_a)


def test_held_out_documents_never_reach_training_batches(tiny_cfg):
    import dataclasses

    # 200 documents, 262,144 tokens a batch: 14 batches are more than an epoch
    cfg = dataclasses.replace(tiny_cfg, data=dataclasses.replace(
        tiny_cfg.data, max_documents=200, validation_fraction=0.1, prefetch=0, seq_len=256,
        global_batch_size=1024))
    training, held_out = data_sources.split_documents(200, 0.1, cfg.data.seed)
    seen = set()
    batches = data_sources.batch_iterator_for(cfg)
    for _ in range(14):
        next(batches)
        seen |= set(batches.stats.documents_Z.tolist())
    assert len(held_out) > 10 and seen == set(training.tolist())  # all of them, and only them
    first, again = data_sources.validation_iterator_for(cfg), data_sources.validation_iterator_for(cfg)
    for _ in range(3):
        a, b = next(first), next(again)
        assert all(np.array_equal(a[k], b[k]) for k in a)
        assert set(first.stats.documents_Z.tolist()) <= set(held_out.tolist())


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_every=5", "data.validation_fraction=0"],
     "train.eval_every: 5 but there are no validation documents"),
    (["data.validation_fraction=1.0"], "data.validation_fraction: 1.0 must be in [0, 1)"),
    (["data.validation_fraction=0.1", "data.validation_path=x"], "choose one"),
    (["train.profile_steps=[3]"], "train.profile_steps: [3] must be [first, last]"),
    (["train.profile_steps=[4,2]"], "train.profile_steps: [4, 2] must be [first, last]"),
    (["train.profile_steps=3"], "train.profile_steps: expected a list, got 3"),
])
def test_bad_watch_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(config_path("tiny-cpu.yaml"), overrides)


@pytest.mark.slow
def test_a_validation_corpus_that_is_not_there_fails_before_training(tmp_path):
    done = subprocess.run([sys.executable, "-m", "europa_jax.cli", "train",
                           config_path("tiny-cpu.yaml"), "--run-dir", str(tmp_path / "r"),
                           "--set", f"data.validation_path={tmp_path / 'missing'}",
                           "--set", "train.eval_every=2"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and str(tmp_path / "missing") in done.stderr, done.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
