"""Trackers (records/trackers.py): a tiny run's offline W&B files read back against
metrics.jsonl, the same W&B run after a resume, WANDB_* variables, a tracker that dies,
the missing package, bad `train.trackers`.

No test reaches the network: WANDB_MODE is unset or offline/disabled, and WANDB_BASE_URL
points at a closed local port, so anything that did try would fail at once.
"""

import json
import re
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from conftest import REPO, config_path, process_env, train_in_process
from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.records import trackers
from europa_jax.job.preemption import Preempted

SMALL = ["model.d_model=32", "model.q_lora_rank=16", "model.kv_lora_rank=16",
         "data.seq_len=64", "execution.attention_block_size=64", "execution.remat=none",
         "data.max_documents=60", "data.global_batch_size=8", "train.log_every=1",
         "checkpoint.every_steps=2", "data.validation_fraction=0.2", "train.eval_every=2",
         "train.eval_batches=2"]
# Variables that would change what these tests check; the tests set their own.
WANDB_ENV = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_RUN_ID",
             "WANDB_API_KEY", "WANDB_ENTITY")
OFFLINE = {"WANDB_SILENT": "true", "WANDB_BASE_URL": "http://127.0.0.1:9"}


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    for key in WANDB_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def cli_env(**extra) -> dict:
    return {**process_env(*WANDB_ENV), **OFFLINE, **extra}


def train(run_dir, *overrides):
    """`europa-jax train` of SMALL with `overrides`, by the loop in this process
    (conftest.train_in_process): what the trackers write does not need a process of its
    own, and this one has jax, wandb and the compiled step loaded already."""
    train_in_process(run_dir, [*SMALL, *overrides])


# ------------------------------------------------------- reading wandb's run files back

BLOCK_BYTES, HEADER_BYTES = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """The protobuf `Record`s of a `run-<id>.wandb` file, checksums checked.

    wandb's transaction log, as wandb/sdk/internal/datastore.py read it before its Go core
    took the file over (wandb 0.31 ships no Python reader): a ':W&B' header, then 32 KiB
    blocks of chunks, each `crc32 (seeded with the chunk type), length, type` and data; a
    record is one FULL chunk or FIRST, MIDDLE..., LAST. A block's tail shorter than a chunk
    header is padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:HEADER_BYTES] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), data[:7]
    pos, pieces = HEADER_BYTES, b""
    while pos + HEADER_BYTES <= len(data):
        left = BLOCK_BYTES - pos % BLOCK_BYTES
        if left < HEADER_BYTES:
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if (crc, length, kind) == (0, 0, 0):  # zeros after the last record
            break
        chunk = data[pos + HEADER_BYTES: pos + HEADER_BYTES + length]
        pos += HEADER_BYTES + length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path} at {pos}"
        pieces += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


def read_wandb_run(run_file: Path) -> dict:
    """The run record (id, project, name, config) and the history by step."""
    run, history = None, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            # wandb names an item by `key` or by `nested_key` (a path; ours are flat)
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items()
                                                if not k.startswith("_")}
    config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    return {"id": run.run_id, "project": run.project, "name": run.display_name,
            "config": config, "history": history}


def offline_runs(run_dir: Path) -> list[Path]:
    """Each try's `run-<id>.wandb`, oldest first (the directory names start with the time)."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"),
                  key=lambda p: p.parent.name)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------- a tiny run, resumed


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """Two steps with trackers [tensorboard, wandb] and WANDB_MODE unset, then the same run
    directory to step 4: the second invocation resumes from the first's final checkpoint."""
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    with pytest.MonkeyPatch.context() as mp:  # offline_wandb's (it starts after this)
        for key in WANDB_ENV:
            mp.delenv(key, raising=False)
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        for steps in (2, 4):
            train(run_dir, f"train.steps={steps}", "train.trackers=[tensorboard,wandb]")
    return run_dir


@pytest.mark.slow
def test_offline_wandb_files_hold_the_logged_metrics(wandb_run):
    tries = [read_wandb_run(p) for p in offline_runs(wandb_run)]
    assert len(tries) == 2  # one offline directory per invocation
    assert [sorted(t["history"]) for t in tries] == [[1, 2], [3, 4]]  # no step twice
    history = {**tries[0]["history"], **tries[1]["history"]}
    records = metrics(wandb_run)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        row = history[r["step"]]
        assert row["loss"] == r["loss"] and row["grad_norm"] == r["grad_norm"]
        assert row["lr"] == r["lr"]
        for i, value in enumerate(r["expert_load_max_over_mean_per_layer"]):
            assert row[f"expert_load_max_over_mean_per_layer/layer_{i}"] == value
        assert "compiled" not in row and "step" not in row
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    for r in val:  # in its step's row, beside the training scalars
        assert history[r["step"]]["val_loss"] == r["val_loss"]
        assert history[r["step"]]["val_tokens"] == r["val_tokens"]


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(wandb_run):
    run_id = (wandb_run / trackers.RUN_ID_FILE).read_text().strip()
    assert re.fullmatch(r"[a-z0-9]{8}", run_id)
    files = offline_runs(wandb_run)
    assert [p.name for p in files] == [f"run-{run_id}.wandb"] * 2
    for t in map(read_wandb_run, files):
        assert t["id"] == run_id
        assert (t["project"], t["name"]) == ("europa-jax", wandb_run.name)


@pytest.mark.slow
def test_the_config_is_the_wandb_runs_config(wandb_run):
    first, second = map(read_wandb_run, offline_runs(wandb_run))
    # config.json is the latest invocation's resolved config, section by section
    assert second["config"] == json.loads((wandb_run / "config.json").read_text())
    assert first["config"]["train"]["steps"] == 2 and second["config"]["train"]["steps"] == 4
    assert second["config"]["train"]["trackers"] == ["tensorboard", "wandb"]
    assert second["config"]["model"]["d_model"] == 32


@pytest.mark.slow
def test_wandb_sync_recognizes_the_offline_runs(wandb_run):
    files = offline_runs(wandb_run)
    done = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run",
                           *(str(p.parent) for p in files)], capture_output=True, text=True,
                          timeout=120, env=cli_env())
    assert done.returncode == 0, done.stderr
    assert "Would sync 2 run(s)" in done.stderr + done.stdout
    for p in files:
        assert str(p) in done.stderr + done.stdout


@pytest.mark.slow
def test_tensorboard_gets_the_same_steps_beside_wandb(wandb_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(wandb_run))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("loss")]
    train = [r for r in metrics(wandb_run) if "loss" in r]
    assert [s for s, _ in losses] == [r["step"] for r in train]
    assert [v for _, v in losses] == pytest.approx([r["loss"] for r in train], rel=1e-6)


@pytest.mark.slow
def test_wandb_mode_disabled_writes_nothing(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train(run_dir, "train.steps=2", "train.trackers=[wandb]")
    assert [r["step"] for r in metrics(run_dir) if "loss" in r] == [1, 2]  # always written
    assert not (run_dir / "wandb").exists() and not (run_dir / trackers.RUN_ID_FILE).exists()
    assert not list(run_dir.glob("events.out.tfevents*"))  # not named: no TensorBoard


# ------------------------------------------------------------------ the W&B tracker


def test_steps_go_forward_from_the_resume_and_only_finite_numbers_go(tmp_path):
    tracker = trackers.WandB(tmp_path, start_step=2, config={"train": {"steps": 5}})
    tracker.log({"step": 2, "loss": 9.0})  # the checkpoint's step: logged by the earlier try
    tracker.log({"step": 3, "loss": 1.0, "grad_norm": float("nan"), "compiled": True,
                 "x_per_layer": [0.5, float("inf"), 2]})
    tracker.log({"step": 3, "val_loss": 2.0})  # joins step 3's row
    tracker.log({"step": 1, "loss": 8.0})  # backwards
    tracker.log({"step": 4, "loss": 0.5})
    tracker.close()
    (run_file,) = offline_runs(tmp_path)
    history = read_wandb_run(run_file)["history"]
    assert history == {3: {"loss": 1.0, "val_loss": 2.0, "x_per_layer/layer_0": 0.5,
                           "x_per_layer/layer_2": 2},
                       4: {"loss": 0.5}}


@pytest.mark.parametrize("exc, kinds, exit_code", [
    (None, [], 0),
    (Preempted(2, "SIGUSR1"), ["preempting"], 1),  # W&B shows it preempted, not crashed
    (RuntimeError("boom"), [], 1),
])
def test_how_the_run_ended_is_the_wandb_runs_exit(tmp_path, exc, kinds, exit_code):
    tracker = trackers.WandB(tmp_path, start_step=0, config={})
    tracker.log({"step": 1, "loss": 1.0})
    tracker.close(exc)
    (run_file,) = offline_runs(tmp_path)
    records = list(wandb_records(run_file))
    assert [k for r in records if (k := r.WhichOneof("record_type")) == "preempting"] == kinds
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == exit_code


def test_wandb_variables_name_the_project_run_and_place(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("WANDB_PROJECT", "moe-sweep")
    monkeypatch.setenv("WANDB_NAME", "lr-3e-4")
    monkeypatch.setenv("WANDB_DIR", str(elsewhere))
    monkeypatch.setenv("WANDB_RUN_ID", "given1")
    (tmp_path / "run").mkdir()
    tracker = trackers.WandB(tmp_path / "run", start_step=0, config={})
    tracker.log({"step": 1, "loss": 1.0})
    tracker.close()
    assert not (tmp_path / "run" / "wandb").exists()
    (run_file,) = offline_runs(elsewhere)
    run = read_wandb_run(run_file)
    assert (run["id"], run["project"], run["name"]) == ("given1", "moe-sweep", "lr-3e-4")
    assert run["history"] == {1: {"loss": 1.0}}


def test_the_run_id_is_made_once_per_run_directory(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    first = trackers.run_id(tmp_path / "a")
    assert re.fullmatch(r"[a-z0-9]{8}", first)
    assert (tmp_path / "a" / trackers.RUN_ID_FILE).read_text().strip() == first
    assert trackers.run_id(tmp_path / "a") == first
    (tmp_path / "b").mkdir()
    assert trackers.run_id(tmp_path / "b") != first
    monkeypatch.setenv("WANDB_RUN_ID", "chosen")
    assert trackers.run_id(tmp_path / "a") == first  # the run directory's id stays
    (tmp_path / "c").mkdir()
    assert trackers.run_id(tmp_path / "c") == "chosen"


@pytest.mark.slow
def test_a_dead_wandb_service_stops_tracking_not_training(tmp_path):
    """SIGTERM to wandb's service process (a scheduler signalling every process of the
    step): the tracker warns once and every later call returns."""
    script = textwrap.dedent(f"""
        import logging, os, signal, time
        from pathlib import Path
        from europa_jax.records import trackers

        logging.basicConfig(level=logging.WARNING)
        tracker = trackers.WandB(Path({str(tmp_path)!r}), start_step=0, config={{}})
        tracker.log({{"step": 1, "loss": 1.0}})
        children = [int(p) for p in os.listdir("/proc") if p.isdigit()
                    and open(f"/proc/{{p}}/stat").read().split(") ")[-1].split()[1]
                    == str(os.getpid())]
        cores = [p for p in children if "wandb-core" in open(f"/proc/{{p}}/cmdline").read()]
        assert len(cores) == 1, cores
        os.kill(cores[0], signal.SIGTERM)
        time.sleep(1)
        for step in (2, 3):
            tracker.log({{"step": step, "loss": 0.5}})
        tracker.close()
        print("training goes on")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=cli_env())
    assert done.returncode == 0 and "training goes on" in done.stdout, done.stderr[-3000:]
    assert done.stderr.count("W&B tracking stops here") == 1, done.stderr[-3000:]


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("primary", [True, False])
def test_a_missing_wandb_package_is_refused_by_every_process(monkeypatch, primary):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError) as e:
        trackers.check_trackers(("tensorboard", "wandb"), primary=primary)
    assert str(e.value) == ("train.trackers: wandb needs the wandb package: "
                            "pip install -e '.[wandb]'")
    trackers.check_trackers(("tensorboard",), primary=primary)  # not needed: no error


@pytest.mark.slow
def test_a_missing_wandb_package_is_one_line_exit_2_before_the_run_dir(tmp_path):
    # its own process: the CLI sets the CPU device count, which a test worker whose JAX
    # backend has already started would refuse
    overrides = [*SMALL, "train.steps=2", "train.trackers=[wandb]"]
    args = ["train", config_path("tiny-cpu.yaml"), "--run-dir", str(tmp_path / "run"), "--quiet"]
    for item in overrides:
        args += ["--set", item]
    script = ("import sys; sys.modules['wandb'] = None\n"  # `import wandb` raises ImportError
              "from europa_jax import cli\n"
              f"sys.exit(cli.main({args!r}))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=cli_env())
    assert done.returncode == 2, done.stderr[-3000:]
    err = done.stderr.strip()
    assert err == f"europa-jax: error: {trackers.WANDB_MISSING}", err
    assert "pip install -e '.[wandb]'" in err and not (tmp_path / "run").exists()


def test_an_unknown_wandb_mode_is_refused(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offlne")
    with pytest.raises(ConfigError, match=re.escape("WANDB_MODE: 'offlne' is not one of: ")):
        trackers.check_trackers(("wandb",), primary=True)


@pytest.mark.parametrize("value, message", [
    ("[tensorboard, comet]", "train.trackers: ['tensorboard', 'comet'] has unknown 'comet'; "
                             "expected a list of distinct names from: tensorboard, wandb"),
    ("[wandb, wandb]", "train.trackers: ['wandb', 'wandb'] has a name repeated; expected a "
                       "list of distinct names from: tensorboard, wandb"),
    ("wandb", "train.trackers: expected a list, got 'wandb'"),
])
def test_bad_trackers_are_one_line_errors(value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(config_path("tiny-cpu.yaml"), [f"train.trackers={value}"])


def test_trackers_default_to_tensorboard_and_may_be_none():
    assert load_config(config_path("tiny-cpu.yaml")).train.trackers == ("tensorboard",)
    none = load_config(config_path("tiny-cpu.yaml"), ["train.trackers=[]"])
    assert none.train.trackers == ()
