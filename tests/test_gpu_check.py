"""benchmarks/gpu_check.py runs end to end at its smoke size, so it is ready for a GPU, and
first compiles every function it times for a GH200 (deviceless, the `gpu` extra), so that
the GPU run's kernels and memory are known before one is lent."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from europa_jax.plan import gpu_target
from conftest import REPO

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.py")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One run for both tests: the compile for the GPU target, then the timed smoke run."""
    tmp_path = tmp_path_factory.mktemp("gpu_check")
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--repeats", "1",
                             "--aot-target", "gh200", "--json", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def require_toolchain():
    missing = gpu_target.missing_toolchain()
    if missing and os.environ.get("EUROPA_JAX_REQUIRE_GPU_COMPILE") == "1":
        pytest.fail(f"the GPU compile toolchain is required here; missing: {missing}")
    if missing:
        pytest.skip(f"gpu extra missing: {missing}")


def test_gpu_check_smoke_run_writes_every_measurement(smoke_run):
    report, stdout = smoke_run
    assert report["smoke"] is True
    layer = report["layer"]
    assert layer["tflops"] > 0 and layer["local_experts"] == 8 and layer["routed_rows"] == 256 * 4
    assert layer["xla_bytes"] > 0
    grouped = report["grouped_matmul"]
    assert grouped["dense_matmul"]["tflops"] > 0 and grouped["lax.ragged_dot"]["vs_dense"] > 0
    attention = report["attention"]
    assert attention["kernels"] == {"model": "blockwise", "reference": "xla"}  # on CPU
    assert attention["model"]["vs_reference"] > 0
    assert report["offload"]["memory_kind"] == "pinned_host"
    assert report["offload"]["host_to_device_gbps"] > 0
    assert "error" not in json.dumps(report)  # the compile for the GPU target included
    assert stdout.strip().splitlines()[-1].startswith("pinned_host→device GB/s")


def test_every_timed_function_compiles_for_a_gh200_first(smoke_run):
    require_toolchain()
    report, stdout = smoke_run
    aot = report["aot"]
    assert aot["target"] == "gh200" and aot["smoke"] is True and aot["tokens"] == 256
    checks = aot["checks"]
    tokamax = {"tokamax.ragged_dot"} if importlib.util.find_spec("tokamax") else set()
    assert {check: set(programs) for check, programs in checks.items()} == {
        "layer": {"fwd+bwd"}, "grouped_matmul": {"dense_matmul", "lax.ragged_dot"} | tokamax,
        "attention": {"model", "reference"},
        "offload": {"device_to_host", "host_to_device"}}
    for check, programs in checks.items():
        for name, compiled in programs.items():
            assert compiled["compiled"] is True and compiled["hbm_bytes"] > 0, (check, name)
    # on the GPU: tokamax's flash attention (Triton at the smoke widths), forward and VJP,
    # held against the pure-JAX blockwise kernel, which is plain cuBLAS matmuls
    assert {k for k in checks["attention"]["model"]["kernels"] if "FlashAttention" in k} == {
        "PallasTritonFlashAttention", "PallasTritonFlashAttentionVjp"}
    assert set(checks["attention"]["reference"]["kernels"]) == {"__cublas$lt$matmul"}
    for name in ("device_to_host", "host_to_device"):
        offload = checks["offload"][name]
        assert offload["host_bytes"] == 2**24 and offload["host_copies"] > 0
    if tokamax:
        # the grouped-matmul check on Mosaic GPU; the layer on Triton at the smoke widths
        assert any("RaggedDot" in k for k in checks["grouped_matmul"]["tokamax.ragged_dot"]
                   ["kernels"])
        assert any("RaggedDot" in k for k in checks["layer"]["fwd+bwd"]["kernels"])
    lines = stdout.splitlines()
    assert lines[0].startswith("GPU-target compile for NVIDIA GH200")  # before the timing
    assert lines[2].startswith("layer/fwd+bwd")


def test_without_the_gpu_extra_the_compile_is_recorded_as_skipped(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(gpu_target, "missing_toolchain", lambda: ["jax-cuda12-plugin"])
    aot = gpu_check.compile_checks(None, 256, True, "gh200")
    assert aot == {"target": "gh200", "skipped": "the gpu extra is missing: jax-cuda12-plugin "
                   "(pip install -e '.[gpu]')"}
    assert "jax-cuda12-plugin" in gpu_check.aot_table(aot)
