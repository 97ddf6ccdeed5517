"""benchmarks/gpu_check.py runs end to end at its smoke size, so it is ready for a GPU, and
first compiles every function it times for a GH200 (deviceless, the `gpu` extra), so that
the GPU run's kernels and memory are known before one is lent."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from europa_jax.plan.program import gpu_target
from conftest import REPO, config_path, process_env

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.py")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu_calibration  # noqa: E402


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


@pytest.mark.slow
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
    received = report["moe_received"]
    assert received["tflops"] > 0 and 0 < received["filled_rows"] <= received["rows"]
    assert received["copies"] == 256 * 4 and "matmul_s" in received["profile"]
    for name in ("buffer", "window"):
        part = report["grouped_regime"][name]
        assert part["filled"] < part["rows"]
        assert all(part[kind]["tflops_filled"] > 0 for kind in ("fwd", "dgrad", "wgrad"))
    assert report["documents"]["64_over_one"] > 0
    assert report["fp8_dot"]["fp8_over_bf16"] > 0
    assert report["clocks"] == {"error": "no GPU"}
    # nothing failed but the GPU clocks, which a CPU run has not (the GPU compile included)
    assert "error" not in json.dumps({k: v for k, v in report.items() if k != "clocks"})
    assert stdout.strip().splitlines()[-1].startswith("calibration host_copy")
    # the calibration: every class the plan prices that one GPU can measure
    cal = report["calibration"]
    assert cal["smoke"] is True and cal["device"] == "cpu" and cal["repeats"] == 1
    assert [p["size"] for p in cal["dense_gemm"]["points"]] == sorted(
        {min(shape) for shape in gpu_calibration.dense_shapes(smoke_model(), 256).values()})
    assert len(cal["grouped_gemm"]["points"]) == 3
    for name in ("attention_forward", "attention_backward", "memory_bound", "host_copy"):
        assert 0 < cal[name]["efficiency"]["low"] <= cal[name]["efficiency"]["high"] < 1, name


def smoke_model():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import gpu_programs

    return gpu_programs.check_config(True, 256).model


@pytest.mark.slow
def test_a_gpu_check_json_calibrates_the_plan(smoke_run, tmp_path):
    """`gpu_check.py --cpu-smoke --json X`, then `europa-jax plan … --hardware X`: the
    measured classes replace the assumed ones in the estimate (the calibration path
    cannot rot; a smoke run's numbers say nothing about a GPU, and the plan says so)."""
    report, _ = smoke_run
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    env = {**process_env(), "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-m", "europa_jax.cli", "plan",
                             config_path("tiny-cpu.yaml"), "--devices", "8", "--target", "cpu",
                             "--attention-batches", "2", "--hardware", str(path), "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    e = plan["estimate"]
    assert e["calibration"].startswith("measured by gpu_check on cpu") and "smoke" in e["calibration"]
    cal = report["calibration"]
    assert e["efficiencies"]["attention_backward"]["expected"] == pytest.approx(
        cal["attention_backward"]["efficiency"]["expected"])
    assert [p["size"] for p in e["efficiencies"]["dense_gemm"]["points"]] == [
        p["size"] for p in cal["dense_gemm"]["points"]]
    assert e["efficiencies"]["infiniband"]["source"].startswith("[ib]")  # not measurable here
    # a CPU's "efficiency" against a GPU's peak: the estimate is far slower than assumed
    assert e["range"]["high"]["tokens_per_s_per_gpu"] < 1e5


@pytest.mark.slow
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
        "offload": {"device_to_host", "host_to_device"}, "moe_received": {"fwd+bwd"},
        "grouped_regime": {f"{name}/{kind}" for name in ("buffer", "window")
                           for kind in ("fwd", "dgrad", "wgrad")},
        "documents": {"one_document", "64_documents"}, "fp8_dot": {"bf16", "fp8_e4m3"},
        "calibration": {f"dense/{name}" for name in ("q_a", "q_b", "kv_a", "kv_b", "o",
                                                       "shared_expert", "router", "lm_head")}
        | {f"grouped/{size}/{kind}" for size in ("window", "quarter", "sixteenth")
           for kind in ("fwd", "dgrad", "wgrad")}
        | {"attention/forward", "attention/forward+backward", "memory/triad",
           "memory/rms_norm", "host/device_to_host", "host/host_to_device"}}
    for check, programs in checks.items():
        for name, compiled in programs.items():
            assert compiled["compiled"] is True and compiled["hbm_bytes"] > 0, (check, name)
    # on the GPU: tokamax's flash attention (Triton at the smoke widths), forward and VJP,
    # held against the pure-JAX blockwise kernel, which is plain cuBLAS matmuls
    assert {k for k in checks["attention"]["model"]["kernels"] if "flash_attention" in k} == {
        "pallas_flash_attention_fwd_res", "pallas_flash_attention_vjp"}
    assert set(checks["attention"]["reference"]["kernels"]) == {"__cublas$lt$matmul"}
    for name in ("device_to_host", "host_to_device"):
        offload = checks["offload"][name]
        assert offload["host_bytes"] == 2**24 and offload["host_copies"] > 0
    if tokamax:
        # the grouped-matmul check on Mosaic GPU; the layer on Triton at the smoke widths
        assert "ragged_dot_sm90" in checks["grouped_matmul"]["tokamax.ragged_dot"]["kernels"]
        assert "TritonRaggedDot" in checks["layer"]["fwd+bwd"]["kernels"]
    lines = stdout.splitlines()
    assert lines[0].startswith("GPU-target compile for NVIDIA GH200")  # before the timing
    assert lines[2].startswith("layer/fwd+bwd")


@pytest.mark.slow
def test_without_the_gpu_extra_the_compile_is_recorded_as_skipped(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(gpu_target, "missing_toolchain", lambda: ["jax-cuda12-plugin"])
    aot = gpu_check.compile_checks(None, 256, True, "gh200")
    assert aot == {"target": "gh200", "skipped": "the gpu extra is missing: jax-cuda12-plugin "
                   "(pip install -e '.[gpu]')"}
    assert "jax-cuda12-plugin" in gpu_check.aot_table(aot)


def test_the_profile_split_reads_device_kernels_of_a_trace(tmp_path):
    """gpu_regimes.kernel_time_split on a trace written as jax.profiler writes one: only
    the GPU's tracks count; matmul kernels (cuBLAS, CUTLASS, tokamax's) apart from the rest."""
    import gzip

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import gpu_regimes

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "name": "sm90_xmma_gemm_bf16bf16", "dur": 3000},
              {"ph": "X", "pid": 1, "name": "ragged_dot_kernel", "dur": 1000},
              {"ph": "X", "pid": 1, "name": "loop_select_fusion", "dur": 500},
              {"ph": "X", "pid": 1, "name": "input_scatter_fusion", "dur": 500},
              {"ph": "X", "pid": 2, "name": "loop_select_fusion", "dur": 9000}]  # host: not
    path = tmp_path / "plugins" / "profile" / "run"
    path.mkdir(parents=True)
    with gzip.open(path / "host.trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    split = gpu_regimes.kernel_time_split(str(tmp_path))
    assert split["matmul_s"] == pytest.approx(4e-3) and split["other_s"] == pytest.approx(1e-3)
    assert split["other_fraction"] == pytest.approx(0.2)
    assert {name for name, _ in split["longest_other"]} == {"loop_select_fusion",
                                                            "input_scatter_fusion"}
