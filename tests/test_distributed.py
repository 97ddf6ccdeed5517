"""Multi-process start: launcher detection, device split, node-pinned mesh across processes."""

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import REPO, config_path, process_env
from europa_jax.config import check_device_count, ConfigError, MeshConfig
from europa_jax.job import distributed, logs

SLURM_TASK = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8",
              "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
              "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURMD_NODENAME": "jpbo-002",
              "CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def test_slurm_task_drives_its_own_gpu_but_sees_all_four():
    launch = distributed.detect(SLURM_TASK)
    assert (launch.launcher, launch.num_processes, launch.process_id, launch.node) == (
        "slurm", 8, 5, "jpbo-002")
    assert launch.coordinator is None  # jax derives it from SLURM_STEP_NODELIST
    assert launch.local_device_ids == (1,)


@pytest.mark.parametrize("tasks, visible, local_id, want", [
    ("1(x2)", "0,1,2,3", 0, (0, 1, 2, 3)),  # one process per node takes the node's GPUs
    ("4(x2)", "2", 2, (0,)),  # Slurm bound one GPU to the task already
    ("2(x2)", "0,1,2,3", 1, (2, 3)),
    ("4(x2)", "", 3, None),  # a CPU node
])
def test_gpu_ids_follow_tasks_per_node(tasks, visible, local_id, want):
    env = {**SLURM_TASK, "SLURM_STEP_TASKS_PER_NODE": tasks, "CUDA_VISIBLE_DEVICES": visible,
           "SLURM_LOCALID": str(local_id)}
    assert distributed.detect(env).local_device_ids == want


def test_tasks_per_node_expands_slurm_counts():
    assert distributed.tasks_per_node("4(x3),2") == [4, 4, 4, 2]
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE: '4x3'"):
        distributed.tasks_per_node("4x3")


def test_a_node_id_past_the_step_nodes_is_an_error():
    with pytest.raises(ConfigError, match="SLURM_NODEID: 2 but SLURM_STEP_TASKS_PER_NODE lists 2"):
        distributed.detect({**SLURM_TASK, "SLURM_NODEID": "2"})


def test_uneven_gpu_share_is_an_error():
    with pytest.raises(ConfigError, match="3 tasks on a node cannot share its 4 GPUs"):
        distributed.gpu_ids(0, 3, 4)


def test_batch_script_itself_is_not_a_slurm_task():
    # sbatch's shell has the job's variables but no step: it must not wait for 8 peers.
    env = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_ID"}
    assert distributed.detect(env).launcher == "single"


def test_local_launch_and_its_errors():
    env = {distributed.ENV_COORDINATOR: "127.0.0.1:1234", distributed.ENV_NUM_PROCESSES: "2",
           distributed.ENV_PROCESS_ID: "1", distributed.ENV_INIT_TIMEOUT: "7"}
    launch = distributed.detect(env)
    assert (launch.launcher, launch.num_processes, launch.process_id, launch.coordinator,
            launch.init_timeout_s) == ("local", 2, 1, "127.0.0.1:1234", 7)
    bad = [({distributed.ENV_PROCESS_ID: "2"}, "EUROPA_JAX_PROCESS_ID: 2 must be below"),
           ({distributed.ENV_NUM_PROCESSES: "two"}, "EUROPA_JAX_NUM_PROCESSES: 'two' is not an"),
           ({distributed.ENV_COORDINATOR: "localhost"}, "EUROPA_JAX_COORDINATOR: 'localhost' is"),
           ({distributed.ENV_HEARTBEAT_TIMEOUT: "0"}, "EUROPA_JAX_HEARTBEAT_TIMEOUT_S: 0 must be")]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            distributed.detect({**env, **change})
    with pytest.raises(ConfigError, match="EUROPA_JAX_NUM_PROCESSES: not set"):
        distributed.detect({distributed.ENV_COORDINATOR: "127.0.0.1:1234",
                            distributed.ENV_PROCESS_ID: "0"})


def test_each_process_gets_its_share_of_cpu_devices():
    launch = distributed.detect({**SLURM_TASK, "CUDA_VISIBLE_DEVICES": ""})
    assert distributed.cpu_devices_per_process(MeshConfig(data=96, expert=4), launch) == 48
    with pytest.raises(ConfigError, match=r"2×3 = 6 devices cannot be split evenly over the "
                                          r"job's 8 processes \(SLURM_NTASKS=8\)"):
        distributed.cpu_devices_per_process(MeshConfig(data=2, expert=3), launch)


def test_a_mesh_that_does_not_match_the_job_names_both_sizes():
    launch = distributed.detect(SLURM_TASK)
    with pytest.raises(ConfigError, match=r"mesh: data×expert = 96×4 = 384 but the job has 8 "
                                          r"devices \(gpu: 8 processes × 1 local, "
                                          r"SLURM_NTASKS=8\)"):
        check_device_count(MeshConfig(data=96, expert=4), 8,
                           distributed.devices_source(launch, 1, "gpu"))


def test_expert_groups_name_nodes_and_processes():
    dev = lambda p: SimpleNamespace(process_index=p)  # noqa: E731
    grid = [[dev(0), dev(0), dev(2), dev(2)], [dev(1), dev(1), dev(3), dev(3)]]
    assert distributed.expert_groups(grid, {0: "a", 1: "b", 2: "a", 3: "b"}) == [
        "a[p0,p2]", "b[p1,p3]"]


# ----------------------------------------------------------------------------- processes


COLLECTIVE_LOOP = """
import sys
from jax.experimental import multihost_utils
from europa_jax.job import distributed, logs
from europa_jax.config import MeshConfig
distributed.start(MeshConfig(data=2, expert=4))
multihost_utils.process_allgather(1)
print("collectives up", file=sys.stderr, flush=True)
while True:
    multihost_utils.process_allgather(1)
"""

MESH_DRIVER = """
import json
import os
from europa_jax.job import distributed, logs
from europa_jax.config import MeshConfig
mesh_cfg = MeshConfig(data=2, expert=4)
distributed.start(mesh_cfg)
mesh = distributed.job_mesh(mesh_cfg)
print(json.dumps(distributed.expert_groups(mesh.devices, distributed.node_of_process())))
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(n, *, node_of=lambda i: "n", driver=MESH_DRIVER, extra_env=None):
    port = free_port()
    procs = []
    for i in range(n):
        env = process_env()
        env.update({distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                    distributed.ENV_NUM_PROCESSES: str(n), distributed.ENV_PROCESS_ID: str(i),
                    "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "SLURMD_NODENAME": node_of(i),
                    **(extra_env or {})})
        procs.append(subprocess.Popen([sys.executable, "-c", driver], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.slow
def test_four_processes_of_two_devices_group_expert_rows_by_node():
    # One process per "GPU": nodes a and b each hold two processes, with interleaved ids,
    # so only the gathered node names can put p0 and p2 in one expert row.
    procs = start_processes(4, node_of=lambda i: "ab"[i % 2])
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    groups = {tuple(json.loads(out.splitlines()[-1])) for out, _ in outs}
    assert groups == {("a[p0,p2]", "b[p1,p3]")}
    assert "expert groups: a[p0,p2] b[p1,p3]" in outs[0][1]
    assert "process 3 of 4 (local) on b" in outs[3][1]
    assert "2 local cpu devices of 8" in outs[3][1]


@pytest.mark.slow
def test_a_missing_process_ends_the_others_within_the_timeout():
    env = process_env()
    env.update({distributed.ENV_COORDINATOR: f"127.0.0.1:{free_port()}",
                distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: "0",
                distributed.ENV_INIT_TIMEOUT: "5", "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "europa_jax.cli", "train",
                           config_path("tiny-cpu.yaml")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert time.time() - start < 60
    assert "process 0 of 2 (local) joining via 127.0.0.1:" in done.stderr
    assert "waiting up to 5 s for all (EUROPA_JAX_INIT_TIMEOUT_S)" in done.stderr
    assert "DEADLINE_EXCEEDED" in done.stderr  # jax's own verdict, then it aborts


@pytest.mark.slow
def test_a_slurm_step_jax_cannot_read_is_a_one_line_error():
    # Without SLURM_STEP_NODELIST jax finds no coordinator: say so, do not hang or crash.
    env = process_env()
    env.update({**SLURM_TASK, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": "",
                "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
    done = subprocess.run([sys.executable, "-m", "europa_jax.cli", "train",
                           config_path("tiny-cpu.yaml")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "europa-jax: error: process 0 of 2 (slurm) could not join the job: "
        "coordinator_address should be defined.")


@pytest.mark.slow
def test_when_a_peer_dies_the_survivor_exits_at_its_next_collective_or_the_heartbeat():
    # Which comes first is gloo's: mostly the survivor's next collective fails at once;
    # sometimes its device threads stay in a gloo receive (7 of 40 local tries), and then
    # PeerWatch (job/peer_lost.py) finds the peer silent for half the heartbeat limit and
    # requeues (exit 75), or else the coordination service ends it when the heartbeat
    # lapses. Either way it exits on its own, non-zero, within the heartbeat set for the job
    # (not the 300 s shutdown barrier).
    procs = start_processes(2, driver=COLLECTIVE_LOOP,
                            extra_env={distributed.ENV_HEARTBEAT_TIMEOUT: "15"})
    for line in procs[1].stderr:  # until both have run a collective
        if line.startswith("collectives up"):
            break
    procs[1].kill()
    killed = time.time()
    _, err = procs[0].communicate(timeout=120)
    procs[1].wait()
    assert time.time() - killed < 15 + 20, err[-3000:]
    assert procs[0].returncode != 0
    failed_collective = "Gloo" in err and "Traceback" in err
    heartbeat_lapsed = "The following tasks are unhealthy (stopped sending heartbeats):\n1" in err
    peer_watch_requeued = procs[0].returncode == 75 and (
        "europa-jax: process 1 of the job was lost (process 1 sent no heartbeat" in err
        and "process 0 stops with exit 75" in err)
    assert failed_collective or heartbeat_lapsed or peer_watch_requeued, err[-3000:]


NATIVE_DRIVER = """
import logging, os, sys
from europa_jax.job import logs
logs.configure("normal")
logs.divert_native_stderr(sys.argv[1])
os.write(2, b"F1208 12:00:00.000 client.cc:1] a native fatal log\\n")
logging.getLogger("europa_jax.test").warning("a python line")
logs.signal_safe_line("WARNING", "europa_jax.test", "a signal-safe line")
print("europa-jax: the one line", file=sys.stderr)
"""


def test_a_job_s_native_stderr_goes_to_its_file_and_europa_jax_s_lines_stay(tmp_path):
    """A peer's death makes jax's C++ client write a fatal log and a stack to fd 2 before
    the process's own line: in a job fd 2 is a file beside the rank logs, and the rank's
    stderr holds europa-jax's lines only."""
    native = tmp_path / "rank-1.native.log"
    result = subprocess.run([sys.executable, "-c", NATIVE_DRIVER, str(native)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert [line.split(": ", 1)[-1] for line in lines] == [
        "a python line", "a signal-safe line", "the one line"], lines
    assert native.read_text() == "F1208 12:00:00.000 client.cc:1] a native fatal log\n"
    assert logs.native_log_path(1, True, {"EUROPA_LOG_DIR": "L", "SLURM_RESTART_COUNT": "2"}
                                ) == os.path.join("L", "try-2-rank-1.native.log")
    assert logs.native_log_path(0, False, {"EUROPA_LOG_DIR": "L"}) == os.path.join(
        "L", "rank-0.native.log")
