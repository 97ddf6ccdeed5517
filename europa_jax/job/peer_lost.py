"""A process of the job vanished: the survivors end in one line, a `peer_lost` event and
exit 75, so that Slurm requeues the job and the retry resumes from the last checkpoint.

A dead peer reaches a survivor one of three ways:
- **a collective fails** in this process's step (gloo on CPU: `Connection reset by peer`
  within a second; NCCL on GPU: a remote or system error once its watchdog notices) and
  surfaces as a JaxRuntimeError in the main thread: `is_peer_loss` recognizes it and
  cli.py's `run_training` calls `exit_requeue`;
- **a peer stops beating**: `PeerWatch`, a thread in every process, beats through the
  coordination service's key-value store and reads the others' beats; a peer silent for
  half of `EUROPA_JAX_HEARTBEAT_TIMEOUT_S` (before the service's own timeout, whose
  route in jax aborts the process with a C++ stack trace) or a store that cannot be
  reached (process 0 gone) is a loss. This catches a peer lost while this process waits
  outside a collective (a barrier, the key-value store, a save) or in a collective that
  never fails (NCCL without its watchdog);
- **process 0 is gone**, and the coordination service with it: jax's client aborts every
  other process at once, and `requeue_when_the_service_is_gone` turns that abort into the
  same exit when the service no longer answers.

Either way the process leaves with os._exit: a normal exit would wait in jax's shutdown
barrier for the peers that are gone. What the dead process had not saved is lost; an
unfinished save is never used (checkpoint.py).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from europa_jax.job import exit_codes

# What a peer's death looks like in an error message (gloo, NCCL, the coordination service)
_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Connection refused",
          "Broken pipe", "Gloo", "gloo", "NCCL", "nccl", "stopped sending heartbeats",
          "tasks have crashed", "CoordinationService", "coordination service")
_where: dict = {}


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


def _lost(process: int, silent_s: float) -> str:
    """The message a survivor reports when `process` stopped beating (the service's form,
    so that `lost_processes` reads it)."""
    return (f"process {process} sent no heartbeat through the coordination service for "
            f"{silent_s:.0f} s (/task:{process})")


class PeerWatch:
    """Our own heartbeat over the coordination service's key-value store.

    jax's coordination service declares a task dead after its heartbeat timeout and then
    aborts every other process (jax's default missed-heartbeat callback: SIGABRT and a
    C++ stack trace). jaxlib 0.12's client takes a Python callback in its place but
    cannot call it (nanobind has no caster for the status it passes: the survivor ends in
    std::bad_cast), so the route is ours: a daemon thread per process writes a counter to
    `europa_alive/<process>` every `interval_s` and reads the others'. A peer whose counter
    has not moved for `limit_s` (half the service's timeout, so that ours comes first) is
    lost; a store that cannot be reached for as long means process 0, which holds the
    service, is gone. Either way: one line, the event and exit 75. A process that leaves in order
    writes `leaving` first, and is not reported.
    """

    PREFIX = "europa_alive/"
    LEAVING = "leaving"

    def __init__(self, client, process_index: int, process_count: int, limit_s: float,
                 exit_with=None, clock=time.monotonic):
        self.client, self.me, self.count, self.limit_s = (client, process_index,
                                                          process_count, float(limit_s))
        self.interval_s = min(5.0, max(0.1, self.limit_s / 10))
        self._exit_with = exit_with or exit_requeue
        self._clock = clock
        self._beat = 0
        self._seen: dict[int, tuple[str | None, float]] = {}
        self._unreachable_since: float | None = None
        self._stop = threading.Event()

    def check_once(self) -> str | None:
        """Beat, read the others; the loss message if a peer is lost (None: all well)."""
        self._beat += 1
        try:
            self.client.key_value_set(f"{self.PREFIX}{self.me}", str(self._beat),
                                      allow_overwrite=True)
            values = dict(self.client.key_value_dir_get(self.PREFIX))
        except Exception as e:  # noqa: BLE001 (any failure: the service is unreachable)
            # A busy service may fail a call: only one unreachable for the whole limit is
            # gone (process 0's death itself reaches us at once, through jax's abort).
            now = self._clock()
            self._unreachable_since = self._unreachable_since or now
            if now - self._unreachable_since <= self.limit_s:
                return None
            first = next((x.strip() for x in str(e).splitlines() if x.strip()),
                         type(e).__name__)
            return f"the coordination service (process 0) cannot be reached: {first} (/task:0)"
        self._unreachable_since = None
        now = self._clock()
        for peer in range(self.count):
            if peer == self.me:
                continue
            value = values.get(f"{self.PREFIX}{peer}")
            if value == self.LEAVING:
                continue
            last_value, since = self._seen.get(peer, (None, now))
            if value != last_value or peer not in self._seen:
                self._seen[peer] = (value, now)
            elif now - since > self.limit_s:
                return _lost(peer, now - since)
        return None

    def start(self) -> "PeerWatch":
        threading.Thread(target=self._run, name="europa-peer-watch", daemon=True).start()
        atexit.register(self.leave)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            message = self.check_once()
            if message is not None and not self._stop.is_set():
                self._exit_with(message)
                return

    def leave(self) -> None:
        """This process leaves in order: the others must not report it lost."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.client.key_value_set(f"{self.PREFIX}{self.me}", self.LEAVING,
                                      allow_overwrite=True)
        except Exception:  # noqa: BLE001 (the service may already be gone)
            pass


_watch: list[PeerWatch] = []


def watch_peers(client, process_index: int, process_count: int,
                heartbeat_timeout_s: float) -> PeerWatch:
    """Start this process's PeerWatch (distributed.start calls it once the job is joined)."""
    _where.setdefault("process", process_index)  # what `line` names before training starts
    peer_watch = PeerWatch(client, process_index, process_count,
                           limit_s=heartbeat_timeout_s / 2).start()
    _watch.append(peer_watch)
    return peer_watch


def leaving() -> None:
    """Tell the other processes this one leaves in order (a process that ends itself with
    os._exit, such as the hang watchdog's, calls this first; a normal exit does it at
    exit)."""
    for peer_watch in _watch:
        peer_watch.leave()


_abort_handler: list = []  # the ctypes handler, kept alive for as long as it is installed


def requeue_when_the_service_is_gone(coordinator_address: str) -> None:
    """Process 0, which holds the coordination service, died: every other process's jax
    client learns it at once (its error poll's stream closes) and aborts (SIGABRT, a C++
    stack trace, exit 134) before any Python runs — the callback meant to replace that
    abort cannot be called on jaxlib 0.12 (see PeerWatch). So SIGABRT gets a handler here
    (at the C level: Python's own handlers run too late, after abort has ended the
    process) that tries to connect to the service: refused or unanswered, the abort is
    the lost leader's, and the process ends as any survivor does (one line, the event,
    exit 75); answered, the abort is some other failure and goes ahead as before.
    For processes other than 0 (process 0's own abort is never the leader's loss)."""
    host, _, port = coordinator_address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]

    def on_abort(signum: int) -> None:
        try:
            with socket.create_connection((host, int(port)), timeout=3):
                reachable = True
        except OSError:
            reachable = False
        if not reachable:
            exit_requeue(f"the coordination service at {coordinator_address} is gone "
                         "(/task:0)")
        libc.signal(signal.SIGABRT, signal.SIG_DFL)  # abort raises again: the default

    handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(on_abort)
    _abort_handler[:] = [handler]
    libc.signal(signal.SIGABRT, ctypes.cast(handler, ctypes.c_void_p))
