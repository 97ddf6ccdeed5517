"""A peer that vanishes (kill -9 of one of two processes) ends the survivor in one line
naming what was lost, a `peer_lost` event and exit 75, so that Slurm requeues the job and
the retry resumes from the last checkpoint (job/peer_lost.py)."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from europa_jax.job import exit_codes, peer_lost
from conftest import REPO, process_env
from test_distributed import free_port
from test_checkpoint import cli_env, events, start_cli, wait_for_step  # noqa: F401


# Which route reaches the survivor first is timing: gloo's error in a collective, or the
# peer watch while it waits elsewhere (orbax's barriers in a save): both end it with 75.
@pytest.mark.slow
def test_a_peer_killed_mid_run_ends_the_survivor_with_the_requeue_code(tmp_path, cli_env):  # noqa: F811
    port = free_port()
    procs = [start_cli(tmp_path, {**cli_env, **local_sh_env(port, i, heartbeat_s=20)},
                       "train.steps=200", "checkpoint.every_steps=2") for i in range(2)]
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


class Store:
    """The coordination service's key-value store as PeerWatch uses it (set, read a
    folder), for the watch's rules; the processes below use the real service."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_the_peer_watch_reports_a_peer_silent_for_its_limit_and_nothing_sooner():
    store, now = Store(), [0.0]
    watches = [peer_lost.PeerWatch(store, i, 3, limit_s=10, clock=lambda: now[0])
               for i in range(3)]
    for t in range(0, 30, 2):  # all three beat: nobody is lost, however long
        now[0] = float(t)
        assert [w.check_once() for w in watches] == [None] * 3
    for t in range(30, 41, 2):  # process 2 stops beating at 30
        now[0] = float(t)
        assert [w.check_once() for w in watches[:2]] == [None, None], t
    now[0] = 42.0
    lost = watches[0].check_once()
    assert peer_lost.lost_processes(lost) == [2] and "for 12 s" in lost, lost


def test_a_peer_that_leaves_in_order_is_not_lost_and_a_service_unreachable_for_the_limit_is_process_0():
    store, now = Store(), [0.0]
    first, second = (peer_lost.PeerWatch(store, i, 2, limit_s=10, clock=lambda: now[0])
                     for i in range(2))
    assert first.check_once() is None and second.check_once() is None
    second.leave()
    now[0] = 100.0
    assert first.check_once() is None
    store.down = True  # a failed call is not yet a loss: only the limit's worth of them
    assert first.check_once() is None
    now[0] = 105.0
    assert first.check_once() is None
    store.down = False  # the service answered again: the count starts over
    assert first.check_once() is None
    store.down = True
    now[0] = 108.0
    assert first.check_once() is None
    now[0] = 118.5
    lost = first.check_once()
    assert peer_lost.lost_processes(lost) == [0] and "cannot be reached" in lost, lost


# Two processes joined through distributed.start (as launch/local.sh starts them) that
# wait outside any collective: only the peer watch can tell one is gone. The service's
# own timeout (20 s) would abort the survivor; the watch (half of it) comes first.
JOIN_DRIVER = """
import os, sys, time
from pathlib import Path
import jax
from europa_jax.config import MeshConfig
from europa_jax.job import distributed, peer_lost
distributed.start(MeshConfig(data=2, expert=1))
peer_lost.watch(Path(sys.argv[1]), jax.process_index())
print("joined", flush=True)
then = sys.argv[2 + jax.process_index()]
if then == "abort":
    os.abort()
time.sleep(float(then))
sys.exit(0)
"""


def local_sh_env(port, process_id, heartbeat_s):
    """What launch/local.sh gives process `process_id` of two."""
    return {"EUROPA_JAX_COORDINATOR": f"127.0.0.1:{port}", "EUROPA_JAX_NUM_PROCESSES": "2",
            "EUROPA_JAX_PROCESS_ID": str(process_id), "JAX_PLATFORMS": "cpu",
            "EUROPA_JAX_HEARTBEAT_TIMEOUT_S": str(heartbeat_s)}


def join_two(run_dir, *sleeps):
    port = free_port()
    procs = []
    for i in range(2):
        env = {**process_env(), **local_sh_env(port, i, heartbeat_s=20),
               "EUROPA_LOG_DIR": str(run_dir)}  # the native logs: rank-i.native.log
        procs.append(subprocess.Popen(
            [sys.executable, "-c", JOIN_DRIVER, str(run_dir), *map(str, sleeps)], cwd=REPO,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        assert proc.stdout.readline().strip() == "joined", proc.stderr.read()[-3000:]
    return procs


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_a_peer_killed_while_the_survivor_waits_outside_a_collective_ends_it_with_75(
        tmp_path, killed):
    procs = join_two(tmp_path, 120, 120)
    procs[killed].send_signal(signal.SIGKILL)
    survivor = procs[1 - killed]
    _, err = survivor.communicate(timeout=90)
    procs[killed].communicate(timeout=30)
    assert survivor.returncode == exit_codes.PREEMPTED, err[-3000:]  # not an abort (-6)
    (line,) = [x for x in err.splitlines() if x.startswith("europa-jax")]
    assert line.startswith(f"europa-jax: process {killed} of the job was lost"), line
    assert f"process {1 - killed} stops with exit 75" in line, line
    # and nothing else than the rank's stamped log lines: jax's fatal log and stack (for
    # process 0's death, ~30 lines) are in the survivor's native log
    stamped = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z]+ rank \d/2 ")
    assert all(x == line or stamped.match(x) for x in err.splitlines()), err[-3000:]
    (event,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "peer_lost" and event["lost"] == [killed], event


@pytest.mark.slow
def test_a_process_that_finishes_first_is_not_reported_by_the_one_still_working(tmp_path):
    procs = join_two(tmp_path, 0, 15)  # process 1 works 15 s past the watch's 10 s limit
    errs = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errs[1][-3000:]
    assert not (tmp_path / "events.jsonl").exists()


@pytest.mark.slow
def test_an_abort_of_its_own_while_the_service_answers_is_still_an_abort(tmp_path):
    procs = join_two(tmp_path, 60, "abort")
    errs = [proc.communicate(timeout=90)[1] for proc in procs]
    assert procs[1].returncode == -signal.SIGABRT, errs[1][-3000:]
    assert procs[0].returncode == exit_codes.PREEMPTED, errs[0][-3000:]  # its watch saw it
