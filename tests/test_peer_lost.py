"""A peer that vanishes (kill -9 of one of two processes) ends the survivor in one line
naming what was lost, a `peer_lost` event and exit 75, so that Slurm requeues the job and
the retry resumes from the last checkpoint (run/peer_lost.py)."""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from europa_jax.run import exit_codes, peer_lost
from conftest import REPO, process_env
from test_checkpoint import cli_env, events, start_two_processes, wait_for_step  # noqa: F401


# Which route reaches the survivor first is timing: gloo's error in a collective (exit 75)
# or the coordination service's heartbeat timeout, whose route still aborts the process —
# jaxlib 0.12.0.1 takes peer_lost's Python callback but cannot call it (std::bad_cast; the
# README and run/peer_lost.py say so). Until that route is ours this test may fail by
# aborting; it stays, so that it passes again when the route is fixed.
@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="the heartbeat route aborts the survivor: jaxlib "
                   "0.12.0.1 cannot call the Python missed-heartbeat callback")
def test_a_peer_killed_mid_run_ends_the_survivor_with_the_requeue_code(tmp_path, cli_env):  # noqa: F811
    env = {**cli_env, "EUROPA_JAX_HEARTBEAT_TIMEOUT_S": "10"}
    procs = start_two_processes(tmp_path, env, "train.steps=200", "checkpoint.every_steps=2")
    wait_for_step(procs[0], tmp_path, 3)
    procs[1].send_signal(signal.SIGKILL)
    began = time.time()
    _, err = procs[0].communicate(timeout=300)
    procs[1].communicate(timeout=60)
    assert procs[0].returncode == exit_codes.PREEMPTED, err[-3000:]
    assert time.time() - began < 120
    assert "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("europa-jax")]
    assert "lost" in line and "requeue" in line, line
    (lost,) = [e for e in events(tmp_path) if e["event"] == "peer_lost"]
    assert lost["process"] == 0


HEARTBEATS = ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n"
              "The tasks have crashed. Check the task logs for an earlier error.")


def test_the_lost_processes_are_read_from_the_coordination_service_s_message():
    assert peer_lost.lost_processes(HEARTBEATS) == [1]
    assert peer_lost.lost_processes("task /job:jax_worker/replica:0/task:3 is gone") == [3]
    assert peer_lost.is_peer_loss(RuntimeError("Gloo AllGather failed: Connection reset by peer"))
    assert not peer_lost.is_peer_loss(ValueError("Gloo"))  # not an error of the runtime
    assert not peer_lost.is_peer_loss(RuntimeError("out of memory"))


# The coordination service's report of a dead task, delivered as jax's client delivers it
# (from one of its threads) to the callback distributed.py installs.
CALLBACK_DRIVER = """
import sys, threading, time
from pathlib import Path
from europa_jax.run import peer_lost
peer_lost.watch(Path(sys.argv[1]), 0)
threading.Thread(target=peer_lost.on_missed_heartbeat, args=(sys.argv[2],)).start()
time.sleep(60)
sys.exit(1)
"""


def test_a_missed_heartbeat_is_one_line_an_event_and_exit_75_not_an_abort(tmp_path):
    done = subprocess.run([sys.executable, "-c", CALLBACK_DRIVER, str(tmp_path), HEARTBEATS],
                          cwd=REPO, env=process_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == exit_codes.PREEMPTED, done.stderr
    assert done.stderr.splitlines() == [
        "europa-jax: process 1 of the job was lost (UNAVAILABLE: The following tasks are "
        "unhealthy (stopped sending heartbeats):); process 0 stops with exit 75 so that the "
        "job is requeued: the retry resumes from the last checkpoint"]
    (event,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "peer_lost" and event["lost"] == [1] and event["process"] == 0


# jax.distributed.initialize through distributed.py's wrapper: the client is made with the
# callback (the binding takes the keyword), and the job starts as before.
INIT_DRIVER = """
import sys
from jax._src import distributed as jax_distributed
from europa_jax.run import peer_lost
seen = {}
real = jax_distributed._jax.get_distributed_runtime_client
def spy(*args, **kwargs):
    seen.update(kwargs)
    return real(*args, **kwargs)
jax_distributed._jax.get_distributed_runtime_client = spy
import jax
with peer_lost.reported_by_the_client():
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", 1, 0)
assert seen["missed_heartbeat_callback"] is peer_lost.on_missed_heartbeat, seen
assert jax_distributed._jax.get_distributed_runtime_client is spy  # restored after the call
print(jax.process_count())
jax.distributed.shutdown()
"""


def test_the_job_s_client_is_made_with_the_callback(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", INIT_DRIVER, str(port)], cwd=REPO,
                          env=process_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["1"], done.stderr[-3000:]
