"""Efficiencies measured by benchmarks/gpu_check.py replacing plan/price/hardware.py's assumed
ones (`europa-jax plan --hardware gpu_check.json`), and bad files refused in one line."""

import json

import pytest

from europa_jax import cli
from europa_jax.config import ConfigError
from europa_jax.plan.price import hardware
from conftest import config_path

GH = hardware.GH200_JUPITER


def calibration(**classes) -> dict:
    return {"calibration": {"device": "NVIDIA H200", "date": "2026-12-04", "smoke": False,
                            **classes}}


def eff(low, expected, high):
    return {"low": low, "expected": expected, "high": high}


def test_measured_classes_replace_the_assumed_ones_and_the_rest_stay(tmp_path):
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(calibration(
        dense_gemm={"points": [{"size": 7168, "shape": "o", "efficiency": eff(.7, .74, .75)},
                               {"size": 576, "shape": "kv_a", "efficiency": eff(.3, .35, .4)}]},
        attention_backward={"efficiency": eff(.40, .41, .43)},
        host_copy={"error": "NVIDIA H200 is not a GH200"})))
    machine = hardware.calibrated(GH, path)
    assert [s for s, _ in machine.dense_gemm.points] == [576, 7168]  # sorted by size
    assert machine.dense_gemm.at(7168, "expected") == pytest.approx(0.74)
    assert machine.attention_backward.expected == 0.41
    assert "NVIDIA H200, 2026-12-04" in machine.attention_backward.source
    # not measured (or failed): as cited
    assert machine.grouped_gemm == GH.grouped_gemm and machine.host_copy == GH.host_copy
    assert machine.infiniband == GH.infiniband
    assert machine.calibration.startswith("measured by gpu_check on NVIDIA H200, 2026-12-04: "
                                          "dense_gemm, attention_backward")


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("not json", "expected gpu_check.py's JSON with a 'calibration' section"),
    (json.dumps({"layer": {}}), "expected gpu_check.py's JSON with a 'calibration' section"),
    (json.dumps(calibration(memory_bound={"error": "OOM"})), "its calibration measured no class"),
    (json.dumps(calibration(memory_bound={"efficiency": eff(0.5, 1.7, 1.9)})),
     r"calibration.memory_bound: \[0.5, 1.7, 1.9\] — a measured fraction of the peak must be "
     r"in \(0, 1\]"),
    (json.dumps(calibration(memory_bound={"efficiency": 0.8})),
     r"calibration.memory_bound: 0.8, expected \{low, expected, high\}"),
])
def test_a_bad_calibration_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "gpu_check.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as e:
        hardware.calibrated(GH, path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_plan_refuses_a_bad_hardware_file_before_compiling(tmp_path, capsys):
    path = tmp_path / "missing.json"
    code = cli.main(["plan", config_path("tiny-cpu.yaml"), "--devices", "8", "--target", "cpu",
                     "--hardware", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and f"--hardware {path}" in err
