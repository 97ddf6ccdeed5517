"""The routed experts' SwiGLU by a library grouped matmul, in bounded windows of copies.

Shape suffixes (europa_jax/__init__.py): R rows, U choices per row, M copies (one per row
and choice; sorted by expert), E this device's experts, G expert groups, D model width,
F expert width, W copies in one window.

A device holds `R` received rows, each with up to U choices of its local experts. The
copies are sorted by expert once; then the experts are visited in `groups` groups of
E/G experts (a `lax.scan`, each step slicing its group's matrices). A group's
copies are taken `window` at a time — normally one window, sized near the expected fill
(moe.expert_window_rows); a group that received more runs more windows (a loop with a
run-time trip count, so an overflow costs time, never correctness). A window gathers its
rows, runs the grouped SwiGLU on its experts (tokamax's kernel on GPU) and adds the
gate-weighted outputs into its rows. Nothing is sized by the worst case (every row
choosing the same experts) but the integer sort; no elementwise op touches a slot no
copy fills beyond the window's padding.

The backward pass is written out (custom VJP) for what autodiff of that loop would do
badly:
- each group's weights are laid out once in the orientation the kernel multiplies the
  output gradient by (`[E, F, D]` → `[E, D, F]` and back: the kernel's native
  `mk,ekn->mn`), not transposed again by every call;
- each expert's weight gradient is accumulated in float32 over *all* of the layer's
  copies — inside the kernel's accumulator and across a group's windows — and rounded to
  the weight's dtype once; it is written once per layer (the scan's stacked output), not
  read-modified-written per chunk in bf16;
- a window's hiddens are recomputed, not saved (the forward keeps only its inputs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from europa_jax.model import kernels

# tokamax's kernels tile rows in blocks of 64–128 (Mosaic GPU refuses other lengths):
# their windows are whole tiles. Other kernels' stay as asked (tests: so that they overflow).
WINDOW_MULTIPLE = 128
# out[g] = lhs[rows of g]ᵀ · rhs[rows of g]: a weight gradient per expert, rows ragged.
RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


@dataclasses.dataclass(frozen=True)
class Windows:
    """How the library path visits a device's experts: the kernel, expert groups per
    layer, copies per window."""

    impl: str
    groups: int
    window: int
    # whose kernels: taken while the forward is traced (the backward is traced after the
    # SPMD context that says it has been left)
    platform: str = dataclasses.field(default_factory=lambda: kernels.current_platform())

    def __post_init__(self):
        if self.impl.startswith("tokamax"):  # whole kernel tiles
            object.__setattr__(self, "window",
                               -(-self.window // WINDOW_MULTIPLE) * WINDOW_MULTIPLE)


def windowed_experts(x_RD, experts_RU, weights_RU, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                     impl: str, groups: int, window: int):
    """Σ_u weight·expert_u(row) for rows whose choices index these experts (−1: none).

    Returns the combined rows [R, D] in the rows' dtype (summed in float32) and the
    copies per expert [E] int32; differentiable (the custom VJP of the module docstring).
    `groups` must divide E; `window` is the copies per window.
    """
    plan = Windows(impl, groups, window)
    y_RD, sizes_E = _experts(x_RD, weights_RU.astype(jnp.float32), w_gate_EDF, w_up_EDF,
                             w_down_EFD, experts_RU, plan)
    return y_RD, jax.lax.stop_gradient(sizes_E)


def forward(x_RD, experts_RU, gates_RU, weights, plan: Windows):
    """(rows [R, D] in x's dtype, copies per expert [E], residuals for `backward`)."""
    order_M, sizes_E = _sort(experts_RU, weights[0].shape[0], plan.groups)
    y_RD = _forward(x_RD, gates_RU.reshape(-1), weights, order_M, sizes_E,
                    experts_RU.shape[1], plan)
    return y_RD, sizes_E, (x_RD, gates_RU, weights, order_M, sizes_E)


def backward(residuals, dy_RD, plan: Windows):
    """(d rows [R, D] in x's dtype, d gates [R, U] float32, d weights in their dtypes)."""
    x_RD, gates_RU, weights, order_M, sizes_E = residuals
    dx_RD, d_gates_M, dw = _backward(x_RD, gates_RU.reshape(-1), weights, order_M, sizes_E,
                                     dy_RD, gates_RU.shape[1], plan)
    return dx_RD, d_gates_M.reshape(gates_RU.shape), dw


def _sort(experts_RU, e: int, groups: int):
    """Copies in expert order (−1, "none", last) and the copies per expert."""
    if e % groups:
        raise ValueError(f"{groups} expert groups do not divide {e} experts")
    ids_M = jnp.where(experts_RU >= 0, experts_RU, e).reshape(-1)
    order_M = jnp.argsort(ids_M, stable=True).astype(jnp.int32)
    return order_M, jnp.bincount(ids_M, length=e + 1).astype(jnp.int32)[:e]


# ----------------------------------------------------------------------------- kernels


def matmul_kernel(impl: str, platform: str | None = None):
    """rows [W, K] × expert matrices [E, K, N] → [W, N], each row by its group's matrix.

    The rows past the groups are *undefined*: tokamax's Mosaic GPU kernel leaves them
    unwritten (whatever that memory held). Nothing reads them but what `past_groups_zeroed`
    cleans first: a window's output rows there are dropped by its scatter (their row index
    is the out-of-range "none"), and a kernel never reads a row outside its groups — except
    the weight-gradient kernel, which walks whole 128-row tiles and masks by multiplying
    (0·NaN = NaN; tests/test_gpu_interpreter.py). Zeroing every output instead cost a pass
    over each window's rows (0.56 TB of HBM per europa-952b step)."""
    if impl == "ragged_dot":
        return jax.lax.ragged_dot
    return kernels.tokamax_ragged(impl, platform=platform)  # exactly one implementation


def past_groups_zeroed(a_WX, sizes_E):
    """`a_WX` with its rows past the groups (those a grouped matmul leaves undefined) zero:
    for the weight-gradient kernel's operands. A `where` the producer's elementwise fusion
    takes in, not a pass of its own."""
    return jnp.where((jnp.arange(a_WX.shape[0]) < sizes_E.sum())[:, None], a_WX, 0)


def contract_kernel(impl: str, platform: str | None = None):
    """lhs [W, K] and rhs [W, N] with rows ragged by expert → Σ_rows lhsᵀ·rhs [E, K, N],
    accumulated and returned in float32."""
    if impl == "ragged_dot":
        fn = jax.lax.ragged_dot_general
    else:
        fn = kernels.tokamax_ragged(impl, general=True, platform=platform)
    return lambda lhs, rhs, sizes: fn(lhs, rhs, sizes, RAGGED_CONTRACTING,
                                      preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- windows


class _Window:
    """Window `w` of one group: which copies (sorted positions) and rows it holds, and how
    many of them each of the device's experts has (zero outside the group)."""

    def __init__(self, order_M, start, count, sizes_E, w, rows: int, u: int, r: int):
        m = order_M.shape[0]
        lo = w * rows  # within the group's run of sorted copies
        position_W = start + lo + jnp.arange(rows, dtype=jnp.int32)
        filled_W = jnp.arange(rows) < count - lo
        self.copy_W = jnp.where(filled_W, order_M.at[position_W].get(mode="fill",
                                                                     fill_value=m), m)
        self.row_W = jnp.where(filled_W, self.copy_W // u, r)  # r: none (dropped)
        end_E = jnp.cumsum(sizes_E)
        self.sizes_E = (jnp.clip(end_E, lo, lo + rows)
                        - jnp.clip(end_E - sizes_E, lo, lo + rows)).astype(jnp.int32)

    def gather(self, a_RX, fill=0):
        return a_RX.at[self.row_W].get(mode="fill", fill_value=fill)


def _group_runs(sizes_E, groups: int):
    """Per group: where its copies start in sorted order, how many, and the copies per
    expert with every other group's experts at zero ([G, E]): the layer's whole stack of
    matrices then serves each group's matmuls, the kernel skipping empty experts, instead
    of a copy of the group's slice per group (1.32 GB per group in europa-952b's forward)."""
    e = sizes_E.shape[0]
    start_E = jnp.cumsum(sizes_E) - sizes_E
    in_group_GE = jnp.arange(e)[None, :] // (e // groups) == jnp.arange(groups)[:, None]
    sizes_GE = jnp.where(in_group_GE, sizes_E[None, :], 0)
    return start_E[:: e // groups], sizes_GE.sum(axis=1), sizes_GE


def _n_windows(count, rows: int):
    return (count + rows - 1) // rows


def _swiglu_hidden(mm, x_WD, w_gate_EDF, w_up_EDF, sizes_E):
    """A window's (gate, up, hidden) of its SwiGLU; rows past the groups undefined
    (`matmul_kernel`)."""
    gate_WF, up_WF = mm(x_WD, w_gate_EDF, sizes_E), mm(x_WD, w_up_EDF, sizes_E)
    return gate_WF, up_WF, jax.nn.silu(gate_WF) * up_WF


def _group_slice(a_E, g, groups: int):
    """Group g's experts' part of a per-expert array (a slice: no stacked copy)."""
    eg = a_E.shape[0] // groups
    return jax.lax.dynamic_slice_in_dim(a_E, g * eg, eg, 0)


# ----------------------------------------------------------------------------- forward, backward


def _forward(x_RD, gates_M, weights, order_M, sizes_E, u: int, plan: Windows):
    r, dt = x_RD.shape[0], x_RD.dtype
    mm, rows = matmul_kernel(plan.impl, plan.platform), plan.window
    start_G, count_G, sizes_GE = _group_runs(sizes_E, plan.groups)
    mats = tuple(w.astype(dt) for w in weights)

    def add_window(w, y_RD, start, count, sizes):
        win = _Window(order_M, start, count, sizes, w, rows, u, r)
        _, _, hidden_WF = _swiglu_hidden(mm, win.gather(x_RD), *mats[:2], win.sizes_E)
        out_WD = mm(hidden_WF, mats[2], win.sizes_E)
        gate_W = gates_M.at[win.copy_W].get(mode="fill", fill_value=0.0)
        # rows past the groups (undefined) go to row r: dropped
        return y_RD.at[win.row_W].add(out_WD.astype(jnp.float32) * gate_W[:, None],
                                      mode="drop")

    def group(y_RD, xs):
        _, start, count, sizes = xs
        # window 0 always runs; a group that received more copies loops over the rest
        y_RD = add_window(0, y_RD, start, count, sizes)
        return jax.lax.fori_loop(1, _n_windows(count, rows), lambda w, y: add_window(
            w, y, start, count, sizes), y_RD), None

    y_RD, _ = jax.lax.scan(group, jnp.zeros((r, weights[2].shape[-1]), jnp.float32),
                           (jnp.arange(plan.groups), start_G, count_G, sizes_GE))
    # summed in float32, rounded once: the caller sends the rows back in the wire dtype
    return y_RD.astype(dt)


def _backward(x_RD, gates_M, weights, order_M, sizes_E, dy_RD, u: int, plan: Windows):
    r, dt = x_RD.shape[0], x_RD.dtype
    mm, rows = matmul_kernel(plan.impl, plan.platform), plan.window
    contract = contract_kernel(plan.impl, plan.platform)
    start_G, count_G, sizes_GE = _group_runs(sizes_E, plan.groups)
    w_dtypes = tuple(w.dtype for w in weights)
    w_gate, w_up, w_down = (w.astype(dt) for w in weights)

    def window_grads(win, g, w_gate_t, w_up_t, w_down_t, d_gates_M):
        """One window: its rows' input gradients, its gates' gradients, and its part of
        its group's weight gradients (float32). Rows past the groups are undefined in
        every matmul output (`matmul_kernel`): dropped by the scatters, zeroed where the
        weight-gradient kernel reads them.

        The copy's output is not recomputed: its gate's gradient out·dy equals
        hidden·(dy·w_downᵀ), and dy·w_downᵀ is the hidden's gradient before the gate
        weighs it: eleven grouped matmuls per window, forward and backward, not twelve,
        and no [W, D] output or weighted dy written."""
        x_WD = win.gather(x_RD)
        gate_WF, up_WF, hidden_WF = _swiglu_hidden(mm, x_WD, w_gate, w_up, win.sizes_E)
        sizes_e = _group_slice(win.sizes_E, g, plan.groups)  # the group's experts
        dy_WD = win.gather(dy_RD)  # zero past the groups: the gather fills 0 there
        gate_W = gates_M.at[win.copy_W].get(mode="fill", fill_value=0.0)
        d_hidden_unweighted_WF = mm(dy_WD, w_down_t, sizes_e).astype(jnp.float32)
        gate32_WF = gate_WF.astype(jnp.float32)
        sig_WF = jax.nn.sigmoid(gate32_WF)
        hidden32_WF = hidden_WF.astype(jnp.float32)
        d_gates_M = d_gates_M.at[win.copy_W].set(
            jnp.sum(hidden32_WF * d_hidden_unweighted_WF, axis=-1), mode="drop")
        d_hidden_WF = d_hidden_unweighted_WF * gate_W[:, None]
        d_up_WF = past_groups_zeroed((d_hidden_WF * gate32_WF * sig_WF).astype(dt), sizes_e)
        d_gate_WF = past_groups_zeroed((d_hidden_WF * up_WF.astype(jnp.float32) * sig_WF
                                        * (1 + gate32_WF * (1 - sig_WF))).astype(dt),
                                       sizes_e)  # silu'
        dx_WD = (mm(d_gate_WF, w_gate_t, sizes_e).astype(jnp.float32)
                 + mm(d_up_WF, w_up_t, sizes_e).astype(jnp.float32)).astype(dt)
        # Σ (gate·hidden)ᵀ·dy = Σ hiddenᵀ·(gate·dy): the gate weighs the narrower operand
        weighted_hidden_WF = past_groups_zeroed((hidden32_WF * gate_W[:, None]).astype(dt),
                                                sizes_e)
        dw = (contract(x_WD, d_gate_WF, sizes_e), contract(x_WD, d_up_WF, sizes_e),
              contract(weighted_hidden_WF, dy_WD, sizes_e))
        return dx_WD, d_gates_M, dw

    def group(carry, xs):
        dx_RD, d_gates_M = carry
        g, start, count, sizes = xs
        # the group's matrices laid out once, in the orientation the kernel multiplies
        # by: [E, D, F]ᵀ → [E, F, D] and [E, F, D]ᵀ (the group's share of the layer's)
        mats_t = tuple(jnp.swapaxes(_group_slice(w, g, plan.groups), 1, 2)
                       for w in (w_gate, w_up, w_down))

        def add_window(w, carry):
            dx_RD, d_gates_M, dw = carry
            win = _Window(order_M, start, count, sizes, w, rows, u, r)
            dx_WD, d_gates_M, dw_w = window_grads(win, g, *mats_t, d_gates_M)
            return (dx_RD.at[win.row_W].add(dx_WD, mode="drop"), d_gates_M,
                    tuple(a + b for a, b in zip(dw, dw_w)))

        # window 0 writes the weight gradients (no zeros to add into); a group that
        # received more copies adds its further windows' in float32
        win = _Window(order_M, start, count, sizes, 0, rows, u, r)
        dx_WD, d_gates_M, dw = window_grads(win, g, *mats_t, d_gates_M)
        dx_RD = dx_RD.at[win.row_W].add(dx_WD, mode="drop")
        dx_RD, d_gates_M, dw = jax.lax.fori_loop(1, _n_windows(count, rows), add_window,
                                                 (dx_RD, d_gates_M, dw))
        # rounded to the weights' dtype once, here (the scan stacks the groups' slices)
        return (dx_RD, d_gates_M), tuple(g.astype(d) for g, d in zip(dw, w_dtypes))

    # a row's gradient sums its ≤ U copies' in the rows' dtype, as autodiff's transpose of
    # the gather would; each copy's own is a float32 kernel accumulation
    (dx_RD, d_gates_M), dw_G = jax.lax.scan(
        group, (jnp.zeros(x_RD.shape, dt), jnp.zeros(gates_M.shape, jnp.float32)),
        (jnp.arange(plan.groups), start_G, count_G, sizes_GE))
    dw = tuple(g.reshape(w.shape) for g, w in zip(dw_G, weights))
    return dx_RD, d_gates_M, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _experts(x_RD, gates_RU, w_gate_EDF, w_up_EDF, w_down_EFD, experts_RU, plan):
    y_RD, sizes_E, _ = forward(x_RD, experts_RU, gates_RU, (w_gate_EDF, w_up_EDF, w_down_EFD),
                               plan)
    return y_RD, sizes_E


def _experts_fwd(x_RD, gates_RU, w_gate_EDF, w_up_EDF, w_down_EFD, experts_RU, plan):
    y_RD, sizes_E, residuals = forward(x_RD, experts_RU, gates_RU,
                                       (w_gate_EDF, w_up_EDF, w_down_EFD), plan)
    return (y_RD, sizes_E), residuals


def _experts_bwd(plan, residuals, cotangents):
    dx_RD, d_gates_RU, dw = backward(residuals, cotangents[0], plan)
    return (dx_RD, d_gates_RU, *dw, None)


_experts.defvjp(_experts_fwd, _experts_bwd)
