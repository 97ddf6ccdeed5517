"""launch/local.sh: N processes on one machine, signals forwarded, no rank left hanging."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, config_path, process_env

LOCAL_SH = os.path.join(REPO, "launch", "local.sh")
# A stand-in for `europa-jax`: the launcher's own behaviour, in a second.
STAND_IN = """
import os, signal, sys, time
rank = int(os.environ["EUROPA_JAX_PROCESS_ID"])
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))
print("rank", rank, "of", os.environ["EUROPA_JAX_NUM_PROCESSES"], "at",
      os.environ["EUROPA_JAX_COORDINATOR"], "args", *sys.argv[1:], flush=True)
if rank == 1 and os.environ.get("STAND_IN_FAIL"):
    sys.exit(3)
time.sleep(300)
"""


def launch(tmp_path, n, *args, env=None, stand_in=True):
    run_env = process_env()
    run_env.update(EUROPA_LOG_DIR=str(tmp_path / "logs"), PYTHONPATH=REPO,
                   PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **(env or {}))
    if stand_in:
        (tmp_path / "stand_in.py").write_text(STAND_IN)
        run_env["EUROPA_JAX"] = f"{sys.executable} {tmp_path / 'stand_in.py'}"
    return subprocess.Popen([LOCAL_SH, str(n), config_path("tiny-cpu.yaml"), *args],
                            env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for_logs(tmp_path, n, text, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        logs = [tmp_path / "logs" / f"rank-{i}.log" for i in range(n)]
        if all(p.exists() and text in p.read_text() for p in logs):
            return
        time.sleep(0.2)
    raise TimeoutError(f"not every rank logged {text!r}")


@pytest.mark.slow
def test_each_rank_gets_its_id_one_coordinator_and_the_arguments(tmp_path):
    proc = launch(tmp_path, 3, "--set", "train.steps=2")
    wait_for_logs(tmp_path, 3, "args")
    proc.send_signal(signal.SIGUSR1)  # forwarded: every rank "saves" and exits 75
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    lines = [(tmp_path / "logs" / f"rank-{i}.log").read_text().split() for i in range(3)]
    assert [line[1] for line in lines] == ["0", "1", "2"]
    assert {line[3] for line in lines} == {"3"} and len({line[5] for line in lines}) == 1
    assert lines[0][7:] == ["train", config_path("tiny-cpu.yaml"), "--set", "train.steps=2"]


@pytest.mark.slow
def test_when_one_rank_dies_the_others_are_killed_after_the_grace_period(tmp_path):
    start = time.time()
    proc = launch(tmp_path, 2, env={"STAND_IN_FAIL": "1", "EUROPA_RANK_EXIT_WAIT_S": "2"})
    _, err = proc.communicate(timeout=60)
    assert time.time() - start < 30  # not the stand-in's 300 s
    assert proc.returncode == 128 + signal.SIGKILL  # the highest status, as srun reports it
    assert "rank 1 exited with 3" in err and "rank 0 exited with 137" in err


@pytest.mark.slow
def test_bad_arguments_are_one_line_errors(tmp_path):
    for args, message in [(["two", "x.yaml"], "local.sh: N: 'two' is not a positive integer"),
                          (["2", "missing.yaml"], "local.sh: CONFIG: missing.yaml: no such file")]:
        done = subprocess.run([LOCAL_SH, *args], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.startswith(message), done.stderr


@pytest.mark.slow
def test_a_mesh_the_processes_cannot_share_is_one_line_per_rank(tmp_path):
    proc = launch(tmp_path, 2, "--set", "mesh.data=3", "--set", "mesh.expert=1",
                  "--set", "data.global_batch_size=24", stand_in=False)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    for i in range(2):
        log = (tmp_path / "logs" / f"rank-{i}.log").read_text()
        assert log == ("europa-jax: error: mesh: data×expert = 3×1 = 3 devices cannot be split "
                       "evenly over the job's 2 processes (EUROPA_JAX_NUM_PROCESSES=2)\n")


@pytest.mark.slow
def test_two_cpu_processes_train_one_model(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(tmp_path, 2, "--run-dir", str(run_dir), "--set", "train.steps=2",
                  "--set", "model.d_model=32", "--set", "execution.remat=none",
                  "--set", "data.max_documents=40", "--set", "data.global_batch_size=8",
                  "--set", "train.eval_every=0",
                  "--set", "data.seq_len=64", "--set", "execution.attention_block_size=64",
                  stand_in=False)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    logs = [(tmp_path / "logs" / f"rank-{i}.log").read_text() for i in range(2)]
    for i, log in enumerate(logs):
        assert f"process {i} of 2 (local)" in log and "4 local cpu devices of 8" in log, log
        # Every log line carries time, level and rank: Python's (ours, jax's, Orbax's) and
        # what gloo's C++ prints to stdout; the last line is the JSON summary.
        lines = log.splitlines()
        assert any("gloo: [Gloo] Rank" in line for line in lines), log
        stamped = re.compile(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z]+ rank {i}/2 \S+: ")
        assert all(stamped.match(line) for line in lines[:-1]), log
    assert any("tokens/s/device" in line and "mfu" in line for line in logs[0].splitlines())
    # Expert rows of 4 devices stay inside a process; both processes end on the same loss.
    assert "expert groups:" in logs[0] and "[p0]" in logs[0] and "[p1]" in logs[0]
    finals = [json.loads(log.splitlines()[-1])["final_loss"] for log in logs]
    assert finals[0] == finals[1]
    assert [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()
            ] == [1, 2]
