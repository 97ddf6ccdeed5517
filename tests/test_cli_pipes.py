"""The command line's output into a pipe whose reader stops early (`europa-jax report … |
head`): no BrokenPipeError traceback, exit 0."""

import pytest
import subprocess
import sys

from conftest import REPO, config_path


@pytest.mark.slow
def test_a_reader_that_stops_early_gets_no_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "europa_jax.cli", "count",
                             config_path("tiny-cpu.yaml")], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
