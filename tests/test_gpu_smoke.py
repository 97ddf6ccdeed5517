"""benchmarks/gpu_smoke.py, the first GPU minutes, runs its logic on CPU devices: the real
train step in processes of its own, the device run against the CPU run, the modelled
ragged exchange against the dense one; and its comparisons catch what they are for."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_smoke.py")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu_smoke  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_smoke") / "gpu_smoke.json"
    done = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--steps", "2", "--json",
                           str(out)], cwd=out.parent, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.slow
def test_cpu_smoke_trains_both_parts_and_they_agree(smoke):
    report, stdout = smoke
    assert report["tiny"] is True and report["failures"] == [] and "PASS" in stdout
    single = report["single_device"]
    for name in ("device", "cpu"):
        run = single[name]
        assert run["devices"] == 1 and run["state_finite"] and len(run["steps"]) == 2
        assert all(s["finite"] and s["loss"] > 0 and s["grad_norm"] > 0 for s in run["steps"])
    # the weights moved: the second step's batch and weights give another loss
    assert single["cpu"]["steps"][0]["loss"] != single["cpu"]["steps"][1]["loss"]
    assert [r["step"] for r in single["comparison"]["per_step"]] == [1, 2]
    exchange = report["exchange"]
    assert exchange["ragged"]["devices"] == exchange["dense"]["devices"] == 4
    assert exchange["ragged"]["collectives"] != exchange["dense"]["collectives"]
    assert exchange["comparison"]["failures"] == []


def _run(losses, norms, platform="cpu", kernels=None):
    return {"platform": platform, "state_finite": True, "nonfinite_state_leaves": 0,
            "library_kernels": kernels or {},
            "steps": [{"step": i + 1, "loss": loss, "grad_norm": norm, "finite": True}
                      for i, (loss, norm) in enumerate(zip(losses, norms))]}


def test_comparison_fails_outside_the_tolerance_and_on_nan():
    reference = _run([6.0, 5.5], [2.0, 3.0])
    assert gpu_smoke.compare(_run([6.03, 5.6], [2.02, 3.2]), reference,
                             gpu_smoke.TOLERANCE, "x")["failures"] == []
    first_step_off = gpu_smoke.compare(_run([6.1, 5.5], [2.0, 3.0]), reference,
                                       gpu_smoke.TOLERANCE, "x")["failures"]
    assert len(first_step_off) == 1 and "step 1: loss" in first_step_off[0]
    nan = gpu_smoke.compare(_run([6.0, float("nan")], [2.0, 3.0]), reference,
                            gpu_smoke.TOLERANCE, "x")["failures"]
    assert len(nan) == 1 and "step 2: loss" in nan[0]
    short = gpu_smoke.compare(_run([6.0], [2.0]), reference, gpu_smoke.TOLERANCE, "x")
    assert short["failures"] == ["x: 1 steps against 2"]


def test_a_nonfinite_run_or_state_is_a_failure():
    run = _run([6.0, 5.5], [2.0, float("inf")])
    run["steps"][1]["finite"] = False
    assert gpu_smoke.problems_of(run, "gpu")[0].startswith("gpu step 2: non-finite")
    run = _run([6.0], [2.0])
    run.update(state_finite=False, nonfinite_state_leaves=3)
    assert gpu_smoke.problems_of(run, "gpu") == [
        "gpu: 3 state leaves hold NaN/Inf after the last step"]
    assert gpu_smoke.problems_of({"error": "exit 1: OOM"}, "gpu") == ["gpu: exit 1: OOM"]


def test_a_gpu_program_without_the_library_kernels_is_a_failure():
    complete = {"grouped_gemm": {"ragged_dot_sm90": 6}, "attention_forward": {"f": 1},
                "attention_backward": {"b": 1}}
    assert gpu_smoke.check_kernels(_run([6.0], [2.0], "gpu", complete), "gpu") == []
    fallen_back = {k: v for k, v in complete.items() if k != "grouped_gemm"}
    assert gpu_smoke.check_kernels(_run([6.0], [2.0], "gpu", fallen_back), "gpu") == [
        "gpu: no grouped_gemm library kernel in the GPU program "
        "(found ['attention_backward', 'attention_forward'])"]
    assert gpu_smoke.check_kernels(_run([6.0], [2.0], "cpu"), "cpu") == []


def test_exchanges_that_compiled_alike_are_a_failure():
    same = {"ragged-all-to-all": 0, "all-to-all": 2, "all-gather": 4}
    ragged, dense = _run([6.0], [2.0]), _run([6.0], [2.0])
    ragged["collectives"], dense["collectives"] = same, dict(same)
    assert "compiled the same collectives" in gpu_smoke.exchange_differs(ragged, dense)[0]
    ragged.update(platform="gpu", collectives={**same, "all-gather": 6})
    assert "expected in the ragged run only" in gpu_smoke.exchange_differs(ragged, dense)[0]
    ragged["collectives"] = {**same, "ragged-all-to-all": 2}
    assert gpu_smoke.exchange_differs(ragged, dense) == []
