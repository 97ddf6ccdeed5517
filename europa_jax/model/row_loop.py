"""A decoder layer over a device's rows one at a time, its weights gathered once for all.

With k rows per device (`data.global_batch_size` = k × devices), a layer that takes all
k rows together gathers each weight once — the bytes per token that InfiniBand carries
fall k-fold — but holds k rows' temporaries at its peak (europa-952b at 2 rows: 120.5 GB
of HBM against 88.3). `execution.row_loop` keeps the one gather and holds one row's
activations at a time (europa-952b at 2 rows: 110.4 GB — the gathered expert matrices,
their transposes and their gradients' accumulators stay whole: docs/plan.md, "The row
loop"):

1. the layer's parameters are gathered on entry (`nn.map_variables`; the gathers'
   transposes, the gradients' reduce-scatters, happen once on the way out);
2. the rows go through the layer one by one in a scan (`nn.scan`, the gathered weights
   broadcast to every trip: their gradients sum over the trips before the one
   reduce-scatter);
3. each trip is rematerialized on its own (`jax.checkpoint` under the layer's policy
   less its layer input), so the backward holds one row's activations at a time.

The layer input is named for the activation policy outside the loop, all k rows at once,
as without it (under `execution.layer_input_format: e4m3` its e4m3 tiles are, and each trip
reads its own row of them: layer_input.py). With context parallelism a trip takes row r of each of the node's GPUs
(attention sees the node's rows). Stats come back summed over the rows (counts), or
their maximum (`attention_logit_max_H`).

Shape suffixes: the project's legend (europa_jax/__init__.py); K here is the rows a
device holds, R the node's rows of one trip (1 without context parallelism).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from europa_jax.config import ExecutionConfig, ModelConfig
from europa_jax.model import block, layer_input
from europa_jax.model.layers import ready_to_compute, weights_gathered
from europa_jax.parallel import comm


def gathered(params: dict, cfg: ModelConfig, ex: ExecutionConfig) -> dict:
    """Every parameter of a layer's tree, gathered as `layers.weight` would gather it
    (their paths in the layer are their roles: `attention.w_q_a`)."""
    def gather(path, w):
        role = ".".join(str(getattr(k, "key", k)) for k in path)
        return ready_to_compute(w, role, cfg, ex)

    return jax.tree_util.tree_map_with_path(gather, params)


def row_looped_block(cfg: ModelConfig, ex: ExecutionConfig, trip_policy: Callable | None,
                     stack: str) -> type[nn.Module]:
    """The decoder block class whose rows go one at a time (see the module docstring),
    each trip under `trip_policy` (None: trips saved whole, no memory gained); `stack`:
    the layers' name (`dense_layers`, `moe_layers`), which their gathers' op names carry."""

    class RowLoopedBlock(nn.Module):
        ROLE_ROOT = True
        cfg: ModelConfig
        ex: ExecutionConfig
        is_moe: bool

        @nn.compact
        def __call__(self, x_KSD, segment_ids_BS, cos_BSP2, sin_BSP2, router_bias_E,
                     tokens_KS):
            k = x_KSD.shape[0]
            args = (self.cfg, self.ex, self.is_moe, x_KSD, segment_ids_BS, cos_BSP2, sin_BSP2,
                    router_bias_E, tokens_KS)
            if comm.current() is None or self.is_initializing():  # nothing was gathered
                return block.block_layers(*args)
            if k == 1:
                with weights_gathered():
                    return block.block_layers(*args)
            if self.ex.layer_input_format == "compute_dtype":
                x_KSD, _ = layer_input.for_branches(self.ex, x_KSD)  # named for the policy
                tiles_KSX = None
            else:  # each trip reads its row's tiles: no rounded copy of all k rows is held
                tiles_KSX = layer_input.e4m3_tiles(x_KSD)
            group = segment_ids_BS.shape[0] // k  # the node's GPUs whose rows attention sees

            def trips(a_BX):  # [group·K, ...] in device order → [K, group, ...]
                return jnp.swapaxes(a_BX.reshape(group, k, *a_BX.shape[1:]), 0, 1)

            def one_row(mdl, carry, row, bias_E):
                x_1SD, tiles_1SX, segment_ids_RS, cos_RSP2, sin_RSP2, tokens_1S = row
                branch_in_1SD = x_1SD if tiles_1SX is None else layer_input.read(x_1SD,
                                                                                 *tiles_1SX)
                y_1SD, stats = block.block_layers(mdl.cfg, mdl.ex, mdl.is_moe, x_1SD,
                                                  segment_ids_RS, cos_RSP2, sin_RSP2, bias_E,
                                                  tokens_1S, branch_in_BSD=branch_in_1SD)
                return carry, (y_1SD, stats)

            if trip_policy is not None:
                one_row = nn.remat(one_row, policy=trip_policy, prevent_cse=False)
            scan = nn.scan(one_row, variable_broadcast="params", split_rngs={"params": False},
                           in_axes=(0, nn.broadcast), length=k)
            rows = (x_KSD[:, None], jax.tree.map(lambda t: t[:, None], tiles_KSX),
                    trips(segment_ids_BS), trips(cos_BSP2), trips(sin_BSP2), tokens_KS[:, None])
            with weights_gathered():
                _, (y_K1SD, stats_K) = scan(self, None, rows, router_bias_E)
            stats = {key: value.max(axis=0) if key.endswith("max_H") else value.sum(axis=0)
                     for key, value in stats_K.items()}
            return y_K1SD[:, 0], stats

    return nn.map_variables(RowLoopedBlock, "params",
                            trans_in_fn=lambda variables: _gather_under_spmd(variables, cfg, ex,
                                                                             stack),
                            init=True, mutable=False)


def _gather_under_spmd(variables, cfg: ModelConfig, ex: ExecutionConfig, stack: str):
    if comm.current() is None:  # unsharded use: the block computes as without the loop
        return variables
    # named as the layers' own gathers are without the loop: the plan tells the first
    # layers' gathers and last reduce-scatters (the step's fill and drain) by that name
    with jax.named_scope(stack):
        return {collection: gathered(params, cfg, ex) for collection, params in variables.items()}
