"""A real one-node Slurm on localhost for tests: munged, slurmctld and slurmd in a temp dir.

Everything the daemons write (keys, sockets, state, logs, config) stays in that directory;
ports are picked free; the daemons are stopped by their pids. Needs root (slurmd starts
job steps as the submitting user) and Debian's `slurm-wlm` + `munge` (.ci/run installs
them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "sinfo", "scontrol", "scancel")


def missing_programs() -> list[str]:
    return [p for p in (*DAEMONS, *CLIENTS) if shutil.which(p) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: Path, node: str, cpus: int) -> str:
    return f"""\
ClusterName=europa-ci
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s).
AuthInfo=socket={root}/run/munge.sock,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# No cgroups in a container: track processes by parent, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=10
# The node may declare more CPUs than the machine has (tests ask for 2 tasks).
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=ci Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """Start with `start()`, submit with `sbatch()`, always `stop()`."""

    def __init__(self, root: Path, cpus: int = 4):
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pids: dict[str, int] = {}

    def start(self, timeout: float = 60) -> None:
        # munged refuses a socket directory that others cannot traverse, or a readable key.
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        for sub in ("run", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o755, exist_ok=True)
        (self.root / "munge").mkdir(mode=0o700, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self.conf.write_text(_config(self.root, self.node, self.cpus))
        run = self.root / "run"
        self._daemon("munged", ["munged", f"--socket={run}/munge.sock", f"--key-file={key}",
                                f"--log-file={self.root}/log/munged.log",
                                f"--pid-file={run}/munged.pid",
                                f"--seed-file={self.root}/munge/seed"], run / "munged.pid")
        self._daemon("slurmctld", ["slurmctld", "-f", str(self.conf)], run / "slurmctld.pid")
        self._daemon("slurmd", ["slurmd", "-f", str(self.conf)], run / "slurmd.pid")
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.run("sinfo", "-h", "-o", "%T", check=False)
            if out.strip() == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm node not idle after {timeout} s (sinfo: {out!r}); logs in "
                           f"{self.root}/log:\n{self.logs()}")

    def _daemon(self, name: str, argv: list[str], pid_file: Path) -> None:
        """Each daemon forks into the background and writes its pid file."""
        subprocess.run(argv, check=True, env=self.env, capture_output=True, text=True)
        deadline = time.time() + 20
        while not (pid_file.exists() and pid_file.read_text().strip()):
            if time.time() > deadline:
                raise RuntimeError(f"{name} wrote no pid file:\n{self.logs()}")
            time.sleep(0.1)
        self.pids[name] = int(pid_file.read_text())

    def stop(self) -> None:
        """Stop what `start` started, newest first, by pid (TERM, then KILL after 15 s)."""
        for name in reversed(list(self.pids)):
            pid = self.pids.pop(name)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.time() + 15
            while time.time() < deadline and _alive(pid):
                time.sleep(0.2)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout + ("" if check else done.stderr)

    def sbatch(self, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None
               ) -> int:
        done = subprocess.run(["sbatch", "--parsable", *argv], env={**(env or os.environ),
                              "SLURM_CONF": str(self.conf)}, cwd=cwd, capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, until, timeout: float, poll: float = 0.5) -> dict[str, str]:
        """Poll the job until `until(job_dict)` holds; returns that dict."""
        deadline = time.time() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.time() > deadline:
                raise TimeoutError(f"job {job_id} after {timeout} s: {job.get('JobState')} "
                                   f"({job.get('Reason')})")
            time.sleep(poll)

    def logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "\n".join(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
