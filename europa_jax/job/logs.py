"""Log lines with time, level and rank: `2026-12-02 04:41:07 INFO rank 1/8 loop: ...`.

One handler on the root logger, so JAX's, Orbax's and absl's Python logs carry the same
prefix as ours and the ranks' lines can be told apart when a job's logs are merged.
The rank is known before jax starts (launcher environment, distributed.detect), and set
again once the distributed runtime has said it (distributed.start).
"""

from __future__ import annotations

import logging
import sys

_rank = {"index": 0, "count": 1}
_FORMAT = "%(asctime)s %(levelname)s rank %(rank)s %(name)s: %(message)s"
_DATE = "%Y-%m-%d %H:%M:%S"
LEVELS = {"quiet": logging.WARNING, "normal": logging.INFO, "verbose": logging.DEBUG}
# Libraries that are chatty at INFO (every Orbax save logs a dozen lines): their warnings
# stay visible, their INFO only with --verbose.
_LIBRARIES = ("jax", "absl", "orbax", "grain", "etils", "tensorboardX", "matplotlib",
              "lm_eval", "datasets")


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = f"{_rank['index']}/{_rank['count']}"
        return True


# asyncio's words for a task or future (Task, Future, _GatheringFuture) that failed with
# nobody awaiting it: "<kind> exception was never retrieved"
_UNRETRIEVED = " exception was never retrieved"


class _LibraryNoise(logging.Filter):
    """At normal verbosity a library's record keeps its message line but not its
    traceback, and asyncio's "... exception was never retrieved" is dropped. Both are how a
    failed Orbax save shows: a traceback from each thread it passed through, and one
    unretrieved task per array still being written; Orbax's error lines and the loop's one
    line say what failed. --verbose shows everything."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio" and _UNRETRIEVED in str(record.msg).split("\n", 1)[0]:
            return False
        if record.exc_info and record.name.split(".")[0] in _LIBRARIES:
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_closed_loop(unraisable) -> None:
    """sys.unraisablehook: after a failed save, the callbacks of tensorstore writes still in
    flight can find Orbax's event loop closed, and each would print a `RuntimeError: Event
    loop is closed` traceback (dozens per failure); they become a debug line each."""
    if isinstance(unraisable.exc_value, RuntimeError) and \
            str(unraisable.exc_value) == "Event loop is closed":
        logging.getLogger("asyncio").debug("a write finished after its event loop closed")
        return
    sys.__unraisablehook__(unraisable)


def set_rank(index: int, count: int) -> None:
    _rank.update(index=int(index), count=int(count))


def configure(verbosity: str = "normal", stream=None) -> None:
    """Route every Python log record through one rank-prefixed handler on `stream`."""
    if verbosity not in LEVELS:
        raise ValueError(f"verbosity {verbosity!r}: expected one of {sorted(LEVELS)}")
    level = LEVELS[verbosity]
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, _DATE))
    handler.addFilter(_RankFilter())
    if verbosity != "verbose":
        handler.addFilter(_LibraryNoise())
    sys.unraisablehook = sys.__unraisablehook__ if verbosity == "verbose" else _quiet_closed_loop
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in _LIBRARIES:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity == "verbose"
                                         else max(level, logging.WARNING))


def ensure_configured() -> None:
    """Configure with defaults unless something (the CLI, pytest, a user) already did."""
    if not logging.getLogger().handlers:
        configure()


_stderr = {"fd": 2}  # where this process's own lines go: fd 2, or its copy (divert_native)


def stderr_fd() -> int:
    """The file descriptor of this process's stderr for its own lines (os.write)."""
    return _stderr["fd"]


def divert_native_stderr(path) -> None:
    """What native code writes to fd 2 (jax's and absl's C++ logs: a peer's death aborts
    a process of a job with a fatal log and a stack of ~30 lines) goes to the file `path`,
    kept for whoever wants it; Python's `sys.stderr`, the log handler and the lines of
    this module and preemption.py keep the real stderr, so the rank log holds europa-jax's
    lines and a lost peer is one line there. fd 2 stays the file until the process ends."""
    import io
    import os

    sys.stderr.flush()
    real_fd = os.dup(2)
    native_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(native_fd, 2)
    os.close(native_fd)
    old = sys.stderr
    sys.stderr = io.TextIOWrapper(io.FileIO(real_fd, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace")
    _stderr["fd"] = real_fd
    for handler in logging.getLogger().handlers:  # the rank-prefixed handler (configure)
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(sys.stderr)


def native_log_path(process_id: int, slurm: bool, env=None) -> str:
    """Where a process of a job keeps what native code writes to stderr: beside the rank
    logs (`EUROPA_LOG_DIR`, which launch/local.sh and launch/jupiter.sbatch set; a Slurm
    try's number as in its rank log's name), else the temporary directory."""
    import os
    import tempfile

    env = os.environ if env is None else env
    folder = env.get("EUROPA_LOG_DIR")
    if not folder:
        return os.path.join(tempfile.gettempdir(),
                            f"europa-jax-{os.getpid()}-rank-{process_id}.native.log")
    prefix = f"try-{env.get('SLURM_RESTART_COUNT') or 0}-" if slurm else ""
    return os.path.join(folder, f"{prefix}rank-{process_id}.native.log")


def signal_safe_line(level: str, name: str, message: str) -> None:
    """The handler's format written with one os.write: a signal handler may interrupt the
    main thread inside logging, whose locks it must not take. At a terminal the line
    first clears the one the cursor is on — the progress bar, and the `^C` the terminal
    echoed after it — instead of being glued to it; the bar is drawn again below at its
    next update."""
    import os

    clear = "\r\x1b[K" if os.isatty(stderr_fd()) else ""
    os.write(stderr_fd(), (clear + _prefix(level, name) + message + "\n").encode())


def _prefix(level: str, name: str) -> str:
    """The handler's prefix, for lines written without it (signal handler, native stdout)."""
    import time

    return f"{time.strftime(_DATE)} {level} rank {_rank['index']}/{_rank['count']} {name}: "


def stamp_native_stdout(name: str = "native") -> None:
    """Give the log prefix to what native code writes to stdout (gloo's C++ prints
    "[Gloo] Rank k is connected to ..." from its threads), so that every line of a rank's
    log says whose it is. Python's own stdout (the JSON summary) still goes out as is.

    fd 1 becomes a pipe read by a thread that prefixes each line; `sys.stdout` keeps the
    real stdout. At exit fd 1 is restored, which ends the pipe, and the thread drains it.
    """
    import atexit
    import io
    import os
    import threading

    sys.stdout.flush()
    real_fd = os.dup(1)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.close(write_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(real_fd, "w", closefd=False), line_buffering=True)

    def pump() -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                line = raw.decode(errors="replace").rstrip("\n")
                os.write(real_fd, (_prefix("INFO", name) + line + "\n").encode())

    thread = threading.Thread(target=pump, name="stdout-stamp", daemon=True)
    thread.start()

    def restore() -> None:
        sys.stdout.flush()
        os.dup2(real_fd, 1)  # the pipe's last writer is gone: the thread reads to EOF
        thread.join(timeout=2.0)

    atexit.register(restore)
