"""Each parameter's layout on one mesh, resolved once from the table (param_table.py).

For every role: the shape the model uses, the shape it is stored in (zero-padded where
`execution.param_pad_multiple` asks, sharding.storage_shape), its PartitionSpec on this mesh
(sharding.resolve_spec), one device's shard of it, and what the FSDP gather collects
(which dimensions, over which mesh axes). `train.build_trainer` resolves the mesh's
layout, the SPMD context carries it, and the model's `layers.weight` only looks it up —
so a parameter's sharding is decided in exactly one place. Outside SPMD (tests, export
parity, sampling) the empty mesh's layout is used: stored shapes, nothing gathered.

Stacked layers (`moe_layers.attention.w_q_b[L, ...]`) share their role's layout; the
leading `layers` axis is never sharded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec as P

from europa_jax import param_table
from europa_jax.config import ModelConfig
from europa_jax.parallel import sharding

Gather = tuple[tuple[int, tuple[str, ...]], ...]  # (dimension, mesh axes it is gathered over)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    model_shape: tuple[int, ...]  # what the model computes with (one layer)
    stored_shape: tuple[int, ...]  # what is stored, sharded and checkpointed (one layer)
    spec: P  # of the stored array (one layer) on this mesh
    local_shape: tuple[int, ...]  # one device's shard of it
    gather: Gather  # what `comm.gather_weight` all-gathers where the weight is used


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every role's `ParamLayout` on a mesh of `mesh_shape` (hashable: a jit cache key)."""

    mesh: tuple[tuple[str, int], ...]
    roles: tuple[tuple[str, ParamLayout], ...]

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    @functools.cached_property
    def _by_role(self) -> dict[str, ParamLayout]:
        return dict(self.roles)

    def __getitem__(self, role: str) -> ParamLayout:
        param_table.row(role)  # an undeclared role says where to declare it
        return self._by_role[role]

    def of_leaf(self, path, leaf) -> tuple[int, ParamLayout]:
        """(leading stacked axes, the role's layout) of a parameter tree leaf, checked
        against the leaf's shape."""
        own = self[param_table.split_path(path)[1]]
        lead = len(leaf.shape) - len(own.stored_shape)
        if lead < 0 or tuple(leaf.shape[lead:]) != own.stored_shape:
            raise ValueError(f"parameter {'.'.join(param_table.key_names(path))} has shape "
                             f"{tuple(leaf.shape)}; its row declares {own.stored_shape} per layer")
        return lead, own

    def specs(self, abstract_params: Any) -> Any:
        """PartitionSpecs of a parameter tree (stacked layers: a leading None)."""
        def spec(path, leaf):
            lead, own = self.of_leaf(path, leaf)
            return P(*((None,) * lead + tuple(own.spec)))

        return jax.tree_util.tree_map_with_path(spec, abstract_params)


def gather_plan(logical_axes: Sequence[str], spec: P) -> Gather:
    """(dimension, mesh axes to all-gather it over) for each sharded dimension of a spec,
    minus the mesh axes that stay sharded where the weight is used
    (sharding.KEPT_SHARDED: each device computes only the experts it holds)."""
    plan = []
    for dim, (name, entry) in enumerate(zip(logical_axes, spec)):
        axes = sharding.entry_axes(entry)
        kept = sharding.KEPT_SHARDED.get(name)
        if kept in axes:
            if axes[0] != kept:  # the kept axis must be major for the gathered blocks to
                raise ValueError(f"{name}: {axes} keeps {kept} but it is not the major axis")
            axes = axes[1:]  # ... be contiguous (one node's experts)
        if axes:
            plan.append((dim, tuple(axes)))
    return tuple(plan)


def resolve(logical_axes: Sequence[str], model_shape: Sequence[int], pad_multiple: int,
            mesh_shape: dict[str, int]) -> ParamLayout:
    """One parameter's layout from its logical axes and model shape."""
    stored = sharding.storage_shape(logical_axes, model_shape, pad_multiple)
    spec = sharding.resolve_spec(logical_axes, stored, mesh_shape)
    local = tuple(n // math.prod(mesh_shape[a] for a in sharding.entry_axes(entry))
                  for n, entry in zip(stored, spec))
    return ParamLayout(model_shape=tuple(model_shape), stored_shape=stored, spec=spec,
                       local_shape=local, gather=gather_plan(logical_axes, spec))


@functools.lru_cache(maxsize=64)
def _for_mesh(model: ModelConfig, mesh: tuple[tuple[str, int], ...], pad_multiple: int) -> Layout:
    mesh_shape = dict(mesh)
    roles = tuple((role, resolve(p.axes, p.shape(model), pad_multiple, mesh_shape))
                  for role, p in param_table.ROWS.items())
    return Layout(mesh=mesh, roles=roles)


def for_mesh(model: ModelConfig, mesh_shape: dict[str, int] | None = None, *,
             pad_multiple: int) -> Layout:
    """The layout of every parameter on a mesh of `mesh_shape` (None: no mesh), weights
    without a data-shardable dimension padded to `pad_multiple`
    (`execution.param_pad_multiple`)."""
    return _for_mesh(model, tuple((mesh_shape or {}).items()), pad_multiple)
