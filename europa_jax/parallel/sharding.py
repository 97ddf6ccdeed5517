"""The `(data, expert)` mesh and the ONE table mapping logical axis names to mesh axes.

Notation (scaling-book style): `W[D_(data,expert), F]` = D split over both mesh axes.
- tokens `X[B_(data,expert), S, D]`: every device holds different sequences.
- dense weights: fully sharded (FSDP) over all devices, gathered where a layer uses them
  (comm.gather_weight).
- expert weights `We[E_expert, D, F_data]`: experts split over the devices of a node,
  each expert's matrix sharded over nodes.

Sizes decide the dimension: 96 nodes carry a factor 3 that 7168 (the hidden size) lacks,
so `resolve_spec` gives each mesh axis to the first dimension of the tensor whose
logical name allows that axis *and* whose size it divides (e.g. `kv_a[7168, 576]` →
`P('expert', 'data')`). A mesh axis no dimension can take leaves the tensor replicated
over it; `replicated_over` reports that so tests and planning can show the cost, and
`storage_shape` (execution.param_pad_multiple) avoids it by storing such a weight zero-padded
(europa-952b's `w_o[64, 128, 7168]` as `[64, 128, 7200]`). layout.py applies these rules
once per mesh to every parameter of the table (param_table.py).

Axis type: `AxisType.Auto`. The forward/backward pass is one explicit `shard_map`
(train.py, comm.py), where axis types play no role; what remains outside it — the
optimizer update on sharded parameters, sharded init — is elementwise or left to GSPMD
(Muon's Newton–Schulz is laid out by sharding constraints, muon_sharded.py), which
Explicit axes would force us to annotate op by op for no gain.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from europa_jax.config import ConfigError, MeshConfig

MESH_AXES = ("data", "expert")

# Logical axis → mesh axes it may be sharded over, in order of preference.
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    # parameters
    "layers": (),  # scanned layer axis: every device holds its slice of every layer
    "vocab": ("data", "expert"),
    "embed": ("data", "expert"),
    "mtp_concat": ("data", "expert"),  # an MTP module's [embedding; state] input (2·D)
    "mlp": ("data", "expert"),
    "q_lora": ("data", "expert"),
    "kv_lora": ("data", "expert"),
    "heads": ("data", "expert"),
    "head_dim": ("data", "expert"),
    "router": ("data", "expert"),
    "norm": (),  # vectors of width D: replicated, too small to be worth a gather
    "experts": ("expert",),  # experts stay inside a node
    "expert_embed": ("data",),
    "expert_mlp": ("data",),
    # the batch: every device holds different sequences
    "batch": ("data", "expert"),
    "seq": (),
}

# Used only for a mesh axis that no primary rule could place on the tensor. Kimi-K2's
# expert matrices [E=384, D=7168, F=2048] have no factor 3 outside E, so over 96 nodes
# the experts themselves are split further: P(('expert', 'data'), ...) keeps each node's
# experts contiguous (expert-major) so group-limited routing still maps groups to GPUs.
FALLBACK_RULES: dict[str, tuple[str, ...]] = {
    "experts": ("data",),
}

# Logical axes whose sharding over a mesh axis is *kept* when a weight is gathered for
# use (layout.gather_plan): expert parallelism — each device computes only its experts.
KEPT_SHARDED: dict[str, str] = {"experts": "expert"}


def arrange_devices(devices: Sequence[Any], mesh_cfg: MeshConfig,
                    node_of_process: Mapping[int, str] | None = None) -> np.ndarray:
    """Devices as a [data, expert] grid whose every `expert` row lies inside one node.

    Works for one process per node (its local devices form a row) and one process per
    GPU (consecutive ranks of a node form a row): devices are ordered by (node, process,
    id) and cut into rows. `node_of_process` maps process index → node name; by default
    every process is its own node. A row spanning two nodes would put the MoE all-to-all
    on the inter-node network, so it is an error unless `mesh.allow_cross_node_experts`.
    """
    devices = list(devices)
    if mesh_cfg.n_devices != len(devices):
        raise ConfigError(f"mesh: data×expert = {mesh_cfg.data}×{mesh_cfg.expert} = "
                          f"{mesh_cfg.n_devices} but there are {len(devices)} devices")
    node_of_process = node_of_process or {}
    node = lambda dev: str(node_of_process.get(dev.process_index, dev.process_index))
    ordered = sorted(devices, key=lambda dev: (node(dev), dev.process_index, dev.id))
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    grid = grid.reshape(mesh_cfg.data, mesh_cfg.expert)
    if not mesh_cfg.allow_cross_node_experts:
        for row in grid:
            nodes = sorted({node(dev) for dev in row})
            if len(nodes) > 1:
                raise ConfigError(
                    f"mesh.expert: {mesh_cfg.expert} puts devices of nodes {nodes} in one expert "
                    "group, so the MoE all-to-all would cross the network; use an expert axis "
                    "that divides the devices per node or set mesh.allow_cross_node_experts: true")
    return grid


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None,
              node_of_process: Mapping[int, str] | None = None) -> Mesh:
    """Mesh `(data, expert)`; `expert` groups the devices of one node (see arrange_devices)."""
    grid = arrange_devices(jax.devices() if devices is None else devices, mesh_cfg,
                           node_of_process)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def resolve_spec(logical_axes: Sequence[str | None], shape: Sequence[int],
                 mesh_shape: dict[str, int]) -> P:
    """Per-tensor PartitionSpec: each mesh axis to the first allowed dim it divides.

    Fallback rules are tried only for mesh axes no primary rule could place. Within one
    dimension, mesh axes are ordered as the logical name's rules list them (major first).
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    for name in logical_axes:
        if name is not None and name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no sharding rule in sharding.LOGICAL_RULES")
    assigned: list[list[str]] = [[] for _ in shape]
    placed: set[str] = set()
    for rules in (LOGICAL_RULES, FALLBACK_RULES):
        for mesh_axis in MESH_AXES:
            size = mesh_shape.get(mesh_axis, 1)
            if size == 1 or mesh_axis in placed:
                continue
            for dim, name in enumerate(logical_axes):
                if name is None or mesh_axis not in rules.get(name, ()):
                    continue
                already = math.prod(mesh_shape[a] for a in assigned[dim])
                if shape[dim] % (already * size) == 0:
                    assigned[dim].append(mesh_axis)
                    placed.add(mesh_axis)
                    break
    entries = []
    for name, axes in zip(logical_axes, assigned):
        preference = LOGICAL_RULES.get(name, ()) + FALLBACK_RULES.get(name, ())
        axes = sorted(axes, key=preference.index)
        entries.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return P(*entries)


def storage_shape(logical_axes: Sequence[str | None], shape: Sequence[int],
                  multiple: int) -> tuple[int, ...]:
    """The shape a parameter is stored (and sharded, and checkpointed) in.

    `shape` itself, unless no dimension that may be sharded over `data` is a multiple of
    `multiple` (`execution.param_pad_multiple`: the node count, 96 on Jupiter): then the one
    such dimension that pads least is zero-padded up to a multiple of it. europa-952b's
    `w_o[64, 128, 7168]` becomes `[64, 128, 7200]` (+0.45 %) and `w_kv_b[512, 64, 256]`
    `[576, 64, 256]`: otherwise no dimension takes the factor 3 of 96 nodes and every node
    would hold a copy (4.1 GB per GPU, and as much optimizer state). The padding depends
    on the config, not on the mesh, so checkpoints restore on any mesh. The model reads
    only the leading `shape` part (layers.weight), so the padding gets zero gradients and
    stays zero under Muon (Newton–Schulz maps zero rows/columns to zero) and AdamW.
    """
    shape = tuple(shape)
    if multiple <= 1:
        return shape
    eligible = [d for d, name in enumerate(logical_axes) if name is not None and "data" in
                LOGICAL_RULES.get(name, ()) + FALLBACK_RULES.get(name, ())]
    if not eligible or any(shape[d] % multiple == 0 for d in eligible):
        return shape
    # never the expert dimension: padding it would add experts
    candidates = [d for d in eligible if logical_axes[d] != "experts"]
    if not candidates:
        return shape
    padded = lambda d: -(-shape[d] // multiple) * multiple
    dim = min(candidates, key=lambda d: padded(d) / shape[d])  # first of equals: stable
    return shape[:dim] + (padded(dim),) + shape[dim + 1:]


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None → (), 'data' → ('data',), tuples as is."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def replicated_over(spec: P, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that a spec does not use: the tensor is copied over them."""
    used = {a for entry in spec for a in entry_axes(entry)}
    return tuple(a for a in MESH_AXES if mesh_shape.get(a, 1) > 1 and a not in used)


def mesh_platform(mesh: Mesh) -> str:
    """The platform the mesh's devices compute on: 'cpu', or 'gpu' (also for compile-only
    GPUs of a topology, gpu_target.py). Backend-specific code paths choose by this, not
    by jax's default backend, so that a GPU program can be compiled on a CPU machine."""
    return mesh.devices.flat[0].platform


def is_compile_only(mesh: Mesh) -> bool:
    """True for a mesh of devices this process cannot run on (a GPU topology)."""
    return mesh.devices.flat[0] not in jax.devices()


def placement_mesh(mesh: Mesh) -> Mesh | jax.sharding.AbstractMesh:
    """The mesh shardings are built on: the abstract mesh for compile-only devices, whose
    concrete shardings would silently drop memory kinds (`pinned_host`)."""
    return mesh.abstract_mesh if is_compile_only(mesh) else mesh


def mesh_shape_of(mesh: Mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))
