"""tokamax's GPU kernels, called the way our code calls them, run on CPU in JAX's Pallas
Mosaic GPU interpreter: the grouped matmul against `jax.lax.ragged_dot`, and the windowed
experts (values and gradients) built on it against the per-row reference.

How the interpreter is enabled (jax 0.12.0.1, tokamax 0.0.17), all while tracing:
- `jax.experimental.pallas.mosaic_gpu.force_gpu_interpret_mode(InterpretGPUParams(...))`:
  every Mosaic GPU `pallas_call`/`plgpu.kernel` traced under it is interpreted on CPU,
  its threads and shared memory simulated, memory nobody wrote reading NaN;
- `tokamax.config.cross_compile(True)`: tokamax skips its has-a-GPU checks;
- `jax.extend.backend.get_default_device` faked to an sm90 GPU: tokamax reads the default
  device for which kernel to build (`"NVIDIA" in device_kind` picks Mosaic GPU over
  Mosaic TPU; `compute_capability` 9.0 picks the Hopper kernels). jax itself never calls
  the `jax.extend` alias, so only tokamax sees the fake.
Our code then picks the Mosaic kernels from an explicit `platform="gpu"`.

What the interpreter of jax 0.12.0.1 cannot run is probed once (module scope) and its
tests skip with the kernel and the one-line error. Where the grouped matmul's backward
needs tokamax's weight-gradient kernel and that one cannot run, a jnp stand-in with its
exact masking contract takes its place (`mosaic_contract_stand_in`), so that the rows the
forward kernel leaves unwritten would still reach the gradients as they would on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import re
from unittest import mock

import jax
import jax.extend.backend
import jax.numpy as jnp
import numpy as np
import pytest

tokamax = pytest.importorskip("tokamax")
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from europa_jax.model.experts import expert_windows  # noqa: E402
from europa_jax.model import kernels
from test_expert_windows import reference  # noqa: E402 - the per-row float32 reference

# Uninitialized memory reads NaN: the stand-in for whatever a GPU's unwritten rows hold.
PARAMS = plgpu.InterpretGPUParams(uninitialized_memory="nan")
# tokamax's flash attention syncs its warpgroups with inline PTX named barriers; jax's
# interpreter models exactly those under this (private) mode, and errors on them otherwise.
ATTENTION_PARAMS = plgpu.InterpretGPUParams(uninitialized_memory="nan",
                                            inline_mgpu="_hack_model_inline_mgpu_tokamax")
# tokamax 0.0.17's sm90 heuristics tile the contracted (row) dimension of its
# weight-gradient kernel in blocks of 128 (= expert_windows.WINDOW_MULTIPLE).
CONTRACT_BLOCK_K = 128


class _SM90:
    """What tokamax reads of the default device: a GH200."""

    platform = "gpu"
    device_kind = "NVIDIA GH200 480GB"
    compute_capability = "9.0"
    core_count = 132
    id = 0


@contextlib.contextmanager
def mosaic_interpreter(params=PARAMS):
    """tokamax's Mosaic GPU kernels, traced inside, run on CPU in the interpreter."""
    with (mock.patch.object(jax.extend.backend, "get_default_device", lambda: _SM90()),
          tokamax.config.cross_compile(True), plgpu.force_gpu_interpret_mode(params)):
        yield


def _reset_interpreter():
    # After an exception inside an interpreted kernel jax asks for its shared state to be
    # reset before the next one; the reset is not exported (jax._src only).
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def one_line(err: BaseException) -> str:
    """The innermost `SomethingError: message` line (a callback's error comes back as a
    JaxRuntimeError holding the kernel thread's whole traceback)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    line = errors[-1] if errors else f"{type(err).__name__}: {lines[0] if lines else ''}"
    line = re.sub(r"<(?:[\w.]+\.)?(\w+) object at 0x[0-9a-f]+>", r"\1", line)
    # a set's order changes from run to run
    return re.sub(r"\{([^{}]*)\}", lambda m: "{%s}" % ", ".join(sorted(m[1].split(", "))), line)


# ----------------------------------------------------------------------------- probes

RAGGED_CONTRACTING = expert_windows.RAGGED_CONTRACTING


def _probe_ragged_dot():
    x_MK, w_EKN = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16)
    return jax.jit(lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation="mosaic"))(
        x_MK, w_EKN, jnp.array([30, 50], jnp.int32))


def _probe_contract():
    lhs_MK, rhs_MN = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16)
    return jax.jit(lambda a, b, s: tokamax.ragged_dot_general(
        a, b, s, RAGGED_CONTRACTING, preferred_element_type=jnp.float32,
        implementation="mosaic"))(lhs_MK, rhs_MN, jnp.array([30, 50], jnp.int32))


def _probe_triton():
    x_MK, w_EKN = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16)
    return jax.jit(lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation="triton"))(
        x_MK, w_EKN, jnp.array([30, 50], jnp.int32))


def _probe_attention():
    q_BSHK = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    return jax.jit(lambda q: tokamax.dot_product_attention(
        q, q, q, is_causal=True, implementation="mosaic"))(q_BSHK)


# What stopped each on jax 0.12.0.1 (the probes, not these notes, decide what skips):
KERNELS = {
    "mosaic ragged_dot (sm90 ragged_dot_kernel)": (_probe_ragged_dot, PARAMS),
    # its wgmma takes the A operand from registers (`lhs_smem[...] * mask`); the
    # interpreter's wgmma reads A from shared memory only ("Expected shape (6,)": a
    # (64, 128) value where it expects an allocation key)
    "mosaic ragged_dot_general, ragged contracting (sm90 ragged_contracting_dim_dot_kernel)":
        (_probe_contract, PARAMS),
    # a triton.jit kernel called through jax_triton, not a Pallas one: no `interpret=`
    # reaches it, and jax_triton registers its lowering for GPU platforms only
    "triton ragged_dot (jax_triton triton_call)": (_probe_triton, PARAMS),
    # `pl.run_state` over a WGMMA accumulator (compute_pv) has no interpreter rule (a TODO
    # in jaxpr_interpret.py): its wgmma/barrier_wait reach XLA:CPU uninterpreted, hence
    # "Cannot lower jaxpr with effects"; that wgmma also takes A (p) from registers
    "mosaic flash attention forward (sm90 flash_attention_kernel)":
        (_probe_attention, ATTENTION_PARAMS),
}
FORWARD, CONTRACT, TRITON, ATTENTION = KERNELS


@pytest.fixture(scope="module")
def interpretable():
    """Per kernel: None where the interpreter runs it, else the one-line error."""
    return _probe_all()


@functools.cache
def _probe_all():
    result = {}
    for name, (probe, params) in KERNELS.items():
        try:
            with mosaic_interpreter(params):
                jax.block_until_ready(probe())
            result[name] = None
        except Exception as err:  # noqa: BLE001 - any failure is the probe's answer
            _reset_interpreter()
            result[name] = one_line(err)
    return result


def require(interpretable, kernel: str):
    if interpretable[kernel] is not None:
        pytest.skip(f"{kernel} does not run in the Pallas GPU interpreter of jax "
                    f"{jax.__version__}: {interpretable[kernel]}")


# ----------------------------------------------------------------------------- the grouped matmul


def _grouped_inputs(m, k, n, sizes, seed=0):
    rng = np.random.default_rng(seed)
    x_MK = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w_EKN = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), jnp.bfloat16)
    return x_MK, w_EKN, jnp.asarray(sizes, jnp.int32)


# empty groups first, in the middle and last; sizes off the 64-row tiles; rows past them
SIZES_E = [0, 70, 0, 93, 5, 0]


@pytest.mark.parametrize("k", [64, 256])
def test_mosaic_grouped_matmul_equals_ragged_dot_and_leaves_rows_past_the_groups(
        interpretable, k):
    """Our call of tokamax's Mosaic GPU grouped matmul, interpreted: on the groups' rows
    `jax.lax.ragged_dot`'s bf16 product to one bf16 ulp (both round a float32 sum once;
    the order of the sums differs: within one 128-wide K tile and across two); the rows
    past the groups the kernel never writes (NaN here): `matmul_kernel` leaves them so
    (a pass less over every window) and `past_groups_zeroed` zeroes them for the
    weight-gradient kernel."""
    require(interpretable, FORWARD)
    x_MK, w_EKN, sizes_E = _grouped_inputs(256, k, 128, SIZES_E)
    total = sum(SIZES_E)
    with mosaic_interpreter():
        out_MN = jax.jit(kernels.tokamax_ragged("tokamax", platform="gpu"))(x_MK, w_EKN, sizes_E)
        ours_MN = jax.jit(expert_windows.matmul_kernel("tokamax", "gpu"))(x_MK, w_EKN, sizes_E)
    zeroed_MN = expert_windows.past_groups_zeroed(ours_MN, sizes_E)
    assert out_MN.dtype == jnp.bfloat16
    got_MN = np.asarray(out_MN, np.float32)
    want_MN = np.asarray(jax.lax.ragged_dot(x_MK, w_EKN, sizes_E), np.float32)
    np.testing.assert_allclose(got_MN[:total], want_MN[:total], rtol=2**-7, atol=1e-5)
    assert np.isnan(got_MN[total:]).all(), "the kernel wrote the rows past the groups"
    np.testing.assert_array_equal(np.asarray(ours_MN, np.float32), got_MN)  # NaN equal NaN
    zeroed_MN = np.asarray(zeroed_MN, np.float32)
    np.testing.assert_array_equal(zeroed_MN[:total], got_MN[:total])
    np.testing.assert_array_equal(zeroed_MN[total:], 0)


def test_mosaic_grouped_matmul_of_float32_operands_is_the_bf16_product(interpretable):
    """float32 operands (the Mosaic kernel takes bf16 only) are multiplied in bf16 by our
    call and come back float32."""
    require(interpretable, FORWARD)
    x_MK, w_EKN, sizes_E = _grouped_inputs(128, 64, 64, [40, 0, 50])
    with mosaic_interpreter():
        out_MN = jax.jit(expert_windows.matmul_kernel("tokamax", "gpu"))(
            x_MK.astype(jnp.float32), w_EKN.astype(jnp.float32), sizes_E)
    assert out_MN.dtype == jnp.float32
    want_MN = jax.lax.ragged_dot(x_MK, w_EKN, sizes_E).astype(jnp.float32)
    np.testing.assert_array_equal(out_MN[:90], want_MN[:90])  # the groups' rows


# ----------------------------------------------------------------------------- stand-in


def mosaic_contract_stand_in(lhs_MK, rhs_MN, sizes_E):
    """tokamax 0.0.17's sm90 ragged-contracting kernel (out[e] = Σ_rows of e lhsᵀ·rhs) in
    jnp, with its contract on rows outside a group: it walks only the CONTRACT_BLOCK_K-row
    tiles the group's rows touch, multiplies lhs by the group's row mask (0·NaN = NaN) and
    rhs by nothing. So a NaN row past the groups, inside the last group's tile, reaches
    that group's sum — as on a GPU — where XLA's ragged_dot_general skips it."""
    f32 = jnp.float32
    row_M = jnp.arange(lhs_MK.shape[0])
    end_E = jnp.cumsum(sizes_E)
    start_E = end_E - sizes_E
    tile_M = row_M // CONTRACT_BLOCK_K
    walked_EM = ((tile_M >= (start_E // CONTRACT_BLOCK_K)[:, None])
                 & (tile_M < (-(-end_E // CONTRACT_BLOCK_K))[:, None]))
    in_group_EM = (row_M >= start_E[:, None]) & (row_M < end_E[:, None])
    lhs_EMK = jnp.where(walked_EM[..., None],
                        lhs_MK.astype(f32) * in_group_EM[..., None].astype(f32), 0)
    rhs_EMN = jnp.where(walked_EM[..., None], rhs_MN.astype(f32), 0)
    return jnp.einsum("emk,emn->ekn", lhs_EMK, rhs_EMN)


def test_the_stand_in_sums_like_ragged_dot_general_and_passes_nan_like_the_kernel():
    """The stand-in's sums are `jax.lax.ragged_dot_general`'s; a NaN row past the groups
    poisons exactly the group whose last tile holds it (XLA's skips it)."""
    x_MK, _, sizes_E = _grouped_inputs(256, 64, 64, SIZES_E)
    dy_MN = jnp.asarray(np.random.default_rng(1).normal(size=(256, 64)), jnp.bfloat16)
    want_EKN = jax.lax.ragged_dot_general(x_MK, dy_MN, sizes_E, RAGGED_CONTRACTING,
                                          preferred_element_type=jnp.float32)
    np.testing.assert_allclose(mosaic_contract_stand_in(x_MK, dy_MN, sizes_E), want_EKN,
                               rtol=1e-6, atol=1e-5)
    # rows 168..255 (past the groups) lie in tile 1 (rows 128..255), which expert 3 (rows
    # 70..162) and 4 (163..167) end in, and which the empty expert 5 walks too (the kernel
    # walks tiles start // 128 to ceil(end / 128): one for an empty group starting
    # mid-tile); the empty experts 0 (start 0: none) and 2 (tile 0) stay finite
    poisoned_MN = dy_MN.at[sum(SIZES_E):].set(jnp.nan)
    finite_E = np.isfinite(mosaic_contract_stand_in(x_MK, poisoned_MN, sizes_E)).all((1, 2))
    np.testing.assert_array_equal(finite_E, [True, True, True, False, False, False])
    assert np.isfinite(jax.lax.ragged_dot_general(x_MK, poisoned_MN, sizes_E,
                                                  RAGGED_CONTRACTING)).all()


@contextlib.contextmanager
def mosaic_contract(interpretable):
    """tokamax's Mosaic weight-gradient kernel where the interpreter runs it, else the
    stand-in in its place (behind our own call site, kernels.tokamax_ragged, whose bf16
    casts stay under test)."""
    if interpretable[CONTRACT] is None:
        yield "interpreted"
        return
    real = tokamax.ragged_dot_general

    def general(lhs, rhs, sizes, dims, *, implementation, preferred_element_type=None,
                **kwargs):
        if implementation != "mosaic" or dims != RAGGED_CONTRACTING:
            return real(lhs, rhs, sizes, dims, implementation=implementation,
                        preferred_element_type=preferred_element_type, **kwargs)
        assert {lhs.dtype, rhs.dtype} <= {jnp.dtype(jnp.bfloat16)}, "the kernel takes bf16"
        return mosaic_contract_stand_in(lhs, rhs, sizes).astype(
            preferred_element_type or lhs.dtype)

    with mock.patch.object(tokamax, "ragged_dot_general", general):
        yield "stand-in"


# ----------------------------------------------------------------------------- windows

R, U, D, F, E = 100, 2, 64, 128, 4


def _window_inputs(assignment: str, seed=0):
    """bf16 rows and weights; choices per `assignment`; some rows with fewer, one none."""
    rng = np.random.default_rng(seed)
    experts_RU = rng.integers(0, E, size=(R, U))
    if assignment == "empty_experts":  # experts 0 and 2 (first of each group) get nothing
        experts_RU = rng.choice([1, 3], size=(R, U))
    if assignment == "empty_group":  # group 0 (experts 0, 1) gets nothing
        experts_RU = rng.integers(2, E, size=(R, U))
    if assignment == "all_to_one":  # every copy to expert 2: its windows overflow
        experts_RU[:] = 2
    experts_RU[::9, 1:] = -1
    experts_RU[5] = -1
    x_RD = jnp.asarray(rng.normal(size=(R, D)), jnp.bfloat16)
    gates_RU = jnp.asarray(rng.uniform(0.1, 1.0, size=(R, U)), jnp.float32)
    w_gate_EDF, w_up_EDF = (jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), jnp.bfloat16)
                            for _ in range(2))
    w_down_EFD = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.bfloat16)
    return x_RD, jnp.asarray(experts_RU, jnp.int32), gates_RU, w_gate_EDF, w_up_EDF, w_down_EFD


def windows(platform: str, groups: int, window: int):
    """The experts in windows on `platform`'s kernels. (`windowed_experts` takes the
    platform from the trace's context; the plan names it here.)"""
    plan = expert_windows.Windows("tokamax", groups, window, platform=platform)

    def run(x_RD, experts_RU, gates_RU, *w):
        return expert_windows._experts(x_RD, gates_RU, *w, experts_RU, plan)[0]

    return run


# (assignment, groups, window): window 128 = one kernel tile of rows (WINDOW_MULTIPLE)
CASES = [
    ("empty_experts", 2, 128),  # an empty expert leading each group
    ("empty_group", 2, 128),  # group 0's window runs with every size 0; group 1 overflows
    ("random", 1, 128),  # ~180 copies in one group: a second window, experts straddling
    ("all_to_one", 2, 128),  # ~180 copies to one expert: its group overflows, the other empty
]


def _copies_per_group(experts_RU, groups):
    counts_E = np.bincount(np.asarray(experts_RU)[np.asarray(experts_RU) >= 0], minlength=E)
    return counts_E.reshape(groups, -1).sum(1)


@pytest.mark.parametrize("assignment,groups,window", CASES)
def test_windows_on_the_interpreted_mosaic_matmul_equal_the_reference(
        interpretable, assignment, groups, window):
    """The windowed SwiGLU on the interpreted Mosaic kernel: the rows of the same windows
    on tokamax's XLA kernel (bf16 at the same points: to a bf16 rounding), and of the
    float32 per-row reference (to bf16 accuracy)."""
    require(interpretable, FORWARD)
    x_RD, experts_RU, gates_RU, *w = _window_inputs(assignment)
    if assignment != "empty_experts":  # the case overflows into a second window
        assert _copies_per_group(experts_RU, groups).max() > window
    with mosaic_interpreter():
        y_RD = jax.jit(windows("gpu", groups, window))(x_RD, experts_RU, gates_RU, *w)
    y_xla_RD = jax.jit(windows("cpu", groups, window))(x_RD, experts_RU, gates_RU, *w)
    want_RD = reference(x_RD, experts_RU, gates_RU, *w)
    assert y_RD.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y_RD, np.float32)).all()
    scale = float(jnp.abs(want_RD).max())
    np.testing.assert_allclose(np.asarray(y_RD, np.float32), np.asarray(y_xla_RD, np.float32),
                               rtol=2**-7, atol=2**-7 * scale)
    np.testing.assert_allclose(np.asarray(y_RD, np.float32), want_RD,
                               rtol=3e-2, atol=2e-2 * scale)


def _grads(run, x_RD, experts_RU, gates_RU, *w):
    loss = lambda x, g, *w: jnp.sum(jnp.sin(run(x, experts_RU, g, *w).astype(jnp.float32)))
    return jax.jit(jax.grad(loss, argnums=range(5)))(x_RD, gates_RU, *w)


GRAD_NAMES = ["x", "gates", "w_gate", "w_up", "w_down"]


@pytest.mark.slow
@pytest.mark.parametrize("assignment,groups,window", CASES)
def test_window_gradients_on_the_interpreted_mosaic_kernels_equal_the_reference(
        interpretable, assignment, groups, window):
    """The custom VJP on the interpreted Mosaic grouped matmul (forward, recomputed
    forward, input gradients) and tokamax's Mosaic weight-gradient kernel (the stand-in
    where the interpreter cannot run it): every gradient finite — the rows the forward
    kernel leaves unwritten reach no kernel — and the float32 reference's to bf16
    accuracy."""
    require(interpretable, FORWARD)
    x_RD, experts_RU, gates_RU, *w = _window_inputs(assignment)
    with mosaic_interpreter(), mosaic_contract(interpretable):
        got = _grads(windows("gpu", groups, window), x_RD, experts_RU, gates_RU, *w)
    want = _grads(lambda x, e, g, *w: reference(x, e, g, *w), x_RD, experts_RU, gates_RU, *w)
    for name, a, b in zip(GRAD_NAMES, got, want):
        a = np.asarray(a, np.float32)
        not_finite = int((~np.isfinite(a)).sum())
        assert not not_finite, f"d {name}: {not_finite} of {a.size} not finite"
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=2e-2 * scale, err_msg=name)


@pytest.mark.slow
def test_unwritten_rows_would_reach_the_weight_gradients_without_the_zeroing(
        interpretable, monkeypatch):
    """Why the weight-gradient kernel's operands are `past_groups_zeroed`, and that the
    gradient test above would see it if they were not: without it, the rows tokamax's
    Mosaic matmul leaves unwritten reach the weight gradients (through the
    weight-gradient kernel's last tile of each window), never the input or gate
    gradients."""
    require(interpretable, FORWARD)
    monkeypatch.setattr(expert_windows, "past_groups_zeroed", lambda a, sizes: a)
    x_RD, experts_RU, gates_RU, *w = _window_inputs("random")
    with mosaic_interpreter(), mosaic_contract(interpretable):
        got = _grads(windows("gpu", 2, 128), x_RD, experts_RU, gates_RU, *w)
    finite = {name: bool(np.isfinite(np.asarray(a, np.float32)).all())
              for name, a in zip(GRAD_NAMES, got)}
    assert finite == {"x": True, "gates": True, "w_gate": False, "w_up": False,
                      "w_down": False}, finite


# ----------------------------------------------------------------------------- the others


def test_mosaic_weight_gradient_kernel_in_the_interpreter(interpretable):
    """tokamax's Mosaic ragged-contracting kernel (our weight gradient), interpreted:
    `jax.lax.ragged_dot_general`'s float32 sums, and the stand-in's, NaN rows past the
    groups included."""
    require(interpretable, CONTRACT)
    x_MK, _, sizes_E = _grouped_inputs(256, 128, 64, SIZES_E)
    dy_MN = jnp.asarray(np.random.default_rng(1).normal(size=(256, 64)), jnp.bfloat16)
    with mosaic_interpreter():
        got_EKN = jax.jit(expert_windows.contract_kernel("tokamax", "gpu"))(x_MK, dy_MN, sizes_E)
    want_EKN = jax.lax.ragged_dot_general(x_MK, dy_MN, sizes_E, RAGGED_CONTRACTING,
                                          preferred_element_type=jnp.float32)
    np.testing.assert_allclose(got_EKN, want_EKN, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got_EKN, mosaic_contract_stand_in(x_MK, dy_MN, sizes_E),
                               rtol=1e-5, atol=1e-4)
    # the stand-in's contract on rows past the groups is the kernel's
    poisoned_MN = dy_MN.at[sum(SIZES_E):].set(jnp.nan)
    with mosaic_interpreter():
        got_EKN = jax.jit(expert_windows.contract_kernel("tokamax", "gpu"))(
            x_MK, poisoned_MN, sizes_E)
    np.testing.assert_array_equal(
        np.isfinite(got_EKN).all((1, 2)),
        np.isfinite(mosaic_contract_stand_in(x_MK, poisoned_MN, sizes_E)).all((1, 2)))


def test_triton_grouped_matmul_in_the_interpreter(interpretable):
    """tokamax's Triton grouped matmul (`tokamax_triton`), where it can run on CPU."""
    require(interpretable, TRITON)
    x_MK, w_EKN, sizes_E = _grouped_inputs(256, 128, 128, SIZES_E)
    with mosaic_interpreter():
        out_MN = jax.jit(expert_windows.matmul_kernel("tokamax_triton", "gpu"))(
            x_MK, w_EKN, sizes_E)
    want_MN = jax.lax.ragged_dot(x_MK, w_EKN, sizes_E, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out_MN, np.float32), want_MN, rtol=2**-8,
                               atol=2**-8)


def test_mosaic_flash_attention_in_the_interpreter(interpretable):
    """tokamax's sm90 flash attention, interpreted: `jax.nn.dot_product_attention`'s."""
    require(interpretable, ATTENTION)
    rng = np.random.default_rng(0)
    q_BSHK, k_BSHK, v_BSHK = (jnp.asarray(rng.normal(size=(1, 256, 2, 64)), jnp.bfloat16)
                              for _ in range(3))
    with mosaic_interpreter(ATTENTION_PARAMS):
        out = jax.jit(lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=True, implementation="mosaic"))(q_BSHK, k_BSHK, v_BSHK)
    want = jax.nn.dot_product_attention(q_BSHK, k_BSHK, v_BSHK, is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)
