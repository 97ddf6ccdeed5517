"""A run's history is never discarded by a retry (store/history.py, records/run_log.py): a
directory whose checkpoints are all gone is refused a silent start from step 0; a
deliberate `--start-over` keeps the old records; a full disk under metrics.jsonl is one
line and exit 1; a line a kill cut short is repaired on the next start."""

import json
import subprocess
import sys

import pytest

from europa_jax.store import checkpoint, history
from europa_jax.job import exit_codes
from europa_jax.records import run_log
from conftest import REPO, config_path
from test_checkpoint import TINY, cli_env, events, metrics, run_cli  # noqa: F401


def write_jsonl(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_a_directory_that_saved_before_is_refused_a_start_from_step_0(tmp_path):
    assert history.check_start(tmp_path, start_over=False) == []  # fresh
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 5.0}])
    assert history.check_start(tmp_path, start_over=False) == []  # never saved: nothing lost
    write_jsonl(tmp_path / "events.jsonl", [{"event": "checkpoint_saved", "step": 4}])
    (tmp_path / checkpoint.CORRUPT_SUBDIR / "8-20261206").mkdir(parents=True)
    with pytest.raises(history.HistoryWouldBeLost) as refused:
        history.check_start(tmp_path, start_over=False)
    line = str(refused.value)
    assert "\n" not in line and "--start-over" in line
    assert "1 checkpoint(s) set aside" in line and "8-20261206" in line
    assert "saves of step 4 in events.jsonl" in line and "1 records in metrics.jsonl" in line
    assert len(history.check_start(tmp_path, start_over=True)) == 3


def test_a_line_a_kill_cut_short_is_dropped_and_the_next_record_starts_its_own(tmp_path):
    path = tmp_path / "events.jsonl"
    write_jsonl(path, [{"event": "checkpoint_saved", "step": 2}], tail='{"event": "checkp')
    log = run_log.EventLog(tmp_path, enabled=True)
    log("checkpoint_saved", step=4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 4]
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1}, {"step": 2}, {"step": 3}],
                tail='{"step": 4, "lo')
    with run_log.MetricsLog(tmp_path, 2, True, {}, trackers=()) as metrics_log:
        metrics_log({"step": 3, "loss": 1.0})
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
            ] == [{"step": 1}, {"step": 2}, {"step": 3, "loss": 1.0}]


def damage_every_checkpoint(run_dir):
    for step in checkpoint.committed_steps(run_dir):
        item = checkpoint.checkpoint_dir(run_dir) / str(step) / "state"
        for path in item.rglob("*"):
            if path.is_file() and "/d/" in str(path):
                path.write_bytes(b"")


@pytest.mark.slow
def test_a_retry_after_every_checkpoint_was_set_aside_refuses_then_starts_over_on_request(
        tmp_path, cli_env):  # noqa: F811
    rc, _, err = run_cli(tmp_path, cli_env, "train.steps=4")
    assert rc == exit_codes.OK, err[-3000:]
    damage_every_checkpoint(tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    rc, _, err = run_cli(tmp_path, cli_env, "train.steps=4")  # sets them aside, refuses
    assert rc == exit_codes.BAD_INPUT and "no usable checkpoint" in err, err[-3000:]
    assert "--start-over" in err
    rc, _, err = run_cli(tmp_path, cli_env, "train.steps=4")  # the requeue's retry
    assert rc == exit_codes.BAD_INPUT, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("europa-jax")]
    assert "no usable checkpoint, but this run saved before" in line and "--start-over" in line
    assert "Traceback" not in err
    assert (tmp_path / "metrics.jsonl").read_text() == before  # history untouched
    assert not checkpoint.committed_steps(tmp_path)
    args = [sys.executable, "-m", "europa_jax.cli", "train", config_path("tiny-cpu.yaml"),
            "--run-dir", str(tmp_path), "--start-over",
            *[a for item in [*TINY, "train.steps=4"] for a in ("--set", item)]]
    done = subprocess.run(args, cwd=REPO, env=cli_env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == exit_codes.OK, done.stderr[-3000:]
    (kept,) = tmp_path.glob("metrics.before-start-over-*.jsonl")
    assert kept.read_text() == before
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4]
    (started,) = [e for e in events(tmp_path) if e["event"] == "started_over"]
    assert started["kept"] == kept.name and "starting over at step 0" in done.stderr


# metrics.jsonl's disk fills at step 3: half a line goes out, then ENOSPC (a test-only
# fault at the seam run_log opens the file through, as the save tests do)
FULL_DISK_DRIVER = """
import errno, sys
from europa_jax.records import run_log
real_open = run_log.open_for_records
class FillsUp:
    def __init__(self, f):
        self.f = f
    def write(self, text):
        if text.startswith('{"step": 3,'):
            self.f.write(text[:20]); self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(text)
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
def fills_up(path):
    f = real_open(path)
    return FillsUp(f) if path.name == "metrics.jsonl" else f
run_log.open_for_records = fills_up
from europa_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_under_metrics_is_one_line_and_the_resume_repairs_the_cut_line(
        tmp_path, cli_env):  # noqa: F811
    args = [a for item in TINY for a in ("--set", item)]
    done = subprocess.run([sys.executable, "-c", FULL_DISK_DRIVER, "train",
                           config_path("tiny-cpu.yaml"), "--run-dir", str(tmp_path), *args],
                          cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == exit_codes.CRASH, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("europa-jax")]
    assert line.startswith(f"europa-jax: error: {tmp_path / 'metrics.jsonl'}: could not be "
                           "written (No space left on device); the run stops")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "metrics.jsonl").read_text().endswith("\n")  # the cut line
    rc, _, err = run_cli(tmp_path, cli_env)
    assert rc == exit_codes.OK, err[-3000:]
    assert "its last line was cut short" in err
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 9))


@pytest.mark.slow
def test_a_shard_truncated_while_the_run_reads_it_is_one_line_not_a_sigbus(tmp_path,
                                                                           cli_env):  # noqa: F811
    texts = [f"def f{i}(x):\n    return x * {i}\n" * (2 + i % 5) for i in range(200)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepared = subprocess.run([sys.executable, "-m", "europa_jax.cli", "prepare", "--input",
                               str(tmp_path / "code.jsonl"), "--out", str(tmp_path / "corpus")],
                              cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    (shard,) = (tmp_path / "corpus").glob("*tokens*")
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "europa_jax.cli", "train", config_path("tiny-cpu.yaml"),
            "--run-dir", str(run_dir),
            *[a for item in [*TINY, "train.steps=200", "checkpoint.every_steps=0",
                             "data.source=prepared", f"data.path={tmp_path / 'corpus'}",
                             "data.validation_fraction=0"] for a in ("--set", item)]]
    proc = subprocess.Popen(args, cwd=REPO, env=cli_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    from test_checkpoint import wait_for_step
    wait_for_step(proc, run_dir, 2)
    with shard.open("r+b") as f:  # a careless copy or cleanup, as the run reads the file
        f.truncate(shard.stat().st_size // 3)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == exit_codes.BAD_INPUT, err[-3000:]  # not -7 (SIGBUS)
    (line,) = [x for x in err.splitlines() if x.startswith("europa-jax")]
    assert line.startswith(f"europa-jax: error: {shard}: ") and "changed while the run" in line
    assert "Traceback" not in err
    (event,) = [e for e in events(run_dir) if e["event"] == "data_error"]
    assert str(shard) in event["error"]
