"""`europa-jax train` at a real terminal: a pseudo-terminal is its controlling tty, and
Ctrl-C is the byte 0x03 typed into it, which the terminal driver turns into SIGINT for the
whole foreground process group — as a user's keyboard does. The run finishes its step,
saves, says so in one line and exits 130; nothing reaches the terminal as a traceback."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from europa_jax.store import checkpoint
from europa_jax.job import exit_codes
from conftest import REPO, config_path
from test_checkpoint import TINY, cli_env, metrics  # noqa: F401


def _controlling_tty():
    """In the child, after setsid: stdin (the pty's slave) becomes its controlling tty."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.slow
def test_ctrl_c_typed_at_the_terminal_saves_and_exits_130(tmp_path, cli_env):  # noqa: F811
    master, slave = pty.openpty()
    # a terminal of 24 rows × 120 columns (a fresh pty is 0 × 0: the bar would be empty)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    args = [sys.executable, "-m", "europa_jax.cli", "train", config_path("tiny-cpu.yaml"),
            "--run-dir", str(tmp_path)]
    for item in [*TINY, "checkpoint.every_steps=0"]:
        args += ["--set", item]
    proc = subprocess.Popen(args, cwd=REPO, env=cli_env, stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True, preexec_fn=_controlling_tty)
    os.close(slave)
    screen = bytearray()

    def drain():  # the terminal's reader: a full pty would block the run's writes
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer has closed the slave
                return
            if not chunk:
                return
            screen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.time() + 300
        path = tmp_path / "metrics.jsonl"
        while not (path.exists() and len(path.read_text().splitlines()) >= 3):
            assert proc.poll() is None, bytes(screen).decode(errors="replace")[-3000:]
            assert time.time() < deadline, "step 3 not reached"
            time.sleep(0.02)
        os.write(master, b"\x03")  # Ctrl-C, as typed
        assert proc.wait(timeout=300) == exit_codes.INTERRUPTED
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
        os.close(master)
    text = bytes(screen).decode(errors="replace")
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    (saved,) = checkpoint.committed_steps(tmp_path)
    assert len(metrics(tmp_path)) == saved >= 3
    assert f"europa-jax: interrupted (Ctrl-C): saved step {saved}; the same command resumes " \
           "from it" in text
    # on a line of its own, not glued to the progress bar the last step drew (no newline)
    assert re.search(r"\neuropa-jax: interrupted", text), repr(text[-500:])
    # at a terminal the steps are a progress bar, and log lines start lines of their own
    assert re.search(r"\d+/\d+ \[", text), repr(text[-3000:])
    for line in re.split(r"[\r\n]", text):
        assert not re.search(r"\].*\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING)", line), line
