"""Which links a collective crosses, from the devices its replica groups hold.

A device of the mesh is a position in its flat device order (the ids of the program's
replica groups); `sharding.arrange_devices` lays nodes out one after another, so
position p sits in node p // devices_per_node. A group inside one node rides NVLink; a
group over several nodes sends part of its bytes over InfiniBand, by the algorithm's
volumes for n nodes of g devices (N = n·g devices in the group):

- all-gather / reduce-scatter / all-reduce, hierarchical (NCCL's rings and trees split
  the data over one channel per GPU and HCA; the same volumes as a reduce-scatter or
  gather across nodes among a node's g GPUs, then inside the node): of the ring volume
  R·(N−1)/N a device sends, R·(n−1)/(n·g) crosses the network — a share (n−1)/(N−1) —
  and the rest NVLink;
- all-to-all and ragged all-to-all: each peer's part goes straight to it, so the share
  is the peers on other nodes, (N−g)/(N−1) — no hierarchy (DeepEP's two-stage dispatch
  would be one);
- collective-permute: the share of its (source, target) pairs that cross nodes.

So the data axis of europa-952b (one GPU per node: g = 1) is all InfiniBand and an
expert axis of 4 inside a node all NVLink, whatever the axes are called.
"""

from __future__ import annotations

import re

EXCHANGES = ("all-to-all", "ragged-all-to-all")


def shape_of_groups(groups: list[list[int]], devices_per_node: int) -> tuple[int, int]:
    """(nodes, most devices of one node) of a collective's first replica group (all groups
    of a mesh axis have the same shape)."""
    if not groups or not groups[0]:
        return 1, 1
    per_node: dict[int, int] = {}
    for device in groups[0]:
        node = device // devices_per_node
        per_node[node] = per_node.get(node, 0) + 1
    return len(per_node), max(per_node.values())


def inter_node_share(op: str, groups: list[list[int]], devices_per_node: int,
                     line: str = "") -> float:
    """The share of a collective's bytes per device that crosses InfiniBand (module
    docstring); `line` (the instruction's HLO text) gives a collective-permute's pairs."""
    if op == "collective-permute":
        pairs = re.findall(r"\{(\d+),(\d+)\}", _pairs_text(line))
        if not pairs:
            return 0.0
        return sum(int(a) // devices_per_node != int(b) // devices_per_node
                   for a, b in pairs) / len(pairs)
    nodes, per_node = shape_of_groups(groups, devices_per_node)
    n = len(groups[0]) if groups else 1
    if nodes == 1 or n == 1:
        return 0.0
    if op in EXCHANGES:
        return (n - per_node) / (n - 1)
    return (nodes - 1) / (n - 1)


def _pairs_text(line: str) -> str:
    match = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    return match.group(1) if match else ""
