"""One writer per run directory: a lock that process 0 holds while a command writes there.

Two `train`s on one directory (a resubmitted job while the requeued one still runs) would
interleave metrics.jsonl, and each one's Orbax manager removes the other's in-flight save
as unfinished. So `train` and `import` take `<dir>/run.lock` before writing anything, and
a second command is refused in one line naming the holder (host, pid, Slurm job).

The lock is an advisory POSIX record lock (`fcntl`): the kernel drops it when the holding
process ends however it ends, so a `kill -9` leaves the file but never a stale lock, and
cluster file systems (GPFS, Lustre with `flock`, NFS) carry POSIX locks between nodes.
A POSIX lock belongs to the process and is dropped when the process closes *any*
descriptor of the file, so nothing else in a holding process opens run.lock. A file
system that refuses locks gets a warning, not a refusal: the run goes on unguarded.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Iterator

from europa_jax.config import ConfigError
from europa_jax.job import distributed

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
# errno values of a file system that does not do POSIX locks (not of a held lock)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirInUse(ConfigError):
    """Another process holds the directory's lock (exit 2: nothing was written)."""


class RunDirUnusable(ConfigError):
    """The run directory cannot be made or written (permissions, a read-only or virtual
    file system): exit 2, one line naming it."""


class Lock:
    """A held lock: the open descriptor is the lock; `release()` closes it."""

    def __init__(self, fd: int | None):
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def lock(directory: str | Path, command: str) -> Lock:
    """Lock `directory` (made if missing) for this process, or raise `RunDirInUse`."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirUnusable(f"{directory}: cannot use it as the run directory: "
                             f"{e.strerror or e} (choose another with --run-dir)") from None
    if not _try_lock(fd, directory):
        return Lock(None)
    # Who holds it, for the refusal above; written through the locked descriptor (closing
    # another one would drop the lock). The previous holder's line is replaced.
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(_holder_record(command)) + "\n").encode())
    return Lock(fd)


def check_free(directory: str | Path) -> None:
    """Raise `RunDirInUse` if a live process holds `directory`; writes nothing. Never call
    it in a process that holds that lock: closing the file here would drop it."""
    path = Path(directory) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    if _try_lock(fd, Path(directory)):
        os.close(fd)  # it was free: let go at once


def _try_lock(fd: int, directory: Path) -> bool:
    """Take the lock on `fd` (True), or find the file system without locks (False, the
    descriptor closed); raise `RunDirInUse` if another process holds it."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise RunDirInUse(f"{directory}: in use by {holder(directory / LOCK_FILE)}; wait "
                              "for it to end or use another directory") from None
        if e.errno in _NO_LOCKS:
            log.warning(f"{directory / LOCK_FILE}: the file system refuses locks "
                        f"({os.strerror(e.errno)}): a second command writing to this "
                        "directory would not be stopped")
            return False
        raise


@contextlib.contextmanager
def hold(directory: str | Path, command: str) -> Iterator[None]:
    """Process 0 holds `directory`'s lock for the block; every process of the job learns
    whether it got it (a collective) and raises `RunDirInUse` alike if not, so no process
    writes there or waits for a peer that gave up. A directory the block made and left
    holding only the lock file is removed: a command that wrote nothing leaves nothing."""
    import jax

    directory = Path(directory)
    held, refusal, made = None, None, False
    if jax.process_index() == 0:
        made = not directory.exists()
        try:
            held = lock(directory, command)
        except (RunDirInUse, RunDirUnusable) as e:
            refusal = e
    if not distributed.all_processes(refusal is None):
        raise refusal or RunDirInUse(f"{directory}: process 0 could not lock it (its log says "
                                     "why)")
    try:
        yield
    finally:
        if held is not None:
            held.release()
        if made and directory.is_dir() and [p.name for p in directory.iterdir()] == [LOCK_FILE]:
            (directory / LOCK_FILE).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                directory.rmdir()


def holder(path: Path) -> str:
    """The holder named in a lock file, as words for an error line."""
    try:
        record = json.loads(path.read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return "another process (its lock file names no holder yet)"
    job = f", Slurm job {record['slurm_job']}" if record.get("slurm_job") else ""
    return (f"`europa-jax {record.get('command')}` on {record.get('host')}, pid "
            f"{record.get('pid')}{job}, since {record.get('since')}")


def _holder_record(command: str) -> dict:
    return {"command": command, "host": distributed.node_name(), "pid": os.getpid(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
