"""Two-stage expert dispatch for an expert axis across nodes (`comm.expert_dispatch:
two_stage`): each token crosses the network once per destination node, then fans out to
its experts' GPUs over the node's NVLink (the scheme of DeepEP's internode kernels,
DeepSeek-V3 §3.2.2).

Shape suffixes (europa_jax/__init__.py): T tokens, U experts chosen per token, N nodes of
the expert axis, C rows per node (= T: a token visits a node once), R = N·C rows a device
receives from the other nodes, D model width.

Stage 1, over the devices at the same place in each node (one per node: InfiniBand):
one row per (token, destination node) — token row, its experts on that node by their
number inside the node (−1 elsewhere), their gate weights. Stage 2, inside the receiving
node: those rows are the tokens of the one-stage dispatch (moe_dispatch.py: bounded
rounds, dropless, its backward written out) over the node's devices. The combined rows
go back the same way: summed by the node's devices into one row per (token, node), sent
home, summed into the token. With direct dispatch a token would cross the network once
per destination *GPU* (~6.6 of 8 copies at expert parallelism 64 with routing limited to
4 nodes); here at most once per node it picks (≤ `topk_group` under node-limited routing).

Stage 1's buffers hold C = T rows per node — every token could choose this node — so it
is dropless without overflow rounds (its rows are few: T per node, against the T·k
copies of the experts), and a ragged exchange sends only the filled rows. It is
differentiated by autodiff: its exchange's transpose is the reverse exchange (`_swap`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from europa_jax.model.experts.moe_dispatch import Layout, Rounds, dispatch
from europa_jax.parallel import comm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _swap(buf_NC, send_counts_N, recv_counts_N, axis: comm.ExpertAxis):
    """The exchange of per-peer regions (comm.ExpertAxis.exchange), differentiable: its
    transpose sends each region's gradient back to where the region came from."""
    return axis.exchange(buf_NC, send_counts_N, recv_counts_N)


def _swap_fwd(buf_NC, send_counts_N, recv_counts_N, axis):
    return axis.exchange(buf_NC, send_counts_N, recv_counts_N), (send_counts_N, recv_counts_N)


def _swap_bwd(axis, counts, ct_NC):
    send_counts_N, recv_counts_N = counts
    # rows past the received counts were never read (their ids are −1): nothing to return
    return axis.exchange(ct_NC, recv_counts_N, send_counts_N), None, None


_swap.defvjp(_swap_fwd, _swap_bwd)


def two_stage_dispatch(x_TD, gates_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD,
                       inner: Rounds, axis: comm.ExpertAxis, per_node: int):
    """Σ over a token's chosen experts of gate · expert(token), through the node of each
    expert (module docstring): (rows [T, D] in x's dtype, copies the experts processed,
    the received rows' experts inside the node [R, U], rows sent to other nodes)."""
    t, u = experts_TU.shape
    nodes = axis.size // per_node
    across = axis.across_nodes(per_node)
    e_node = w_gate_EDF.shape[0] * per_node  # experts of one node
    lay = Layout(experts_TU, e_node, 0, t, across)  # capacity T: never full
    node_TU = lay.dest_TU
    # per (token, node): the token's experts on that node, numbered inside it, and gates
    on_TUN = node_TU[:, :, None] == jnp.arange(nodes)
    local_TNU = jnp.where(on_TUN, experts_TU[:, :, None] % e_node, -1).transpose(0, 2, 1)
    gate_TNU = jnp.where(on_TUN, gates_TU[:, :, None], 0.0).transpose(0, 2, 1)
    wire = axis.wire_dtype(x_TD.dtype)

    def out(buf_NC):
        return _swap(buf_NC, lay.send_counts_J, lay.recv_counts_J, across)

    x_RD = lay.sent_rows(x_TD)  # fp8 on the wire with `comm.expert_exchange_dtype: fp8`
    e_NCU = lay.out(lay.per_peer_slots(local_TNU, -1))  # integers: no gradient
    valid_NC = jnp.arange(t) < lay.recv_counts_J[:, None]  # ragged: the rest is stale
    e_RU = jnp.where(valid_NC[..., None], e_NCU, -1).reshape(nodes * t, u)
    g_RU = out(lay.per_peer_slots(gate_TNU, 0.0)).reshape(nodes * t, u)
    y_RD, processed = dispatch(x_RD, g_RU, e_RU, w_gate_EDF, w_up_EDF, w_down_EFD, inner)
    back_NCD = _swap(y_RD.astype(wire).reshape(nodes, t, -1), lay.recv_counts_J,
                     lay.send_counts_J, across)
    y_TD = lay.into_tokens(jnp.zeros_like(x_TD), back_NCD)
    off_node = jnp.where(jnp.arange(nodes) == across.index(), 0, lay.send_counts_J).sum()
    return y_TD, processed, e_RU, off_node
