"""launch/env.sh and launch/jupiter.sbatch without a cluster: what a rank's environment holds,
that this jaxlib accepts every XLA flag (XLA aborts a process on an unknown one), and the
script's own one-line errors."""

import pytest
import os
import subprocess
import sys

from conftest import REPO

ENV_SH = os.path.join(REPO, "launch", "env.sh")
SBATCH = os.path.join(REPO, "launch", "jupiter.sbatch")
KEYS = ("NCCL_MAX_CTAS", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_DEBUG", "XLA_FLAGS",
        "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")


def sourced(**preset: str) -> dict[str, str]:
    """The variables env.sh leaves set, starting from a clean environment plus `preset`."""
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    script = f"set -euo pipefail; source {ENV_SH}; env -0"
    out = subprocess.run(["bash", "-c", script], env={**env, **preset}, check=True,
                         capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


@pytest.mark.slow
def test_the_recipe_settings_are_exported():
    env = sourced()
    assert env["NCCL_MAX_CTAS"] == "16"
    assert env["XLA_CLIENT_MEM_FRACTION"] == "0.92"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
    assert int(env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]) > 0
    flags = env["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false" in flags
    # without the one-shot kernel the exchange is NCCL send/recv, refused since jax 0.11
    # unless allowed
    assert "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true" in flags


@pytest.mark.slow
def test_values_already_set_win_and_the_callers_xla_flags_come_last():
    env = sourced(NCCL_MAX_CTAS="8", XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=false",
                  XLA_PYTHON_CLIENT_MEM_FRACTION="0.8")
    assert env["NCCL_MAX_CTAS"] == "8"
    # XLA reads flags left to right: the caller's setting is the one that holds.
    assert env["XLA_FLAGS"].split()[-1] == "--xla_gpu_enable_latency_hiding_scheduler=false"
    # jax refuses XLA_CLIENT_MEM_FRACTION together with the older name: only the user's stays.
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"
    assert "XLA_CLIENT_MEM_FRACTION" not in env


@pytest.mark.slow
def test_this_jaxlib_knows_every_xla_flag():
    # The GPU flags are parsed by every jaxlib build; an unknown one ends the process (F-log).
    env = {**sourced(), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Unknown flag" not in done.stderr, done.stderr[-2000:]


def sbatch_run(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    """The batch script run by bash outside Slurm, as far as its own checks go."""
    run_env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": REPO,
               "EUROPA_VENV": sys.prefix, **env}
    run_env = {k: v for k, v in run_env.items() if v is not None}
    return subprocess.run(["bash", SBATCH, *args], env=run_env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.slow
def test_sbatch_without_a_config_prints_its_usage():
    done = sbatch_run()
    assert done.returncode == 2 and done.stderr.startswith("usage: sbatch"), done.stderr


@pytest.mark.slow
def test_sbatch_names_a_missing_config_and_a_missing_venv_in_one_line():
    done = sbatch_run("configs/no-such.yaml")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"jupiter.sbatch: CONFIG: configs/no-such.yaml: no such file (relative to {REPO})"]
    done = sbatch_run("configs/tiny-cpu.yaml", EUROPA_VENV="/nonexistent-venv")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jupiter.sbatch: EUROPA_VENV: /nonexistent-venv is not a virtualenv (no bin/activate)"]


@pytest.mark.slow
def test_sbatch_run_outside_slurm_says_to_submit_it():
    done = sbatch_run("configs/tiny-cpu.yaml", SLURM_JOB_ID=None)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jupiter.sbatch: SLURM_JOB_ID is not set: submit this script with sbatch"]
