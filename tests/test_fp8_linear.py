"""The model's weight GEMMs in FP8 (model/fp8/fp8_linear.py, `execution.fp8_gemms`,
`execution.fp8_expert_gemms`): the block mode is DeepSeek-V3's product (model/fp8/fp8_gemm.py)
forward and backward; the tensor mode's operands are e4m3/e5m2 values times a power of two,
and the GH200 program runs them as cuBLASLt FP8 GEMMs; the model trains through both."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.model.fp8 import fp8_gemm, fp8_linear
from europa_jax.model.experts import moe
from europa_jax.model.experts.expert_matmul import compute_local_experts
from europa_jax.model.layers import SwiGLU
from europa_jax.plan.program import kernel_classes
from conftest import (config_path, first_batch_and_initial_state, gh200_program_text,
                      objective_gradients)
from test_fp8_gemm import operands
from test_gpu_target import needs_toolchain



def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def vjp_of(fn, x, w, g):
    y, pullback = jax.vjp(fn, x, w)
    return (y, *pullback(g))


@pytest.mark.parametrize("m,k,n", [(64, 256, 384), (130, 128, 64)])
def test_block_mode_is_deepseek_v3s_product_forward_and_backward(m, k, n):
    x, w = operands(m, k, n)
    g = jnp.asarray(np.random.default_rng(1).standard_normal((m, n)), jnp.float32)
    ours = vjp_of(lambda x, w: fp8_linear.matmul(x, w, "block"), x, w, g)
    # fp8_gemm.fp8_matmul sums each 128-wide chunk's e4m3 products in float32 and scales
    # them there; dequantizing first is the same sum up to float32 rounding
    emulated = vjp_of(fp8_gemm.fp8_matmul, x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), ours, emulated):
        np.testing.assert_allclose(a, b, atol=2e-6 * float(jnp.max(jnp.abs(b))), err_msg=name)


@pytest.mark.parametrize("mode", ["tensor", "block"])
def test_fp8_products_are_within_the_formats_resolution(mode):
    x, w = operands(96, 256, 128)
    g = jnp.asarray(np.random.default_rng(2).standard_normal((96, 128)), jnp.float32)
    ours = vjp_of(lambda x, w: fp8_linear.matmul(x, w, mode), x, w, g)
    exact = vjp_of(lambda x, w: jnp.matmul(x, w, precision="highest"), x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), ours, exact):
        error = relative(a, b)
        # e4m3 rounds each operand by ≤ 2⁻⁴ of itself (e5m2 gradients: 2⁻³); independent
        # roundings average down over a contraction. Not zero: the rounding happened.
        assert 1e-4 < error < (0.15 if mode == "tensor" else 0.06), (name, error)


def test_tensor_mode_operands_are_fp8_values_times_a_power_of_two():
    x, _ = operands(64, 256, 8)
    for fmt, fmax in ((fp8_linear.E4M3, 448.0), (fp8_linear.E5M2, 57344.0)):
        rounded = np.asarray(fp8_linear._tensor_qdq(x, fmt, jnp.float32))
        amax = float(jnp.max(jnp.abs(x)))
        scale = 2.0 ** np.ceil(np.log2(amax / fmax))
        values = rounded / scale
        assert fmax / 2 <= np.abs(values).max() <= fmax  # the upper half of the range used
        # every value is exactly one of the format's: rounding it again changes nothing
        np.testing.assert_array_equal(np.asarray(jnp.asarray(values).astype(fmt)
                                                 .astype(jnp.float32)), values)
    # in bfloat16 too (the GPU's operands): the power of two multiplies exactly
    x16 = x.astype(jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(fp8_linear._tensor_qdq(x16, fp8_linear.E4M3, jnp.bfloat16), np.float32),
        np.asarray(fp8_linear._tensor_qdq(x16, fp8_linear.E4M3, jnp.float32)))
    # an amax right at a power of two times the format's largest value does not overflow
    edge = jnp.asarray([448.0 * 2.0**-3, -1.0, 0.0])
    assert np.isfinite(np.asarray(fp8_linear._tensor_qdq(edge, fp8_linear.E4M3,
                                                         jnp.float32))).all()
    assert np.asarray(fp8_linear._tensor_qdq(jnp.zeros(4), fp8_linear.E4M3,
                                             jnp.float32)).tolist() == [0.0] * 4


def test_einsum_is_the_plain_einsum_when_off_and_a_reshaped_gemm_in_fp8():
    rng = np.random.default_rng(3)
    o = jnp.asarray(rng.standard_normal((2, 5, 4, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    np.testing.assert_array_equal(fp8_linear.einsum("bsho,hod->bsd", o, w, "none"),
                                  jnp.einsum("bsho,hod->bsd", o, w))
    ours = fp8_linear.einsum("bsho,hod->bsd", o, w, "tensor")
    np.testing.assert_array_equal(
        ours, fp8_linear.matmul(o.reshape(10, 32), w.reshape(32, 16), "tensor").reshape(2, 5, 16))
    with pytest.raises(ValueError, match="not x"):
        fp8_linear.einsum("bsd,fd->bsf", o[..., 0, :], w[0].T, "tensor")


@pytest.fixture(scope="module")
def batch_and_state(tiny_cfg):
    return first_batch_and_initial_state(tiny_cfg)


@pytest.fixture(scope="module")
def reference(tiny_cfg, batch_and_state):
    return objective_gradients(tiny_cfg, *batch_and_state)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [dict(fp8_gemms="tensor"),
                                     dict(fp8_gemms="block", fp8_expert_gemms="block")],
                         ids=["tensor", "block-with-experts"])
def test_the_model_trains_through_fp8_gemms(tiny_cfg, batch_and_state, reference, changes):
    (loss, _), grads = objective_gradients(tiny_cfg, *batch_and_state, **changes)
    (loss_ref, _), grads_ref = reference
    assert loss != loss_ref and abs(loss - loss_ref) < 0.01 * loss_ref
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), g_ref in zip(flat, jax.tree.leaves(grads_ref), strict=True):
        name = jax.tree_util.keystr(path)
        if np.linalg.norm(g_ref) == 0:
            continue
        error = relative(g, g_ref)
        assert error < 0.2, (name, error)


def test_the_blocked_experts_forward_is_each_rows_fp8_product():
    """fp8_expert_gemms: the blocked kernel's forward, row by row, is fp8_linear's block
    product of that row with its experts' weights (a row's tiles and an expert's blocks do
    not depend on how rows are grouped into blocks)."""
    rng = np.random.default_rng(4)
    r, d, f, e, u = 48, 128, 256, 4, 2
    x = jnp.asarray(rng.standard_normal((r, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, u, replace=False) for _ in range(r)]),
                          jnp.int32)
    gates = jnp.asarray(rng.random((r, u)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((e, d, f)) / 11, jnp.float32)
                    for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((e, f, d)) / 16, jnp.float32)
    y, _ = compute_local_experts(x, experts, gates, w_gate, w_up, w_down, impl="blocked",
                                 fp8="block")
    y_plain, _ = compute_local_experts(x, experts, gates, w_gate, w_up, w_down,
                                       impl="blocked")

    def fp8(a, w):
        return fp8_linear.forward(a, w, "block")

    ref = np.zeros((r, d), np.float32)
    for i in range(r):
        for j in range(u):
            k = int(experts[i, j])
            hidden = jax.nn.silu(fp8(x[i:i + 1], w_gate[k])) * fp8(x[i:i + 1], w_up[k])
            ref[i] += float(gates[i, j]) * np.asarray(fp8(hidden, w_down[k]))[0]
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert relative(y, y_plain) > 1e-3  # and it is not the plain product


def test_fp8_expert_gemms_need_the_blocked_kernel(tiny_cfg):
    cfg = tiny_cfg.model
    ex = dataclasses.replace(tiny_cfg.execution, grouped_matmul="ragged_dot",
                             fp8_expert_gemms="block")
    with pytest.raises(ConfigError, match="execution.fp8_expert_gemms: 'block' runs with the "
                                          "`blocked` expert kernel only, not 'ragged_dot'"):
        moe.local_experts(64, cfg, ex, 4)
    blocked = dataclasses.replace(ex, grouped_matmul="blocked")
    assert moe.local_experts(64, cfg, blocked, 4).fp8 == "block"


def swiglu_gemm_targets(mode: str) -> list[str]:
    """The GEMM custom calls of a SwiGLU's forward and backward compiled for a GH200."""
    tiny = load_config(config_path("tiny-cpu.yaml"))
    cfg = tiny.model
    mlp = SwiGLU(cfg, dataclasses.replace(tiny.execution, compute_dtype="bfloat16",
                                          fp8_gemms=mode))
    x = jax.ShapeDtypeStruct((2, 256, cfg.d_model), jnp.bfloat16)
    params = jax.eval_shape(mlp.init, jax.random.key(0), x)

    def loss(params, x):  # (not a sum: its constant cotangent would fold the backward's
        # quantization away, and nothing would need the forward's last GEMM)
        return jnp.square(mlp.apply(params, x).astype(jnp.float32)).sum()

    text = gh200_program_text(jax.grad(loss, argnums=(0, 1)), params, x)
    return [kernel_classes._target(line) for line in text.splitlines()
            if "__cublas" in kernel_classes._target(line)]


@pytest.mark.slow
@needs_toolchain
def test_gh200_runs_the_tensor_mode_as_cublaslt_fp8_gemms():
    # two GEMMs forward (gate and up side by side, then down), two per GEMM backward: all
    # six in FP8 (and none without the mode)
    assert swiglu_gemm_targets("tensor") == ["__cublas$lt$matmul$f8"] * 6
    assert "__cublas$lt$matmul$f8" not in swiglu_gemm_targets("none")


def test_the_plan_prices_fp8_gemms_in_their_own_math():
    line = ('%g = (bf16[256,384]{1,0}, s8[4194304]{0}) custom-call(%a, %b, %s, %t), '
            'custom_call_target="__cublas$lt$matmul$f8"')
    assert kernel_classes._target(line).startswith(kernel_classes.GEMM_TARGETS)
    assert kernel_classes.gemm_math(["f8e4m3fn[256,512]{1,0}", "f8e4m3fn[384,512]{1,0}"],
                                    line) == "fp8"
    from europa_jax.plan.price import hardware, step_time
    machine = hardware.GH200_JUPITER
    assert step_time.peak_share(machine, "fp8") == machine.fp8_per_bf16 > 1
