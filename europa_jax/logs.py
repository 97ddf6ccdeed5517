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
_LIBRARIES = ("jax", "absl", "orbax", "grain", "etils", "tensorboardX", "matplotlib")


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = f"{_rank['index']}/{_rank['count']}"
        return True


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


def signal_safe_line(level: str, name: str, message: str) -> None:
    """The handler's format written with one os.write: a signal handler may interrupt the
    main thread inside logging, whose locks it must not take."""
    import os
    import time

    stamp = time.strftime(_DATE)
    rank = f"{_rank['index']}/{_rank['count']}"
    os.write(2, f"{stamp} {level} rank {rank} {name}: {message}\n".encode())
