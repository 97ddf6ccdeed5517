"""A try's clock (records/timeline.py) starts when its process begins running europa-jax, not
when the kernel made the process: a shell execs the last command of `install && train`
in its own process, whose kernel start time is before the install."""

import pytest
import subprocess
import sys

PROBE = """
import os, time
import europa_jax.records.timeline as timeline
with open("/proc/self/stat") as f:
    ticks = int(f.read().rsplit(")", 1)[1].split()[19])
with open("/proc/stat") as f:
    boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
kernel_start = boot + ticks / os.sysconf("SC_CLK_TCK")
print(time.time() - timeline.process_start_time(), time.time() - kernel_start)
"""


@pytest.mark.slow
def test_a_try_starts_with_europa_jax_not_with_the_shell_that_execs_it(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    # `sleep 2` stands for `pip install -e .`: bash runs it, then execs python in its place
    out = subprocess.run(["bash", "-c", f"sleep 2 && exec {sys.executable} {probe}"],
                         capture_output=True, text=True, check=True).stdout
    since_europa_jax, since_kernel_start = map(float, out.split())
    assert since_kernel_start > 2.0  # the process is the shell's: it started before the sleep
    assert since_europa_jax < 1.5
