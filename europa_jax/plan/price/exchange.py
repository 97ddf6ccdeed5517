"""The plan's account of the MoE token exchange: what routing is expected to send, what
the compiled buffers could carry at most, and over which links.

Uniform top-k routing is the default (moe_dispatch.expected_destinations: group- and
node-limited routing applied); aux-loss-free balancing keeps the expert load near it. The
estimate charges a ragged exchange at the expected fill of its round-0 buffers; the
buffer bound (every buffer full, each overflow loop once) is reported beside it, and on
the CPU target (dense all_to_all of whole buffers) it is what is charged.
"""

from __future__ import annotations

from europa_jax.config import Config
from europa_jax.model.experts import moe, moe_dispatch

WIRE_BYTES = {"bf16": 2, "fp32": 4}
# fp8 (parallel/fp8_rows.py): the forward's dispatch in e4m3 with a float32 scale per 128
# values, the combine and both backward exchanges in bf16 — bytes per value of the four
FP8_DISPATCH_BYTES = (1 + 4 / 128, 2, 2, 2)


def wire_bytes(dtype: str) -> float:
    """Mean bytes per value over a layer's four exchanges (dispatch and combine, forward
    and backward) at the config's `comm.expert_exchange_dtype`."""
    return sum(FP8_DISPATCH_BYTES) / 4 if dtype == "fp8" else WIRE_BYTES[dtype]


def two_stage_nodes(cfg: Config) -> int:
    """Devices per node when the config's MoE dispatches in two stages, else 0 (what
    comm.two_stage_nodes says while the step is traced)."""
    two = cfg.comm.expert_dispatch == "two_stage" and cfg.mesh.expert_nodes > 1
    return cfg.mesh.devices_per_node if two else 0


def summary(cfg: Config, numbers: dict[str, float], machine) -> dict | None:
    """The exchange section of a plan report (None without expert parallelism)."""
    m, ep = cfg.model, cfg.mesh.expert
    if ep == 1 or m.n_routed_experts == 0:
        return None
    t = moe.dispatch_tokens(cfg)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len // cfg.mesh.n_devices
    destinations = moe_dispatch.expected_destinations(m, ep)
    # rows out and back in one forward and one backward, at the wire dtype (a forward
    # that remat runs again sends its rows again: the compiled count has it, not this)
    routed = (4 * (m.n_moe_layers + m.mtp_layers) * tokens * destinations * m.d_model
              * wire_bytes(cfg.comm.expert_exchange_dtype))
    nodes, g = cfg.mesh.expert_nodes, cfg.mesh.node_group
    per_node = two_stage_nodes(cfg)  # the GPU exchange of a two-stage dispatch: its 2nd
    two_stage = bool(per_node)
    if two_stage:  # a row per node a token visits crosses; its fan-out stays in the node
        node_visits = moe_dispatch.expected_destinations(m, nodes)
        off_node = node_visits * (nodes - 1) / nodes / destinations
    else:  # a row per destination GPU; those on other nodes cross
        off_node = (ep - g) / ep
    capacity, drops = moe_dispatch.exchange_capacity(t, m, cfg.execution, ep, per_node)
    out = {
        "expert_axis": ep, "nodes": nodes, "devices_per_node": cfg.mesh.devices_per_node,
        "dispatch": "two_stage" if two_stage else "direct",
        "expected_nodes_per_token": moe_dispatch.expected_destinations(m, nodes),
        "routing": {"n_group": m.n_group, "topk_group": m.topk_group,
                    "node_limited": nodes > 1 and m.n_group % nodes == 0 and m.n_group > 1},
        "tokens_per_dispatch": t,
        "expected_destinations": destinations,
        "rows_per_peer_round0": capacity, "drops_past_capacity": drops,
        "expected_fill": moe_dispatch.expected_fill(t, m, cfg.execution, ep, per_node),
        # a two-stage dispatch's first stage: t rows per node, filled by the nodes visited
        "node_stage_fill": (moe_dispatch.expected_node_fill(m, ep, per_node) if two_stage
                            else None),
        # analytic: what the routed rows are, whatever the buffers
        "routed_bytes_per_step": routed,
        # of them between nodes (two-stage: one row per node visited, not per GPU)
        "routed_infiniband_bytes_per_step": routed * off_node,
        "routed_infiniband_s": routed * off_node / (machine.network_bandwidth
                                                    * machine.infiniband.expected),
    }
    if "exchange/buffer_bytes" in numbers:  # the GPU program's ragged exchanges
        bound_ib = numbers["exchange/buffer_infiniband_bytes"]
        out.update(buffer_bytes=numbers["exchange/buffer_bytes"],
                   buffer_infiniband_bytes=bound_ib,
                   buffer_infiniband_s=bound_ib / (machine.network_bandwidth
                                                   * machine.infiniband.expected))
    return out
