"""Multi-process start: find this process's place in the job, connect, name the nodes.

Three ways a process is started, told apart by its environment:
- **Slurm** (`srun`, launch/jupiter.sbatch): `jax.distributed.initialize()` auto-detects the
  coordinator (first node of the step), process count and id from `SLURM_*` variables.
- **launch/local.sh**: `EUROPA_JAX_COORDINATOR`, `EUROPA_JAX_NUM_PROCESSES`,
  `EUROPA_JAX_PROCESS_ID` for N CPU processes on one machine.
- neither: one process, no distributed runtime.

The mesh covers every process's devices, so on CPU each process creates only its share,
`mesh.data × mesh.expert / processes`. Collectives between CPU processes go over gloo.

A rank that dies or never arrives must end the job, not hang it: start-up waits at most
`EUROPA_JAX_INIT_TIMEOUT_S` for every process, each process's peer watch ends it when
another stops beating for half of `EUROPA_JAX_HEARTBEAT_TIMEOUT_S` (the coordination
service's own timeout, whose route aborts), and a process
whose collective failed (on CPU, a dead peer is noticed at once) exits without waiting
for its peers in jax's shutdown barrier; a lost peer is one line and exit 75, the
requeue code (peer_lost.py).

This module reads the environment and may set jax config before jax creates its backends,
so `start` must run before anything touches a device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import sys
import time
import traceback
from typing import Mapping

from europa_jax.config import check_device_count, ConfigError, MeshConfig
from europa_jax.job import exit_codes, logs, peer_lost

log = logging.getLogger(__name__)

ENV_COORDINATOR = "EUROPA_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "EUROPA_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "EUROPA_JAX_PROCESS_ID"
ENV_INIT_TIMEOUT = "EUROPA_JAX_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "EUROPA_JAX_HEARTBEAT_TIMEOUT_S"
# 384 processes importing Python from a parallel file system can take minutes to arrive.
DEFAULT_INIT_TIMEOUT_S = 600
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
# Node names travel between processes as fixed-width bytes (hostnames are <= 253).
NODE_NAME_BYTES = 256


class StartError(RuntimeError):
    """jax.distributed refused to start (e.g. it found no coordinator address)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in the job, read from its environment."""

    launcher: str  # "slurm", "local" (launch/local.sh) or "single"
    num_processes: int
    process_id: int
    node: str
    coordinator: str | None = None  # None under Slurm: jax derives it from the step's nodes
    # GPUs this process drives (None: let the platform decide; on CPU it does not matter).
    local_device_ids: tuple[int, ...] | None = None
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1


def detect(env: Mapping[str, str] = os.environ) -> Launch:
    """How this process was launched; a malformed variable is a one-line `ConfigError`."""
    timeouts = dict(init_timeout_s=_int_env(env, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT_S),
                    heartbeat_timeout_s=_int_env(env, ENV_HEARTBEAT_TIMEOUT,
                                                 DEFAULT_HEARTBEAT_TIMEOUT_S))
    local = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if env.get(k)]
    if local:
        missing = sorted({ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID} - set(local))
        if missing:
            raise ConfigError(f"{missing[0]}: not set, but {local[0]} is (launch/local.sh sets "
                              f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID})")
        n = _int_env(env, ENV_NUM_PROCESSES)
        i = _int_env(env, ENV_PROCESS_ID, minimum=0)
        if i >= n:
            raise ConfigError(f"{ENV_PROCESS_ID}: {i} must be below {ENV_NUM_PROCESSES}={n}")
        if ":" not in env[ENV_COORDINATOR]:
            raise ConfigError(f"{ENV_COORDINATOR}: {env[ENV_COORDINATOR]!r} is not HOST:PORT")
        return Launch("local", n, i, node_name(env), coordinator=env[ENV_COORDINATOR], **timeouts)
    # SLURM_STEP_ID marks a process started by srun; the batch script itself also has
    # SLURM_JOB_ID and SLURM_NTASKS, and must not wait for the job's tasks to join it.
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        n = _int_env(env, "SLURM_NTASKS")
        local_id = _int_env(env, "SLURM_LOCALID", minimum=0)
        counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", "1"))
        node_id = _int_env(env, "SLURM_NODEID", 0, minimum=0)
        if node_id >= len(counts):
            raise ConfigError(f"SLURM_NODEID: {node_id} but SLURM_STEP_TASKS_PER_NODE lists "
                              f"{len(counts)} nodes")
        tasks_here = counts[node_id]
        ids = gpu_ids(local_id, tasks_here, visible_gpu_count(env))
        return Launch("slurm", n, _int_env(env, "SLURM_PROCID", minimum=0), node_name(env),
                      local_device_ids=ids, **timeouts)
    return Launch("single", 1, 0, node_name(env), **timeouts)


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed count list, e.g. '4(x95),3' → [4]*95 + [3]."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: {spec!r} is not like '4(x96)'")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def visible_gpu_count(env: Mapping[str, str]) -> int:
    """GPUs this process could see: CUDA_VISIBLE_DEVICES if Slurm set it, else the node's."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d != "NoDevFiles"])
    return len([d for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d)]) \
        if os.path.isdir("/dev") else 0


def gpu_ids(local_id: int, tasks_on_node: int, n_gpus: int) -> tuple[int, ...] | None:
    """The GPUs a task drives when `tasks_on_node` tasks share a node's `n_gpus`.

    One task per GPU (our layout) keeps every GPU visible to every task and picks GPU
    `local_id`: NCCL then still sees its peers and uses NVLink between processes, which
    hiding GPUs from each other (CUDA_VISIBLE_DEVICES per task) can prevent. One task per
    node takes them all (jax's own Slurm default would give it only GPU 0).
    """
    if n_gpus == 0:
        return None  # a CPU host
    if n_gpus == 1:
        return (0,)  # Slurm already gave this task its own GPU
    if n_gpus % tasks_on_node:
        raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: {tasks_on_node} tasks on a node cannot "
                          f"share its {n_gpus} GPUs evenly; use --ntasks-per-node=1 or "
                          f"{n_gpus}")
    per_task = n_gpus // tasks_on_node
    return tuple(range(local_id * per_task, (local_id + 1) * per_task))


def node_name(env: Mapping[str, str] = os.environ) -> str:
    """Slurm's name for this node (what `--nodelist` uses), else the hostname."""
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def cpu_devices_per_process(mesh: MeshConfig, launch: Launch) -> int:
    """Each process's share of the mesh when the devices are CPUs."""
    if mesh.n_devices % launch.num_processes:
        raise ConfigError(f"mesh: data×expert = {mesh.data}×{mesh.expert} = {mesh.n_devices} "
                          f"devices cannot be split evenly over the job's "
                          f"{launch.num_processes} processes ({_count_source(launch)})")
    return mesh.n_devices // launch.num_processes


def start(mesh: MeshConfig, env: Mapping[str, str] = os.environ) -> Launch:
    """Connect this process to the job (if it has several) and check the mesh fits it."""
    launch = detect(env)
    logs.ensure_configured()
    logs.set_rank(launch.process_id, launch.num_processes)
    import jax

    # Ignored on GPU hosts, where the CPU backend holds no mesh devices.
    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices_per_process(mesh, launch))
    except RuntimeError:
        # jax ran before this in the process (the library called from a notebook or a
        # test): its devices are set; job_mesh says so if the mesh does not fit them
        pass
    if launch.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        logs.stamp_native_stdout("gloo")  # its C++ prints its connections to stdout
        # If a peer never arrives, jax ends this process itself (an abort naming
        # DEADLINE_EXCEEDED and RegisterTask): this line says what it waited for.
        log.info(f"process {launch.process_id} of {launch.num_processes} ({launch.launcher}) "
                 f"joining via {launch.coordinator or 'Slurm auto-detection'}; waiting up to "
                 f"{launch.init_timeout_s} s for all ({ENV_INIT_TIMEOUT})")
        joining = time.perf_counter()
        try:
            jax.distributed.initialize(
                launch.coordinator, launch.num_processes, launch.process_id,
                local_device_ids=list(launch.local_device_ids) if launch.local_device_ids
                else None,
                initialization_timeout=launch.init_timeout_s,
                heartbeat_timeout_seconds=launch.heartbeat_timeout_s)
        except Exception as e:  # no coordinator address found, an unusable one, ...
            raise StartError(
                f"process {launch.process_id} of {launch.num_processes} ({launch.launcher}) "
                f"could not join the job: {_first_line(e)}") from None
        sys.excepthook = _exit_at_once
        from europa_jax.job import preemption  # it imports this module

        if preemption.current() is not None:  # jax's notifier took SIGTERM: take it back
            preemption.current().reclaim()
        native = logs.native_log_path(launch.process_id, launch.launcher == "slurm", env)
        logs.divert_native_stderr(native)
        log.info(f"joined; this process's native (C++) messages go to {native}")
        peer_lost.watch_peers(coordination_client(), launch.process_id, launch.num_processes,
                              launch.heartbeat_timeout_s)
        if launch.process_id != 0:
            from jax._src import distributed as jax_distributed

            peer_lost.requeue_when_the_service_is_gone(
                jax_distributed.global_state.coordinator_address)
        _joined["seconds"] = time.perf_counter() - joining
    check_device_count(mesh, jax.device_count(),
                       devices_source(launch, jax.local_device_count(), jax.devices()[0].platform))
    logs.set_rank(jax.process_index(), jax.process_count())
    log.info(f"process {jax.process_index()} of {jax.process_count()} ({launch.launcher}) on "
             f"{launch.node}, pid {os.getpid()}, {jax.local_device_count()} local "
             f"{jax.devices()[0].platform} devices of {jax.device_count()}")
    return launch


def _exit_at_once(exc_type, exc, tb) -> None:
    """An uncaught exception in one process of a job: print it and exit now.

    A normal exit would wait in jax's shutdown barrier (up to 300 s) for the other
    processes, and after a failed collective those may be dead: the job would outlive its
    failure by minutes. Pending async checkpoint writes are abandoned; an unfinished save
    is never used (checkpoint.py).
    """
    traceback.print_exception(exc_type, exc, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_codes.CRASH)


def devices_source(launch: Launch, n_local: int, platform: str) -> str:
    """Where the job's device count comes from, for config.check_device_count's error."""
    return (f" ({platform}: {launch.num_processes} processes × {n_local} local, "
            f"{_count_source(launch)})")


def job_mesh(mesh_cfg: MeshConfig):
    """The training mesh over every process's devices, each expert row inside one node.

    Process 0 logs the expert groups as `node[processes]`, so a job's log shows whether
    the MoE all-to-all stays inside nodes.
    """
    import jax

    from europa_jax.parallel import sharding

    nodes = node_of_process()
    _nodes.clear()
    _nodes.update(nodes)
    mesh = sharding.make_mesh(mesh_cfg, node_of_process=nodes)
    if jax.process_index() == 0:
        log.info(f"mesh data={mesh_cfg.data} × expert={mesh_cfg.expert}; expert groups: "
                 f"{' '.join(expert_groups(mesh.devices, nodes))}")
    return mesh


_nodes: dict[int, str] = {}
_joined: dict[str, float] = {}


def join_seconds() -> float | None:
    """How long `start` waited in jax.distributed.initialize (None: one process)."""
    return _joined.get("seconds")


def nodes() -> dict[int, str]:
    """{process index: node name}, as `job_mesh` learned it (this process alone before)."""
    import jax

    return dict(_nodes) or {jax.process_index(): node_name()}


def init_timeout_s() -> int:
    """How long processes may wait for each other at start-up (EUROPA_JAX_INIT_TIMEOUT_S)."""
    return detect().init_timeout_s


def expert_groups(grid, nodes: Mapping[int, str]) -> list[str]:
    """Each row of a [data, expert] device grid as 'node[p0,p1]' (its nodes and processes)."""
    groups = []
    for row in grid:
        processes = sorted({dev.process_index for dev in row})
        row_nodes = sorted({nodes.get(p, str(p)) for p in processes})
        groups.append(f"{'+'.join(row_nodes)}[{','.join(f'p{p}' for p in processes)}]")
    return groups


def node_of_process() -> dict[int, str]:
    """{process index: node name} for every process of the job (a collective: all must call).

    The mesh groups a node's devices into one expert row; with one process per GPU those
    devices belong to several processes, and only their node names tell that they share
    NVLink (see sharding.arrange_devices).
    """
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return {jax.process_index(): node_name()}
    from jax.experimental import multihost_utils

    # The payload carries its own process index: no reliance on the gather's order.
    payload = np.zeros(NODE_NAME_BYTES + 1, np.int32)
    encoded = node_name().encode()[:NODE_NAME_BYTES]
    payload[0] = jax.process_index()
    payload[1:1 + len(encoded)] = np.frombuffer(encoded, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(payload))
    return {int(row[0]): bytes(row[1:].astype(np.uint8)).rstrip(b"\0").decode()
            for row in rows}


def every_process(value: int) -> list[int]:
    """`value` from every process of the job, in process order (a collective: all must call).

    How the processes take one decision together: each contributes what it saw, all read
    the same list and so decide alike. (Small codes and flags: exact in float32.)
    """
    return [int(v) for v in gather_floats([value])[:, 0]]


def gather_floats(values) -> "np.ndarray":
    """[processes, len(values)] float32: every process's `values`, in process order (a
    collective: all must call). How the loop's per-step stop flags and timings travel."""
    import jax
    import numpy as np

    row = np.asarray(values, np.float32).reshape(-1)
    if jax.process_count() == 1:
        return row[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)


def coordination_client():
    """The job's coordination-service client (jax.distributed's; None for one process):
    its key-value store and barriers work where the devices' collectives are stuck."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


_barriers: dict[str, int] = {}


def barrier(name: str, timeout_s: int) -> None:
    """Wait until every process of the job arrives here (at most `timeout_s`).

    Through the coordination service, not the devices: a process may wait here far
    longer than a collective would let it (gloo gives up after 30 s). A no-op for one
    process. Every process must call it the same number of times.
    """
    import jax

    if jax.process_count() == 1:
        return
    _barriers[name] = _barriers.get(name, 0) + 1
    coordination_client().wait_at_barrier(f"{name}_{_barriers[name]}",
                                                        int(timeout_s * 1000))


def all_processes(ok: bool) -> bool:
    """True on every process iff `ok` on every process (a collective: all must call)."""
    return all(every_process(int(ok)))


def _count_source(launch: Launch) -> str:
    return {"slurm": "SLURM_NTASKS", "local": ENV_NUM_PROCESSES,
            "single": "one process"}[launch.launcher] + f"={launch.num_processes}"


def _int_env(env: Mapping[str, str], key: str, default: int | None = None,
             minimum: int = 1) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"{key}: not set")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{key}: {raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{key}: {value} must be >= {minimum}")
    return value


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

