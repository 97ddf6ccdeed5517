"""Expert-parallel dispatch of routed token rows in bounded exchange rounds, its backward
pass written out.

Shape suffixes (europa_jax/__init__.py): T tokens, U experts chosen per token, J peers on
the expert axis, C rows per peer in one round, S = J·C slots of a send buffer (one per
(peer, row number)), R = J·C rows received, D model width.

Each token is sent once to each device holding one of its experts (one row per (token,
destination), not per expert). A destination's rows are numbered in token order; round 0
carries numbers [0, C) in buffers of C rows per peer, C = `moe_buffer_factor` × the rows
a peer expects (`exchange_capacity`, from the routing's expected destinations), and
further rounds of C/4 rows carry what is left — a loop whose trip count the expert
group agrees on (a pmax over `expert`), normally zero. Dropless and exact at buffers of
the expected fill: nothing is sized by the worst case (every row to one peer) but
integer indices.

Communication per round, over `expert` only (NVLink inside a node):
  1. all_to_all int32[J]        rows per peer (so receivers know what is valid)
  2. all_to_all x[J, C, D]      token rows, in the wire dtype (ragged: filled rows only)
     all_to_all int32[J, C, U]  their local expert ids, float32[J, C, U] gate weights
  3. the local experts (expert_matmul.local_forward)
  4. all_to_all y[J, C, D]      combined rows back, summed into their tokens (a segment
                                sum over the filled slots: a token has ≤ topk_group)
The backward pass runs the same rounds in the same layout: the output gradient's rows
out (as 2.), the experts' backward, the rows' and gates' gradients back (as 4.). Written
out rather than differentiated, so that the overflow rounds can be a loop with a
run-time trip count, the experts' backward is called directly (expert_windows: weight
gradients in float32, rounded once), and round 0's received rows are kept from the
forward pass, not exchanged again. With ep = 1 the exchanges are the identity.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from europa_jax.config import ExecutionConfig, ModelConfig
from europa_jax.model.experts.expert_matmul import LocalExperts, local_backward, local_forward
from europa_jax.parallel import comm, fp8_rows

OVERFLOW_SPLIT = 4  # an overflow round carries C / 4 rows per peer


def expected_destinations(cfg: ModelConfig, ep: int) -> float:
    """Devices of the expert axis a token's top-k copies visit, on average, under uniform
    routing. Group-limited routing (a token's experts in `topk_group` of `n_group`
    groups, DeepSeek-V3 §2.1.2) bounds it: with groups of whole devices, to at most the
    chosen groups' devices; with groups of several devices (node-limited routing over an
    expert axis across nodes: a group per node), to the devices of the chosen groups that
    k experts drawn from them hit. Otherwise k distinct experts of E spread over ep."""
    e, k, g = cfg.n_routed_experts, cfg.top_k, cfg.n_group
    if g > 1 and g % ep == 0:
        per_device = g // ep  # groups held by one device
        miss = math.comb(g - per_device, cfg.topk_group) / math.comb(g, cfg.topk_group)
        return min(cfg.topk_group, ep * (1 - miss))
    if g > 1 and ep % g == 0:
        pool, e_local = cfg.topk_group * e // g, e // ep  # the chosen groups' experts
        hit = 1 - math.comb(pool - e_local, k) / math.comb(pool, k)
        return ep * cfg.topk_group / g * hit
    return ep * (1 - math.comb(e - e // ep, k) / math.comb(e, k))


def expected_fill(t: int, cfg: ModelConfig, ex: ExecutionConfig, ep: int,
                  per_node: int = 0) -> float:
    """The share of round 0's exchange buffers that t tokens' routed rows are expected to
    fill (uniform routing): what a ragged exchange of them carries. `per_node`: of the
    second stage of a two-stage dispatch over nodes of that many devices."""
    if ep == 1:
        return 1.0
    capacity, _ = exchange_capacity(t, cfg, ex, ep, per_node)
    return min(1.0, t * expected_destinations(cfg, ep) / (per_node or ep) / capacity)


def exchange_capacity(t: int, cfg: ModelConfig, ex: ExecutionConfig, ep: int,
                      per_node: int = 0) -> tuple[int, bool]:
    """(rows per peer in round 0, whether rows past it are dropped).

    Dropless, round 0 holds `moe_buffer_factor` × the rows a peer expects from this
    device (t tokens × expected destinations / ep); what is left goes in further rounds.
    A capacity factor instead bounds the one round and drops the rest.

    `per_node`: the second stage of a two-stage dispatch (node_dispatch.py) over nodes of
    that many devices. A device sends its node's peers the rows it received from the
    devices at its place in every node — nodes × what a direct dispatch's source sends
    one peer: t · destinations / per_node — out of nodes · t rows.
    """
    if ep == 1:
        return t, False
    peers, rows = (per_node, ep // per_node * t) if per_node else (ep, t)
    if cfg.moe_capacity_factor is not None:
        return min(rows, max(1, math.ceil(cfg.moe_capacity_factor * t * cfg.top_k / peers))), True
    expected = t * expected_destinations(cfg, ep) / peers
    return min(rows, max(1, math.ceil(ex.moe_buffer_factor * expected))), False


def expected_node_fill(cfg: ModelConfig, ep: int, per_node: int) -> float:
    """The share of a two-stage dispatch's first-stage buffers (t rows per node) that the
    rows are expected to fill: the nodes a token visits, of all of them (uniform routing)."""
    nodes = ep // per_node
    return expected_destinations(cfg, nodes) / nodes


@dataclasses.dataclass(frozen=True)
class Rounds:
    """The static shape of a dispatch: rows per peer in round 0 and in each later round,
    whether rows past round 0 are dropped (capacity factor), and how the experts run."""

    capacity: int
    overflow_capacity: int
    drops: bool
    experts: LocalExperts
    axis: comm.ExpertAxis  # kept: the backward pass is traced outside the SPMD context

    @classmethod
    def of(cls, t: int, cfg: ModelConfig, ex: ExecutionConfig, axis: comm.ExpertAxis,
           experts: LocalExperts) -> "Rounds":
        return cls.with_capacity(exchange_capacity(t, cfg, ex, axis.size), experts, axis)

    @classmethod
    def with_capacity(cls, capacity_drops: tuple[int, bool], experts: LocalExperts,
                      axis: comm.ExpertAxis) -> "Rounds":
        capacity, drops = capacity_drops
        return cls(capacity, max(1, -(-capacity // OVERFLOW_SPLIT)), drops, experts, axis)

    def overflow_experts(self) -> LocalExperts:
        """The experts of an overflow round: windows scaled with its buffers."""
        w = self.experts.windows
        if w is None:
            return self.experts
        rows = max(1, -(-w.window * self.overflow_capacity // self.capacity))
        return dataclasses.replace(self.experts, windows=dataclasses.replace(w, window=rows))

    def overflow_rounds(self, rows_J: jax.Array) -> jax.Array:
        """Rounds after round 0 that this device's expert group needs (int32): all of it
        joins each one, so the count is over the group's fullest destination."""
        if self.drops:
            return jnp.int32(0)
        left = jnp.maximum(self.axis.max(rows_J.max()) - self.capacity, 0)
        return ((left + self.overflow_capacity - 1) // self.overflow_capacity).astype(jnp.int32)


class Layout:
    """One round's slots: which (token, peer) fills each slot of the [J, C] send buffer,
    which token each slot belongs to (T: none), and the rows sent to / received from each
    peer. Round rows are the destination's numbers [base, base + C)."""

    def __init__(self, experts_TU, e_local: int, base, capacity: int, axis: comm.ExpertAxis):
        ep, t = axis.size, experts_TU.shape[0]
        self.capacity, self.axis = capacity, axis
        self.dest_TU = experts_TU // e_local
        sent_TJ = _sent(self.dest_TU, ep)
        number_TJ = jnp.cumsum(sent_TJ, axis=0) - 1 - base
        kept_TJ = sent_TJ & (number_TJ >= 0) & (number_TJ < capacity)
        index_TJ = jnp.where(kept_TJ, jnp.arange(ep) * capacity + number_TJ, ep * capacity)
        # gathered from the tokens by slot: no [T, J, D] copy of them is ever made
        self.source_S = jnp.full(ep * capacity, t * ep, jnp.int32).at[index_TJ.reshape(-1)].set(
            jnp.arange(t * ep, dtype=jnp.int32), mode="drop")
        self.token_S = self.source_S // ep
        self.send_counts_J = kept_TJ.sum(axis=0).astype(jnp.int32)
        self.kept_TJ = kept_TJ

    @functools.cached_property
    def recv_counts_J(self) -> jax.Array:
        """Rows each peer sends me this round (a collective: made when first needed)."""
        return self.axis.counts(self.send_counts_J)

    @staticmethod
    def rows_per_peer(experts_TU, e_local: int, ep: int) -> jax.Array:
        """Rows this device sends each peer over all rounds [J] int32."""
        return _sent(experts_TU // e_local, ep).sum(axis=0).astype(jnp.int32)

    def to_slots(self, values_TX, fill, dtype=None):
        """Per-token values [T, ...] → the send buffer [J, C, ...]."""
        ep = self.axis.size
        v = values_TX if dtype is None else values_TX.astype(dtype)
        return v.at[self.token_S].get(mode="fill", fill_value=fill).reshape(
            ep, self.capacity, *values_TX.shape[1:])

    def sent_rows(self, x_TD):
        """Token rows [T, D] as the peers' experts get them [J·C, D], in x's dtype, over the
        wire dtype (`fp8`: e4m3 tiles and their scales, fp8_rows.py); differentiable,
        straight through the rounding (`_sent_rows`)."""
        return _sent_rows(x_TD, self.token_S, self.send_counts_J, self.recv_counts_J,
                          self.axis, self.capacity)

    def per_peer_slots(self, values_TJX, fill):
        """Per-(token, peer) values [T, J, ...] → the send buffer [J, C, ...]."""
        ep = self.axis.size
        flat = values_TJX.reshape(-1, *values_TJX.shape[2:])
        return flat.at[self.source_S].get(mode="fill", fill_value=fill).reshape(
            ep, self.capacity, *values_TJX.shape[2:])

    def out(self, buf_JCX):
        return self.axis.exchange(buf_JCX, self.send_counts_J, self.recv_counts_J)

    def back(self, buf_JCX):
        return self.axis.exchange(buf_JCX, self.recv_counts_J, self.send_counts_J)

    def into_tokens(self, acc_TX, back_JCX):
        """Add each filled slot's row into its token (empty or stale slots point past)."""
        flat = back_JCX.reshape(-1, *back_JCX.shape[2:])
        return acc_TX.at[self.token_S].add(flat.astype(acc_TX.dtype), mode="drop")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _sent_rows(x_TD, token_S, send_counts_J, recv_counts_J, axis: comm.ExpertAxis,
               capacity: int):
    """Layout.sent_rows: rows gathered into the send buffer by slot, exchanged, received."""
    ep = axis.size

    def send(v_TX):
        buf_JCX = v_TX.at[token_S].get(mode="fill", fill_value=0).reshape(
            ep, capacity, *v_TX.shape[1:])
        return axis.exchange(buf_JCX, send_counts_J, recv_counts_J).reshape(
            ep * capacity, *v_TX.shape[1:])

    if axis.wire == "fp8" and ep > 1:
        q_TD, scale_TK = fp8_rows.quantize(x_TD)
        return fp8_rows.dequantize(send(q_TD), send(scale_TK), x_TD.dtype)
    return send(x_TD.astype(axis.wire_dtype(x_TD.dtype))).astype(x_TD.dtype)


def _sent_rows_fwd(x_TD, token_S, send_counts_J, recv_counts_J, axis, capacity):
    rows = _sent_rows(x_TD, token_S, send_counts_J, recv_counts_J, axis, capacity)
    # x's rows and dtype, without keeping x
    return rows, (jnp.zeros((x_TD.shape[0], 0), x_TD.dtype), token_S, send_counts_J,
                  recv_counts_J)


def _sent_rows_bwd(axis, capacity, saved, ct_RD):
    """The rows' gradients back to their tokens in the combine's wire dtype (bf16 under
    fp8), summed over a token's peers: straight through the dispatch's rounding."""
    like_T0, token_S, send_counts_J, recv_counts_J = saved
    ep, t, d = axis.size, like_T0.shape[0], ct_RD.shape[1]
    back_JCD = axis.exchange(ct_RD.astype(axis.wire_dtype(ct_RD.dtype)).reshape(
        ep, capacity, d), recv_counts_J, send_counts_J)
    dx_TD = jnp.zeros((t, d), jnp.float32).at[token_S].add(
        back_JCD.reshape(-1, d).astype(jnp.float32), mode="drop")
    return dx_TD.astype(like_T0.dtype), None, None, None


_sent_rows.defvjp(_sent_rows_fwd, _sent_rows_bwd)


def _sent(dest_TU, ep: int):
    """[T, J] bool: whether a token has a chosen expert on each peer (one row per peer)."""
    return jnp.any(dest_TU[:, :, None] == jnp.arange(ep), axis=1)


def _received(x_TD, gates_TU, experts_TU, lay: Layout, e_local: int):
    """Round rows as the experts' device gets them: x [R, D], local ids [R, U] (−1: none
    or invalid), gates [R, U] float32."""
    ep, (t, u) = lay.axis.size, experts_TU.shape
    peer_TUJ = lay.dest_TU[:, :, None] == jnp.arange(ep)
    local_TJU = jnp.where(peer_TUJ, experts_TU[:, :, None] % e_local, -1).transpose(0, 2, 1)
    gate_TJU = jnp.where(peer_TUJ, gates_TU[:, :, None], 0.0).transpose(0, 2, 1)
    x_RD = lay.sent_rows(x_TD)
    e_JCU = lay.out(lay.per_peer_slots(local_TJU, -1))
    g_RU = lay.out(lay.per_peer_slots(gate_TJU, 0.0)).reshape(-1, u)
    valid_JC = jnp.arange(lay.capacity) < lay.recv_counts_J[:, None]  # ragged: rest stale
    return x_RD, jnp.where(valid_JC[..., None], e_JCU, -1).reshape(-1, u), g_RU


def _round_forward(x_TD, gates_TU, experts_TU, weights, lay: Layout, how: LocalExperts, y_TD):
    x_RD, e_RU, g_RU = _received(x_TD, gates_TU, experts_TU, lay, weights[0].shape[0])
    y_RD, sizes_E, residuals = local_forward(x_RD, e_RU, g_RU, weights, how)
    wire = lay.axis.wire_dtype(x_TD.dtype)
    back_JCD = lay.back(y_RD.astype(wire).reshape(lay.axis.size, lay.capacity, -1))
    return lay.into_tokens(y_TD, back_JCD), sizes_E.sum(), residuals


def _round_backward(dy_TD, lay: Layout, residuals, how: LocalExperts, carry):
    """One round's gradients added into (dx [T, D], d gates [T, U], d weights)."""
    dx_TD, d_gates_TU, dw = carry
    ep, (t, u) = lay.axis.size, d_gates_TU.shape
    wire = lay.axis.wire_dtype(dy_TD.dtype)
    dy_RD = lay.out(lay.to_slots(dy_TD, 0, wire)).reshape(ep * lay.capacity, -1)
    dx_RD, d_g_RU, dw_round = local_backward(residuals, dy_RD, (ep * lay.capacity, u), how)
    dx_TD = lay.into_tokens(dx_TD, lay.back(dx_RD.astype(wire).reshape(ep, lay.capacity, -1)))
    d_g_JCU = lay.back(d_g_RU.reshape(ep, lay.capacity, u))
    d_g_TJU = jnp.zeros((t * ep, u), jnp.float32).at[lay.source_S].add(
        d_g_JCU.reshape(-1, u), mode="drop").reshape(t, ep, u)
    # a gate's gradient came back from the device of its expert
    d_gates_TU = d_gates_TU + jnp.take_along_axis(d_g_TJU, lay.dest_TU[:, None, :], axis=1)[:, 0]
    return dx_TD, d_gates_TU, tuple(a + b for a, b in zip(dw, dw_round))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def dispatch(x_TD, gates_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD, rounds: Rounds):
    """Σ over a token's chosen experts of gate · expert(token), every token's experts on
    their devices: (rows [T, D] in x's dtype, copies the experts processed (int32))."""
    return _dispatch_fwd(x_TD, gates_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD,
                         rounds)[0]


def _dispatch_fwd(x_TD, gates_TU, experts_TU, w_gate_EDF, w_up_EDF, w_down_EFD, rounds):
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
    e_local = w_gate_EDF.shape[0]
    lay = Layout(experts_TU, e_local, 0, rounds.capacity, rounds.axis)
    # the combine accumulates in x's dtype: a token sums ≤ topk_group rows (≤ ep)
    y_TD, processed, residuals = _round_forward(x_TD, gates_TU, experts_TU, weights, lay,
                                                rounds.experts, jnp.zeros_like(x_TD))
    n_over = rounds.overflow_rounds(Layout.rows_per_peer(experts_TU, e_local, rounds.axis.size))
    how = rounds.overflow_experts()

    def overflow(r, carry):
        y_TD, processed = carry
        base = rounds.capacity + (r - 1) * rounds.overflow_capacity
        later = Layout(experts_TU, e_local, base, rounds.overflow_capacity, rounds.axis)
        y_TD, more, _ = _round_forward(x_TD, gates_TU, experts_TU, weights, later, how, y_TD)
        return y_TD, processed + more

    y_TD, processed = jax.lax.fori_loop(1, n_over + 1, overflow, (y_TD, processed))
    return (y_TD, processed), (x_TD, gates_TU, experts_TU, weights, residuals, n_over)


def _dispatch_bwd(rounds, saved, cotangents):
    x_TD, gates_TU, experts_TU, weights, residuals, n_over = saved
    dy_TD = cotangents[0]
    e_local = weights[0].shape[0]
    lay = Layout(experts_TU, e_local, 0, rounds.capacity, rounds.axis)
    # a token's gradient sums its ≤ topk_group rows' in its dtype (as the combine does)
    carry = (jnp.zeros_like(x_TD), jnp.zeros(gates_TU.shape, jnp.float32),
             tuple(jnp.zeros_like(w) for w in weights))
    dx_TD, d_gates_TU, dw = _round_backward(dy_TD, lay, residuals, rounds.experts, carry)
    how = rounds.overflow_experts()

    def overflow(r, carry):
        base = rounds.capacity + (r - 1) * rounds.overflow_capacity
        later = Layout(experts_TU, e_local, base, rounds.overflow_capacity, rounds.axis)
        x_RD, e_RU, g_RU = _received(x_TD, gates_TU, experts_TU, later, e_local)
        _, _, residuals = local_forward(x_RD, e_RU, g_RU, weights, how)  # not kept: rare
        return _round_backward(dy_TD, later, residuals, how, carry)

    dx_TD, d_gates_TU, dw = jax.lax.fori_loop(1, n_over + 1, overflow, (dx_TD, d_gates_TU, dw))
    return (dx_TD.astype(x_TD.dtype), d_gates_TU.astype(gates_TU.dtype), None, *dw)


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)
