"""benchmarks/cudnn_packed_attention.py: cuDNN's packed-layout attention (documents skipped
in both passes) at MLA's head dims compiles for a GH200 without a GPU — the probe that says
whether the document-aware library backward is reachable from jax on this stack."""

import pytest
import os
import subprocess
import sys

from test_gpu_target import needs_toolchain

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "cudnn_packed_attention.py")


@pytest.mark.slow
@needs_toolchain
def test_cudnn_packed_attention_compiles_forward_and_backward_for_gh200():
    result = subprocess.run([sys.executable, SCRIPT, "--seq", "1024", "--heads", "2"],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "__cudnn$fmhaSoftmaxBackward" in result.stdout
    assert "compiles for GH200" in result.stdout
