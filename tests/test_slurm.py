"""launch/jupiter.sbatch under a real one-node Slurm (munged, slurmctld, slurmd on localhost).

The script is submitted as a Jupiter user would submit it; only sbatch options and the
environment change: 2 tasks × 4 CPU devices each (mesh 2×4, the expert axis inside a
process) instead of 96 nodes × 4 GH200. Needs root and Debian's slurm-wlm + munge
(.ci/run installs them and sets EUROPA_JAX_REQUIRE_SLURM=1, so CI fails instead of skipping).
"""

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

import slurm_cluster
from conftest import REPO, process_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = os.path.join(REPO, "launch", "jupiter.sbatch")
STEPS = 16
# The test-size model (seconds per step on 2 cores). Only the preemption and the final
# step save, so the resumed run can only start from the preemption's checkpoint.
TRAIN = [f"train.steps={STEPS}", "train.log_every=1", "checkpoint.every_steps=0",
         "model.d_model=32", "model.q_lora_rank=16", "model.kv_lora_rank=16",
         "execution.remat=none", "data.seq_len=64", "execution.attention_block_size=64",
         "data.max_documents=40", "data.global_batch_size=8", "train.eval_every=0"]
# CPU stand-ins for the script's GH200 defaults, given the way a user overrides them.
CPU_JOB = ["--partition=ci", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
           "--gres=none", "--time=30"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def slurm():
    missing = slurm_cluster.missing_programs()
    problem = (f"Slurm programs not installed: {', '.join(missing)}" if missing else
               "needs root: slurmd starts job steps as their user" if os.geteuid() else None)
    if problem:
        if os.environ.get("EUROPA_JAX_REQUIRE_SLURM") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    # Not under pytest's 0700 temp root: munged wants a socket directory others can reach.
    cluster = slurm_cluster.SlurmCluster(Path(tempfile.mkdtemp(prefix="europa-slurm-")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(scope="module")
def job_env():
    # Not conftest's 8 devices per process, and not the session's compilation cache: the
    # run's own (<run_dir>/compile_cache, the default), so that the requeued try's compile
    # is a hit on what the first try wrote, and the first try's a miss.
    env = process_env("JAX_COMPILATION_CACHE_DIR")
    env.update(EUROPA_VENV=sys.prefix, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    return env


def submit(slurm, job_env, tmp_path, **env) -> int:
    overrides = [a for item in TRAIN for a in ("--set", item)]
    return slurm.sbatch(*CPU_JOB, f"--output={tmp_path}/job-%j.out", SBATCH,
                        "configs/tiny-cpu.yaml", "--run-dir", str(tmp_path / "run"), *overrides,
                        env={**job_env, "EUROPA_LOG_DIR": str(tmp_path / "logs"), **env},
                        cwd=REPO)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(slurm, job, tmp_path: Path, step: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while len(records(tmp_path / "run" / "metrics.jsonl")) < step:
        state = slurm.job(job)["JobState"]
        if state in ENDED or time.time() > deadline:
            raise AssertionError(f"job {job} is {state} before step {step}\n"
                                 + show(tmp_path, job))
        time.sleep(0.5)


def show(tmp_path, job) -> str:
    """The job's outputs: what the test prints (pytest -s) and what a failure shows."""
    parts = [f"=== {p.relative_to(tmp_path)}\n{p.read_text()}"
             for p in [tmp_path / f"job-{job}.out", *sorted((tmp_path / "logs").glob("*.log"))]
             if p.exists()]
    return "\n".join(parts)


@pytest.mark.slow
def test_trains_on_two_processes_then_usr1_requeues_and_resumes(slurm, job_env, tmp_path):
    """Try 0 is preempted by USR1 in a step and saves it; try 1 gets a SIGTERM while it
    restores, before its first step (fault_injection: a time limit's signal that early),
    and is requeued too; try 2 finishes."""
    run_dir = tmp_path / "run"
    job = submit(slurm, job_env, tmp_path, EUROPA_JAX_INJECT_SIGNAL="restore:SIGTERM",
                 EUROPA_JAX_INJECT_SIGNAL_TRY="1")
    wait_for_step(slurm, job, tmp_path, 3)
    slurm.run("scancel", "--signal=USR1", str(job))  # what --signal=USR1@900 does at the limit
    final = slurm.wait(job, lambda j: j["JobState"] in ENDED, timeout=600)
    outputs = show(tmp_path, job)
    print(outputs)
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "2"), \
        outputs + slurm.logs()

    batch = (tmp_path / f"job-{job}.out").read_text()
    assert "try 0: ranks exited with 75" in batch and "requeueing" in batch
    assert "try 1: ranks exited with 75" in batch and "try 2: ranks exited with 0" in batch
    logs = tmp_path / "logs"
    for rank in (0, 1):  # before the first step: one line each, nothing new saved
        lines = [line for line in (logs / f"try-1-rank-{rank}.log").read_text().splitlines()
                 if line.startswith("europa-jax:")]
        assert len(lines) == 1 and "stop requested (SIGTERM) while restoring" in lines[0], lines
    for attempt in (0, 2):
        for rank in (0, 1):
            log = (logs / f"try-{attempt}-rank-{rank}.log").read_text()
            assert f"process {rank} of 2 (slurm)" in log and "4 local cpu devices of 8" in log
    # The expert axis stays inside a process: one group per process, on this node.
    assert re.search(rf"expert groups: {slurm.node}\[p0\] {slurm.node}\[p1\]",
                     (logs / "try-0-rank-0.log").read_text())

    events = records(run_dir / "events.jsonl")
    preempted, early = [e for e in events if e["event"] == "preempted"]
    assert (early["step"], early["phase"], early["saved"]) == (None, "restore", False)
    restored = [e for e in events if e["event"] == "checkpoint_restored"]
    assert restored and restored[-1]["step"] == preempted["step"] < STEPS
    # Written by both processes together: the preemption's step and the final one.
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [preempted["step"], STEPS], saved
    steps = [r["step"] for r in records(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))  # each step once, across the two tries

    # Cheap restarts: the requeued try loads rank 0's program from the run's compile cache
    # (on CPU only process 0's key is written, so rank 1 compiles again; on GPU one serves all).
    starts = [e for e in events if e["event"] == "start_phases"]
    assert [e["compile_cache_hit"] for e in starts] == [False, True], starts
    assert starts[1]["compile_s"] < starts[0]["compile_s"], starts
    assert [e["restored"] for e in starts] == [False, True]
    for attempt, words in [(0, "(compiled;"), (2, "(a compile-cache hit;")]:
        log = (logs / f"try-{attempt}-rank-0.log").read_text()
        line = re.search(r"start: process start .*", log)
        assert line and words in line.group(0), line
    assert list((run_dir / "compile_cache").glob("jit_train_step-*"))


@pytest.mark.slow
def test_killing_one_rank_ends_the_job_non_zero_within_120_s(slurm, job_env, tmp_path):
    job = submit(slurm, job_env, tmp_path)
    wait_for_step(slurm, job, tmp_path, 1)
    log = (tmp_path / "logs" / "try-0-rank-1.log").read_text()
    pid = int(re.search(r"process 1 of 2 \(slurm\) on \S+, pid (\d+)", log)[1])
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    final = slurm.wait(job, lambda j: j["JobState"] in ENDED, timeout=300)
    seconds = time.time() - killed
    outputs = show(tmp_path, job)
    print(f"{outputs}\njob ended {seconds:.1f} s after the kill")
    assert final["JobState"] == "FAILED" and final["ExitCode"] != "0:0", outputs
    assert final["Restarts"] == "0"  # a crash is not a preemption: no requeue
    assert seconds < 120, outputs
