"""The run directory's lock: a holder is named, a killed holder leaves no lock, a job whose
process 0 is refused stops on every process, a directory made for nothing is removed."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from europa_jax.job import exit_codes
from europa_jax.store import run_lock
from conftest import REPO
from test_checkpoint import cli_env, start_two_processes  # noqa: F401 (a fixture; train × 2)

# A process that holds a directory's lock until it is killed (what a running train does).
HOLDER = """
import sys, time
from europa_jax.store import run_lock
held = run_lock.lock(sys.argv[1], sys.argv[2])
print("held", flush=True)
time.sleep(600)
"""


def start_holder(directory, command="train", **env):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), command], cwd=REPO,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def holder(tmp_path):
    """A directory held by another process (Slurm job 4242) and that process."""
    proc = start_holder(tmp_path / "run", SLURM_JOB_ID="4242")
    yield tmp_path / "run", proc
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_a_held_directory_is_refused_naming_its_holder(holder):
    directory, proc = holder
    who = f"`europa-jax train` on {socket.gethostname()}, pid {proc.pid}, Slurm job 4242"
    with pytest.raises(run_lock.RunDirInUse, match=f"^{directory}: in use by {who}, since "):
        run_lock.lock(directory, "train")
    with pytest.raises(run_lock.RunDirInUse, match=f"pid {proc.pid}"):
        run_lock.check_free(directory)  # what export asks of its --out
    assert str(proc.pid) in (directory / run_lock.LOCK_FILE).read_text()  # untouched


@pytest.mark.slow
def test_a_killed_holder_leaves_the_file_but_no_lock(holder):
    directory, proc = holder
    proc.send_signal(signal.SIGKILL)  # no handler runs: the kernel drops the lock
    proc.wait()
    assert f'"pid": {proc.pid}' in (directory / run_lock.LOCK_FILE).read_text()
    run_lock.check_free(directory)
    mine = run_lock.lock(directory, "import")
    try:
        text = (directory / run_lock.LOCK_FILE).read_text()
        assert f'"pid": {os.getpid()}' in text and '"command": "import"' in text
    finally:
        mine.release()


def test_a_directory_made_for_nothing_is_removed_one_written_to_is_kept(tmp_path):
    with run_lock.hold(tmp_path / "nothing", "import"):
        assert (tmp_path / "nothing" / run_lock.LOCK_FILE).is_file()
    assert not (tmp_path / "nothing").exists()  # e.g. an import that failed
    with run_lock.hold(tmp_path / "run", "train"):
        (tmp_path / "run" / "config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json",
                                                                     run_lock.LOCK_FILE]


@pytest.mark.slow
def test_a_second_job_is_refused_on_every_process(holder, cli_env):  # noqa: F811
    directory, proc = holder
    procs = start_two_processes(directory, cli_env)
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [exit_codes.BAD_INPUT] * 2, errs[0][-2000:]
    assert f"in use by `europa-jax train` on {socket.gethostname()}, pid {proc.pid}" in errs[0]
    assert "process 0 could not lock it" in errs[1]
    assert [p.name for p in directory.iterdir()] == [run_lock.LOCK_FILE]  # nothing written



def test_a_run_directory_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, cli_env):  # noqa: F811
    """Under a regular file (as under /proc or a read-only mount): not a traceback."""
    from test_checkpoint import run_cli
    (tmp_path / "file").write_text("")
    rc, _, err = run_cli(tmp_path / "file" / "run", cli_env)
    assert rc == exit_codes.BAD_INPUT, err[-2000:]
    assert "Traceback" not in err
    line = next(line for line in err.splitlines() if "cannot use it" in line)
    assert line.endswith(f"{tmp_path / 'file' / 'run'}: cannot use it as the run directory: "
                         "Not a directory (choose another with --run-dir)")
