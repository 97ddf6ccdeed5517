"""What became of a checkpoint save: its outcome, the error a user reads, the reason in a
line, and the removal of what a failed one left.

Orbax writes a save in background threads; a failure there (a full disk, a file system
error) is only logged by Orbax, and raised at the next save. `Checkpointer.outcome` asks for
it instead, and the loop (loop.SaveGuard) reports it with these.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class SaveOutcome:
    """What became of one save; `error` is None when it reached the disk."""

    step: int
    error: str | None = None
    directory: Path | None = None
    last_good: int | None = None  # the newest committed step once a save has failed


class SaveFailed(Exception):
    """A save that did not reach the disk; the message is the line a user reads."""

    def __init__(self, outcome: SaveOutcome):
        last = "none" if outcome.last_good is None else f"step {outcome.last_good}"
        super().__init__(f"checkpoint at step {outcome.step} failed: {outcome.error} "
                         f"({outcome.directory}); last good checkpoint: {last}")
        self.outcome = outcome


# A process's view of the save being written (Checkpointer.outcome).
WRITING, DONE, FAILED = 0, 1, 2


def save_error(e: BaseException) -> str:
    """A failed write as one line, the operating system's reason first where there is one:
    tensorstore ends a long line with `[os_error_code='28']`, an OSError has its errno."""
    code = e.errno if isinstance(e, OSError) and e.errno else None
    found = re.search(r"os_error_code='(\d+)'", str(e))
    code = code or (int(found[1]) if found else None)
    if code:
        return f"{os.strerror(code)} [errno {code}]"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def remove_failed_save(directory: Path, step: int, quiet_s: float = 0.5,
                       limit_s: float = 10.0) -> None:
    """Remove step `step`'s temporary directories from `directory` until none has
    reappeared for `quiet_s`. Orbax reports the first write that failed while tensorstore
    may still finish others in its own threads (up to 0.16 s later in
    tests/test_checkpoint.py's tiny saves), and a write makes its directories again. A
    straggler after `limit_s` is removed by the next run's manager, as after a kill."""
    start = quiet_since = time.monotonic()
    while time.monotonic() - start < limit_s:
        found = list(directory.glob(f"{step}.orbax-checkpoint-tmp*"))
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
        if found:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.05)
