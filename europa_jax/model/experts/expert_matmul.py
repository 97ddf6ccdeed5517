"""The routed experts' SwiGLU on one device: every row multiplied by its own experts only.

Shape suffixes (europa_jax/__init__.py): R rows, U choices per row, M rows sorted by
expert (one per row and choice), E this device's experts, D model width, F expert width,
X blocks, Y rows per block.

Two ways in: `compute_local_experts` takes rows with up to U local choices each (tokens on
one device, or what the expert-axis peers sent) and returns each row's weighted sum of its
experts' outputs — by the blocked loop below, or by a library kernel in bounded windows
of copies with a written-out backward (expert_windows.py); `grouped_swiglu` takes rows
already sorted by expert with the group sizes (tests and benchmarks compare kernels on
it). The kernels (`execution.grouped_matmul`):

- `tokamax`: tokamax's grouped matmul — on a GPU its Pallas Mosaic GPU kernel (bf16
  inputs: float32 ones are cast, accumulation float32), each row multiplied by its own
  expert's matrix only; elsewhere tokamax's XLA reference. The GPU default. Each call names
  its implementation (kernels.tokamax_grouped_matmul): tokamax's own order would pass
  silently to XLA's dense matmul. `tokamax_triton`: the Triton kernel (needs jax_triton).
- `ragged_dot`: `jax.lax.ragged_dot`. jaxlib 0.10.2 and 0.12.0.1 compile it, on GPU as on
  CPU, to a dense masked matmul over *all* experts (E× the FLOPs and an [E, M, ·] buffer).
- `blocked` (XLA:CPU): each expert's copies are padded to whole blocks of `block_rows`,
  so every block belongs to one expert (`BlockLayout`); a loop visits only the blocks
  that hold copies (a run-time trip count: the static bound is the worst case, the work
  is not), gathers their rows, applies the expert's whole SwiGLU and adds the gate-
  weighted outputs into their rows (`blocked_experts`). Exact; no buffer is sized by
  the worst-case number of copies except integer indices. Its backward (a custom VJP)
  recomputes each block and adds its weight gradient into its expert's slice in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from europa_jax.model.experts import expert_windows
from europa_jax.model.fp8 import fp8_linear
from europa_jax.model import kernels
from europa_jax.model.experts.expert_windows import Windows, windowed_experts

BLOCK_ROWS = 256


def compute_local_experts(x_RD, experts_RU, weights_RU, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                          impl: str, block_rows: int = BLOCK_ROWS, groups: int = 1,
                          window: int | None = None, fp8: str = "none"):
    """Σ_u weight·expert_u(row) for rows whose choices index *these* experts (−1 = none),
    differentiable.

    Returns the combined rows [R, D] (float32 for `blocked`, the rows' dtype for the
    library kernels, summed in float32) and the copies per expert [E]. `blocked` works
    from integer index arithmetic only: which row and which copy fill each block's slots
    (`BlockLayout`). The library kernels visit the experts `groups` at a time in windows
    of `window` copies (expert_windows.py; default: one window of every copy). `fp8`:
    `execution.fp8_expert_gemms` (the blocked kernel only).
    """
    r, u = experts_RU.shape
    if impl != "blocked":
        return windowed_experts(x_RD, experts_RU, weights_RU, w_gate_EDF, w_up_EDF, w_down_EFD,
                                impl=impl, groups=groups, window=window or r * u)
    layout = _blocked_layout(experts_RU, w_gate_EDF.shape[0], block_rows)
    y_RD = blocked_experts(x_RD, weights_RU.reshape(-1), w_gate_EDF, w_up_EDF, w_down_EFD,
                           *layout[1:], fp8)
    return y_RD, layout[0]


@dataclasses.dataclass(frozen=True)
class LocalExperts:
    """How one device's experts run (static): `blocked` with its block rows, or a library
    kernel in windows (expert_windows.Windows)."""

    impl: str
    block_rows: int = BLOCK_ROWS
    windows: Windows | None = None
    fp8: str = "none"  # `execution.fp8_expert_gemms` (the blocked kernel only)


def local_forward(x_RD, experts_RU, gates_RU, weights, how: LocalExperts):
    """The experts' forward without autodiff: (rows [R, D], copies per expert [E],
    residuals for `local_backward`). For callers that write their own backward pass
    (moe_dispatch.py); `compute_local_experts` is the same computation, differentiable."""
    if how.impl != "blocked":
        return expert_windows.forward(x_RD, experts_RU, gates_RU, weights, how.windows)
    sizes_E, *layout = _blocked_layout(experts_RU, weights[0].shape[0], how.block_rows)
    y_RD, residuals = _blocked_experts_fwd(x_RD, gates_RU.reshape(-1), *weights, *layout,
                                           how.fp8)
    return y_RD, sizes_E, residuals


def local_backward(residuals, dy_RD, gates_shape, how: LocalExperts):
    """(d rows [R, D], d gates float32 `gates_shape`, d weights) of `local_forward`."""
    if how.impl != "blocked":
        return expert_windows.backward(residuals, dy_RD, how.windows)
    dx_RD, d_gates_M, *dw = _blocked_experts_bwd(residuals, dy_RD.astype(jnp.float32),
                                                 how.fp8)[:5]
    return dx_RD, d_gates_M.astype(jnp.float32).reshape(gates_shape), tuple(dw)


def _blocked_layout(experts_RU, e: int, block_rows: int):
    """(copies per expert, then blocked_experts' slot maps: row and copy of each slot,
    each block's expert, the blocks in use)."""
    r, u = experts_RU.shape
    ids_M = jnp.where(experts_RU >= 0, experts_RU, e).reshape(-1)  # "none" sorts last
    order_M = jnp.argsort(ids_M, stable=True)
    counts = jnp.bincount(ids_M, length=e + 1).astype(jnp.int32)
    sizes_E = counts[:e]
    m = r * u
    start = jnp.cumsum(counts) - counts
    rank_M = jnp.zeros(m, jnp.int32).at[order_M].set(
        jnp.arange(m, dtype=jnp.int32) - start[ids_M[order_M]])  # place within its expert
    layout = BlockLayout.of(sizes_E, m, block_rows)
    slot_M = jnp.where(ids_M < e, layout.first_slot_E[jnp.minimum(ids_M, e - 1)] + rank_M,
                       layout.slots)  # out of range: no expert here
    copy_S = jnp.full(layout.slots, m, jnp.int32).at[slot_M].set(
        jnp.arange(m, dtype=jnp.int32), mode="drop")  # m: an empty slot
    return sizes_E, copy_S // u, copy_S, layout.block_expert_X, layout.used_blocks


def grouped_swiglu(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E, *, impl: str,
                   block_rows: int = BLOCK_ROWS):
    """SwiGLU per expert on rows sorted by expert; rows past sum(group_sizes) give zeros."""
    if impl in ("ragged_dot", "tokamax", "tokamax_triton"):
        matmul = _ragged_matmul(impl, group_sizes_E)
        hidden_MF = jax.nn.silu(matmul(x_MD, w_gate_EDF)) * matmul(x_MD, w_up_EDF)
        out_MD = matmul(hidden_MF, w_down_EFD)
        if impl == "ragged_dot":
            return out_MD
        # tokamax's GPU kernels need not write rows past the groups: make them zeros
        filled_M = jnp.arange(x_MD.shape[0]) < group_sizes_E.sum()
        return jnp.where(filled_M[:, None], out_MD, 0)
    m = x_MD.shape[0]
    layout = BlockLayout.of(group_sizes_E, m, block_rows)
    start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    expert_M = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(m),
                                            side="right"), group_sizes_E.shape[0] - 1)
    slot_M = layout.first_slot_E[expert_M] + jnp.arange(m) - start_E[expert_M]
    slot_M = jnp.where(jnp.arange(m) < group_sizes_E.sum(), slot_M, layout.slots)
    row_S = jnp.full(layout.slots, m, jnp.int32).at[slot_M].set(
        jnp.arange(m, dtype=jnp.int32), mode="drop")
    ones_M = jnp.ones(m, jnp.float32)  # each row is one copy, of weight 1
    return blocked_experts(x_MD, ones_M, w_gate_EDF, w_up_EDF, w_down_EFD, row_S, row_S,
                           layout.block_expert_X, layout.used_blocks, "none").astype(x_MD.dtype)


def _ragged_matmul(impl: str, group_sizes_E):
    if impl == "ragged_dot":
        return lambda rows, w: jax.lax.ragged_dot(rows, w, group_sizes_E)
    ragged_dot = kernels.tokamax_ragged(impl)  # exactly one implementation (kernels.py)
    return lambda rows, w: ragged_dot(rows, w, group_sizes_E)


# ----------------------------------------------------------------------------- blocked


class BlockLayout:
    """Blocks of `rows` rows, each holding rows of one expert only: each expert's rows
    start at `first_slot_E` and are padded to whole blocks. `n_blocks` is the static
    bound (every row of one expert, plus E·(rows−1) padding); `used_blocks` (traced) is
    how many hold a row, `block_expert_X` whose each block is (the last expert past them)."""

    def __init__(self, rows, n_blocks, first_slot_E, block_expert_X, used_blocks):
        self.rows, self.n_blocks = rows, n_blocks
        self.slots = rows * n_blocks
        self.first_slot_E, self.block_expert_X = first_slot_E, block_expert_X
        self.used_blocks = used_blocks

    @classmethod
    def of(cls, sizes_E, m: int, block_rows: int) -> "BlockLayout":
        e = sizes_E.shape[0]
        y = max(1, min(block_rows, m))
        n_blocks = -(-(m + e * (y - 1)) // y)
        padded_E = -(-sizes_E // y) * y
        padded_end_E = jnp.cumsum(padded_E)
        block_expert_X = jnp.minimum(
            jnp.searchsorted(padded_end_E, jnp.arange(n_blocks) * y, side="right"), e - 1)
        return cls(y, n_blocks, padded_end_E - padded_E, block_expert_X, padded_end_E[-1] // y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def blocked_experts(x_RD, weights_M, w_gate_EDF, w_up_EDF, w_down_EFD, row_S, copy_S,
                    block_expert_X, used_blocks, fp8):
    """Σ over copies of weight·SwiGLU_expert(row): [R, D] float32.

    Slot s of the block layout holds copy `copy_S[s]` (its gate weight `weights_M[copy]`)
    of row `row_S[s]` (out of range: an empty slot). Only the `used_blocks` blocks that
    hold copies are visited — a loop with a run-time trip count — and each gathers its
    rows, multiplies them by its expert's matrices and adds the weighted outputs into its
    rows: nothing is sized by the worst-case number of copies but the integer indices.
    `fp8` ("none" or "block", execution.fp8_expert_gemms): every GEMM of the forward and the
    backward in DeepSeek-V3's FP8, emulated (fp8_linear.py), each block's rows its tiles.
    """
    return _blocked_experts_fwd(x_RD, weights_M, w_gate_EDF, w_up_EDF, w_down_EFD, row_S,
                                copy_S, block_expert_X, used_blocks, fp8)[0]


def _swiglu(x_YD, w_gate_DF, w_up_DF, w_down_FD, fp8: str):
    gate_YF = fp8_linear.matmul(x_YD, w_gate_DF, fp8)
    up_YF = fp8_linear.matmul(x_YD, w_up_DF, fp8)
    hidden_YF = jax.nn.silu(gate_YF) * up_YF
    return fp8_linear.matmul(hidden_YF, w_down_FD, fp8), (gate_YF, up_YF, hidden_YF)


def _grad_input(g_YN, w_KN, fp8: str):
    return g_YN @ w_KN.T if fp8 == "none" else fp8_linear.grad_input(g_YN, w_KN, fp8)


def _grad_weight(x_YK, g_YN, fp8: str):
    return x_YK.T @ g_YN if fp8 == "none" else fp8_linear.grad_weight(x_YK, g_YN, fp8)


def _block(n, row_S, copy_S, block_expert_X, y: int):
    """Block n's rows, copies (slices of the slot maps) and expert."""
    start = n * y
    return (jax.lax.dynamic_slice_in_dim(row_S, start, y),
            jax.lax.dynamic_slice_in_dim(copy_S, start, y), block_expert_X[n])


def _blocked_experts_fwd(x_RD, weights_M, w_gate_EDF, w_up_EDF, w_down_EFD, row_S, copy_S,
                         block_expert_X, used_blocks, fp8):
    y = row_S.shape[0] // block_expert_X.shape[0]

    def add_block(n, y_RD):
        rows_Y, copies_Y, e = _block(n, row_S, copy_S, block_expert_X, y)
        x_YD = x_RD.at[rows_Y].get(mode="fill", fill_value=0)
        gates_Y = weights_M.at[copies_Y].get(mode="fill", fill_value=0)
        out_YD, _ = _swiglu(x_YD, w_gate_EDF[e], w_up_EDF[e], w_down_EFD[e], fp8)
        return y_RD.at[rows_Y].add(out_YD.astype(jnp.float32) * gates_Y[:, None], mode="drop")

    y_RD = jax.lax.fori_loop(0, used_blocks, add_block,
                             jnp.zeros((x_RD.shape[0], w_down_EFD.shape[-1]), jnp.float32))
    # the inputs only: each block recomputes its own hiddens in the backward pass
    return y_RD, (x_RD, weights_M, w_gate_EDF, w_up_EDF, w_down_EFD, row_S, copy_S,
                  block_expert_X, used_blocks)


def _blocked_experts_bwd(residuals, dy_RD, fp8):
    x_RD, weights_M, w_gate_EDF, w_up_EDF, w_down_EFD, row_S, copy_S, block_expert_X, \
        used_blocks = residuals
    y = row_S.shape[0] // block_expert_X.shape[0]
    dt = x_RD.dtype

    def block(n, carry):
        dx_RD, d_weights_M, dw = carry
        rows_Y, copies_Y, e = _block(n, row_S, copy_S, block_expert_X, y)
        w_gate_DF, w_up_DF, w_down_FD = w_gate_EDF[e], w_up_EDF[e], w_down_EFD[e]
        x_YD = x_RD.at[rows_Y].get(mode="fill", fill_value=0)
        gates_Y = weights_M.at[copies_Y].get(mode="fill", fill_value=0)
        dy_YD = dy_RD.at[rows_Y].get(mode="fill", fill_value=0)
        out_YD, (gate_YF, up_YF, hidden_YF) = _swiglu(x_YD, w_gate_DF, w_up_DF, w_down_FD,
                                                      fp8)
        # the gate weight's gradient: the copy's output against its row's cotangent
        d_weights_M = d_weights_M.at[copies_Y].set(
            jnp.sum(out_YD.astype(jnp.float32) * dy_YD, axis=-1), mode="drop")
        d_out_YD = (dy_YD * gates_Y[:, None]).astype(dt)
        d_hidden_YF = _grad_input(d_out_YD, w_down_FD, fp8)
        sig_YF = jax.nn.sigmoid(gate_YF)
        d_up_YF = d_hidden_YF * gate_YF * sig_YF
        d_gate_YF = d_hidden_YF * up_YF * sig_YF * (1 + gate_YF * (1 - sig_YF))  # silu'
        dx_YD = _grad_input(d_gate_YF, w_gate_DF, fp8) + _grad_input(d_up_YF, w_up_DF, fp8)
        dx_RD = dx_RD.at[rows_Y].add(dx_YD.astype(jnp.float32), mode="drop")
        parts = (_grad_weight(x_YD, d_gate_YF, fp8), _grad_weight(x_YD, d_up_YF, fp8),
                 _grad_weight(hidden_YF, d_out_YD, fp8))
        # into expert e's slice of the float32 accumulators, in place (no per-block copy)
        dw = tuple(jax.lax.dynamic_update_index_in_dim(
            acc, jax.lax.dynamic_index_in_dim(acc, e, keepdims=False) + part, e, 0)
            for acc, part in zip(dw, parts))
        return dx_RD, d_weights_M, dw

    weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
    init = (jnp.zeros(x_RD.shape, jnp.float32), jnp.zeros(weights_M.shape, jnp.float32),
            tuple(jnp.zeros(w.shape, jnp.float32) for w in weights))
    dx_RD, d_weights_M, dw = jax.lax.fori_loop(0, used_blocks, block, init)
    return (dx_RD.astype(dt), d_weights_M.astype(weights_M.dtype),
            *(g.astype(w.dtype) for g, w in zip(dw, weights)), None, None, None, None)


blocked_experts.defvjp(_blocked_experts_fwd,
                       lambda fp8, residuals, dy_RD: _blocked_experts_bwd(residuals, dy_RD, fp8))
