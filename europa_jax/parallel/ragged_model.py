"""`jax.lax.ragged_all_to_all` as its documentation defines it, in collectives XLA:CPU runs.

XLA:CPU has no ragged all-to-all (UNIMPLEMENTED in jax 0.10 and 0.12), so on a CPU mesh the
MoE's ragged exchange (`comm.expert_exchange: ragged`, the GPU's) would never execute: its
offsets, sizes, overflow rounds and the two-stage dispatch would be checked only in HLO.
This model follows the op's documented contract exactly, so the same caller code runs on
CPU against the dense reference (`ExpertAxis.exchange` takes it on CPU meshes only):

- each caller sends, for every slice i of its `input_offsets`/`send_sizes` (K slices,
  K/n to each of the n devices of its group, in group order), `operand[input_offsets[i]
  : input_offsets[i] + send_sizes[i]]` to device i // (K/n);
- each caller's result is `output` with, for every slice i it receives (from device
  i // (K/n)), the `recv_sizes[i]` received rows written from `all_to_all(output_offsets)
  [i]` on; every other row of `output` is untouched.

Communication (a test model, not a fast path): the operands are all-gathered over the
whole `expert` axis (so `axis_index_groups` need not be supported by the gather) and the
offsets exchanged with an all-to-all within the group; the received rows are then
gathered and scattered locally. Differentiable: autodiff transposes the all-gather and
the gathers/scatters (the op's own transpose is another ragged all-to-all).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                      recv_sizes, *, axis_name: str, axis_index_groups=None):
    """The result `jax.lax.ragged_all_to_all` documents, computed with an all-gather, an
    all-to-all of the offsets and local gathers/scatters (module docstring)."""
    del send_sizes  # the receiver's recv_sizes say how many rows arrive (the contract
    #                 makes them equal to the senders' send_sizes)
    me = jax.lax.axis_index(axis_name)
    size = jax.lax.axis_size(axis_name)
    groups = [list(g) for g in axis_index_groups] if axis_index_groups else [list(range(size))]
    n = len(groups[0])
    k = input_offsets.shape[0]
    per_device = k // n
    # members_GN[g, p]: the axis index of position p of group g; mine_N: my group's row
    members_GN = jnp.asarray(groups, jnp.int32)
    group_of = [0] * size
    for g, members in enumerate(groups):
        for device in members:
            group_of[device] = g
    mine_N = members_GN[jnp.asarray(group_of, jnp.int32)[me]]

    def exchanged(x_K):  # what each sender put in the slice aimed at me, in slice order
        return jax.lax.all_to_all(x_K, axis_name, 0, 0, tiled=True,
                                  axis_index_groups=axis_index_groups)

    starts_K = exchanged(input_offsets)  # where in its operand each sender's slice starts
    at_K = exchanged(output_offsets)  # where in my result each received slice goes
    every_operand = jax.lax.all_gather(operand, axis_name)  # [size, N, ...]
    rows = operand.shape[0]
    r_R = jnp.arange(rows, dtype=jnp.int32)
    sender_K = mine_N[jnp.arange(k) // per_device]
    source_KR = jnp.clip(starts_K[:, None] + r_R[None, :], 0, rows - 1)
    values = every_operand[sender_K[:, None], source_KR]  # [K, N, ...]
    received_KR = r_R[None, :] < recv_sizes[:, None]
    target_KR = jnp.where(received_KR, at_K[:, None] + r_R[None, :], output.shape[0])
    return output.at[target_KR.reshape(-1)].set(
        values.reshape(k * rows, *operand.shape[1:]).astype(output.dtype), mode="drop")
