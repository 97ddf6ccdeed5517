"""benchmarks/gpu_check.py runs end to end at its smoke size, so it is ready for a GPU."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_gpu_check_smoke_run_writes_every_measurement(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"),
                             "--cpu-smoke", "--repeats", "1", "--json", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True
    layer = report["layer"]
    assert layer["tflops"] > 0 and layer["local_experts"] == 8 and layer["routed_rows"] == 256 * 4
    assert layer["xla_bytes"] > 0
    grouped = report["grouped_matmul"]
    assert grouped["dense_matmul"]["tflops"] > 0 and grouped["lax.ragged_dot"]["vs_dense"] > 0
    assert report["attention"]["blockwise (model)"]["vs_reference"] > 0
    assert report["offload"]["memory_kind"] == "pinned_host"
    assert report["offload"]["host_to_device_gbps"] > 0
    assert "error" not in json.dumps(report)
    assert result.stdout.strip().splitlines()[-1].startswith("pinned_host→device GB/s")
