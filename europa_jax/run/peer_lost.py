"""A process of the job vanished: the survivors end in one line, a `peer_lost` event and
exit 75, so that Slurm requeues the job and the retry resumes from the last checkpoint.

A dead peer reaches a survivor one of two ways:
- **a collective fails** in this process's step (gloo on CPU: `Connection reset by peer`
  within a second; NCCL on GPU: a remote or system error once its watchdog notices) and
  surfaces as a JaxRuntimeError in the main thread: `is_peer_loss` recognizes it and
  cli.py's `run_training` calls `exit_requeue`;
- **the coordination service** stops hearing the peer's heartbeats
  (`EUROPA_JAX_HEARTBEAT_TIMEOUT_S`) while this process waits elsewhere (a barrier, the
  key-value store): jax's client would abort the process (SIGABRT, a C++ stack trace);
  `reported_by_the_client` (distributed.py's initialize runs under it) gives it
  `on_missed_heartbeat` instead. Not yet effective: jaxlib 0.12.0.1 takes the Python
  callback but cannot call it (two processes, one killed: the survivor ends in
  `std::bad_cast` when the service reports the loss), so this route still aborts; a
  watchdog of our own is the fix still to make.

Either way the process leaves with os._exit: a normal exit would wait in jax's shutdown
barrier for the peers that are gone. What the dead process had not saved is lost; an
unfinished save is never used (checkpoint.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from europa_jax.run import exit_codes

# What a peer's death looks like in an error message (gloo, NCCL, the coordination service)
_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Connection refused",
          "Broken pipe", "Gloo", "gloo", "NCCL", "nccl", "stopped sending heartbeats",
          "tasks have crashed", "CoordinationService", "coordination service")
_where: dict = {}
log = logging.getLogger(__name__)


def watch(run_dir: Path, process_index: int) -> None:
    """Where a loss is reported once training has a run directory (the loop calls this)."""
    _where.update(run_dir=Path(run_dir), process=process_index)


def is_peer_loss(error: BaseException) -> bool:
    """Whether `error` (from a multi-process step) says another process is gone."""
    return type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError", "RuntimeError") \
        and any(sign in str(error) for sign in _SIGNS)


def lost_processes(message: str) -> list[int]:
    """The processes a message names as gone: the coordination service lists the tasks
    that stopped sending heartbeats one per line, or names `/task:N`."""
    listed = re.search(r"stopped sending heartbeats\)?:?\s*\n((?:\s*\d+\s*\n?)+)", message)
    found = [int(n) for n in listed.group(1).split()] if listed else []
    found += [int(n) for n in re.findall(r"/task:(\d+)", message)]
    return sorted(set(found))


def line(message: str) -> str:
    """The one line a survivor prints."""
    me = _where.get("process")
    lost = lost_processes(message)
    who = (f"process {', '.join(map(str, lost))}" if lost else "a peer process")
    first = next((part.strip() for part in message.splitlines() if part.strip()), "")[:200]
    return (f"europa-jax: {who} of the job was lost ({first}); process {me} stops with exit "
            f"{exit_codes.PREEMPTED} so that the job is requeued: the retry resumes from the "
            "last checkpoint")


def exit_requeue(message: str) -> None:
    """One line, the event, and exit 75 now (no shutdown barrier with the dead)."""
    print(line(message), file=sys.stderr)
    run_dir = _where.get("run_dir")
    if run_dir is not None:  # every survivor records what it saw (process 0 may be gone)
        record = {"event": "peer_lost", "process": _where.get("process"),
                  "lost": lost_processes(message), "error": message.strip()[:500],
                  "time": time.time()}
        try:
            with (run_dir / "events.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            pass  # the line above says it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_codes.PREEMPTED)


def on_missed_heartbeat(*status) -> None:
    """jax's distributed client calls this (from its own thread) when the coordination
    service reports a task gone, instead of aborting the process."""
    exit_requeue(str(status[0]) if status else "the coordination service lost a task")


@contextlib.contextmanager
def reported_by_the_client():
    """jax.distributed.initialize with the client's missed-heartbeat callback set to
    on_missed_heartbeat (one line, an event, exit 75) instead of jax's default,
    which aborts the process with a C++ stack trace. jax does not expose the option, so
    the client factory it calls is wrapped for the call; if that is not possible (another
    jax), the default stays."""
    from jax._src import distributed as jax_distributed

    factory_module = getattr(jax_distributed, "_jax", None)
    real = getattr(factory_module, "get_distributed_runtime_client", None)
    if real is None:
        yield
        return

    def client(*args, **kwargs):
        kwargs.setdefault("missed_heartbeat_callback", on_missed_heartbeat)
        return real(*args, **kwargs)

    try:
        factory_module.get_distributed_runtime_client = client
    except (AttributeError, TypeError):
        log.debug("jax's distributed client factory cannot be wrapped: a lost peer aborts")
        yield
        return
    try:
        yield
    finally:
        factory_module.get_distributed_runtime_client = real
