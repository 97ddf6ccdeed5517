"""The library-kernel expert path in bounded windows against a per-row reference: values,
gradients, overflowing windows, and weight gradients accumulated in float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from europa_jax.config import ConfigError
from europa_jax.model import kernels
from europa_jax.model.experts.expert_windows import windowed_experts

R, U, D, F, E = 40, 3, 8, 6, 6


def inputs(assignment: str, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, E, size=(R, U))
    if assignment == "all_to_one":  # one expert gets every copy: its group overflows
        experts[:] = 4
    if assignment == "empty_group":  # experts 0-2 (group 0 of 2) get nothing
        experts = rng.integers(3, E, size=(R, U))
    experts[::7, 1:] = -1  # rows with fewer local choices; row 0 has one
    experts[5] = -1  # a row with none
    x = jnp.asarray(rng.normal(size=(R, D)), dtype)
    gates = jnp.asarray(rng.uniform(0.1, 1.0, size=(R, U)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(E, D, F)) / 3, dtype) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(E, F, D)) / 3, dtype)
    return x, jnp.asarray(experts, jnp.int32), gates, w_gate, w_up, w_down


def reference(x, experts, gates, w_gate, w_up, w_down):
    """Each row through its chosen experts one by one, in float32 (any sizes: also
    test_gpu_interpreter's)."""
    f32 = lambda a: a.astype(jnp.float32)
    x, w_gate, w_up, w_down = map(f32, (x, w_gate, w_up, w_down))

    def row(x_D, e_U, g_U):
        out = jnp.zeros(w_down.shape[-1])
        for j in range(e_U.shape[0]):
            e = jnp.maximum(e_U[j], 0)
            y = (jax.nn.silu(x_D @ w_gate[e]) * (x_D @ w_up[e])) @ w_down[e]
            out = out + jnp.where(e_U[j] >= 0, g_U[j], 0.0) * y
        return out

    return jax.vmap(row)(x, experts, gates)


def impls():
    return ["ragged_dot"] + (["tokamax"] if kernels.tokamax_available() else [])


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("assignment", ["random", "all_to_one", "empty_group"])
@pytest.mark.parametrize("groups,window", [(1, 1000), (2, 8), (3, 5)])
def test_windows_equal_the_per_row_reference(impl, assignment, groups, window):
    """Whatever the windows (one for every copy, or so small that every group overflows
    into several), the same rows, gradients and counts."""
    x, experts, gates, *w = inputs(assignment)

    def run(x, gates, *w):
        return windowed_experts(x, experts, gates, *w, impl=impl, groups=groups,
                                window=window)

    y, sizes = run(x, gates, *w)
    np.testing.assert_allclose(y, reference(x, experts, gates, *w), rtol=1e-5, atol=1e-5)
    counts = np.bincount(np.asarray(experts)[np.asarray(experts) >= 0], minlength=E)
    np.testing.assert_array_equal(sizes, counts)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.grad(loss(lambda *a: run(*a)[0]), argnums=range(5))(x, gates, *w)
    want = jax.grad(loss(lambda x, g, *w: reference(x, experts, g, *w)),
                    argnums=range(5))(x, gates, *w)
    for name, a, b in zip(["x", "gates", "w_gate", "w_up", "w_down"], got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def weight_grads(experts, x, gates, w, window, groups=2):
    f = lambda *w: jnp.sum(jnp.sin(windowed_experts(
        x, experts, gates, *w, impl="ragged_dot", groups=groups, window=window)[0]))
    return jax.grad(f, argnums=(0, 1, 2))(*w)


@pytest.mark.slow
def test_weight_gradients_are_accumulated_in_float32_and_rounded_once():
    """bf16 rows (as the kernels multiply them), float32 weights: the weight gradients
    over 30 windows (every group overflows many times) equal one window's — the float32
    accumulation of one kernel call over every copy — to 1e-6. Summing per-window
    partials in bf16 (what a per-chunk bf16 gradient accumulation does) would not."""
    x, experts, gates, *w = inputs("random")
    x = x.astype(jnp.bfloat16)
    w = [a.astype(jnp.bfloat16).astype(jnp.float32) for a in w]  # values bf16 holds
    whole = weight_grads(experts, x, gates, w, window=R * U)
    windowed = weight_grads(experts, x, gates, w, window=2)
    for a, b in zip(windowed, whole):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.abs(b).max()))
    # the bf16 path: each chunk of rows' gradient in bf16, summed in bf16
    chunks = [slice(i, i + 10) for i in range(0, R, 10)]
    w16 = [a.astype(jnp.bfloat16) for a in w]
    parts = [weight_grads(experts[c], x[c], gates[c], w16, window=R * U) for c in chunks]
    summed = [sum(p[i] for p in parts[1:]) + parts[0][i] for i in range(3)]
    error = max(float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
                for a, b in zip(summed, whole))
    assert error > 1e-3, error


def test_the_backward_runs_eight_grouped_matmuls_per_window():
    """The gate's gradient out·dy is taken as hidden·(dy·w_downᵀ), from the matmul the
    hidden's gradient needs anyway: the backward recomputes gate and up (2), takes the
    hidden's gradient (1), the rows' (2) and the weights' (3) — not the copy's output
    too. Per window body: window 0 and the overflow loop's each (3 forward, 8 backward)."""
    x, experts, gates, *w = inputs("random")
    f = lambda x, g, *w: jnp.sum(windowed_experts(x, experts, g, *w, impl="ragged_dot",
                                                  groups=1, window=R * U)[0])
    count = lambda fn: str(jax.make_jaxpr(fn)(x, gates, *w)).count("ragged_dot_general[")
    assert count(f) == 2 * 3
    assert count(jax.grad(f, argnums=range(5))) == 2 * (3 + 8)


def test_bad_groups_are_an_error():
    x, experts, gates, *w = inputs("random")
    with pytest.raises(ValueError, match="4 expert groups do not divide 6"):
        windowed_experts(x, experts, gates, *w, impl="ragged_dot", groups=4, window=8)


def test_every_tokamax_call_names_exactly_one_implementation():
    """tokamax passes silently from a kernel that declines to the next (0.0.17: Mosaic
    declines float32, Triton is missing without jax_triton, then XLA's dense matmul runs),
    so our rule names one: Mosaic GPU or Triton on a GPU, the XLA reference elsewhere."""
    assert kernels.tokamax_grouped_matmul("tokamax", "gpu") == "mosaic"
    assert kernels.tokamax_grouped_matmul("tokamax_triton", "gpu") == "triton"
    assert kernels.tokamax_grouped_matmul("tokamax", "cpu") == "xla"
    assert kernels.tokamax_grouped_matmul("tokamax_triton", "cpu") == "xla"


def test_the_triton_grouped_matmul_without_jax_triton_is_a_one_line_config_error(
        tiny_cfg, monkeypatch):
    real = kernels._importable
    monkeypatch.setattr(kernels, "_importable", lambda m: m != "jax_triton" and real(m))
    cfg = dataclasses.replace(tiny_cfg.execution, grouped_matmul="tokamax_triton")
    with pytest.raises(ConfigError, match=r"^execution\.grouped_matmul: 'tokamax_triton' needs "
                                          r"jax_triton.*pip install") as err:
        kernels.grouped_matmul_impl(cfg, "gpu")
    assert "\n" not in str(err.value)


def test_rows_a_kernel_leaves_unwritten_never_reach_another_kernel(monkeypatch):
    """tokamax's Mosaic GPU grouped matmul leaves the rows past its groups unwritten (NaN
    in the Pallas GPU interpreter), and its weight-gradient kernel lets such rows of its
    rhs into its sums. Emulated on CPU around tokamax's XLA reference, more harshly than
    the kernel (whose contract, exactly, is tests/test_gpu_interpreter.py's stand-in): any
    NaN rhs row past the groups poisons every expert's gradient. Windows of whole 128-row
    tiles mostly past the groups: values and gradients stay the per-row reference's."""
    real = kernels.tokamax_ragged

    def emulated(impl, general=False, platform=None):
        fn = real(impl, general, platform)
        if general:  # a NaN rhs row past the groups reaches every sum: 0·NaN
            def contract(lhs, rhs, sizes, *args, **kwargs):
                past = (jnp.arange(rhs.shape[0]) >= sizes.sum())[:, None]
                return fn(lhs, rhs, sizes, *args, **kwargs) + 0.0 * jnp.sum(
                    jnp.where(past, rhs, 0).astype(jnp.float32))
            return contract

        def matmul(lhs, rhs, sizes, **kwargs):
            out = fn(lhs, rhs, sizes, **kwargs)
            return jnp.where((jnp.arange(out.shape[0]) < sizes.sum())[:, None], out, jnp.nan)
        return matmul

    monkeypatch.setattr(kernels, "tokamax_ragged", emulated)
    x, experts, gates, *w = inputs("empty_group")

    def run(x, gates, *w):
        return windowed_experts(x, experts, gates, *w, impl="tokamax", groups=2, window=8)[0]

    np.testing.assert_allclose(run(x, gates, *w), reference(x, experts, gates, *w),
                               rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.grad(loss(run), argnums=range(5))(x, gates, *w)
    want = jax.grad(loss(lambda x, g, *w: reference(x, experts, g, *w)),
                    argnums=range(5))(x, gates, *w)
    for name, a, b in zip(["x", "gates", "w_gate", "w_up", "w_down"], got, want):
        assert np.isfinite(np.asarray(a)).all(), name
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
