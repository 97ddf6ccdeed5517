"""Train state and the pure train step (the loop that runs it is run/loop.py).

State is built shape-only first (`abstract_params`: the model's init traced with
`jax.eval_shape`, the one derivation of the parameters' structure), shardings come from
each parameter's layout on the mesh (parallel/layout.py, from the parameter table), and
only then is a jitted init run with `out_shardings`: no array is ever materialized
unsharded, and the same abstract state (`Trainer.abstract_state`) serves restore,
planning and import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from europa_jax import param_table
from europa_jax.config import Config, ConfigError, ExecutionConfig, ModelConfig
from europa_jax.model import kernels
from europa_jax.model.experts.moe import updated_router_bias
from europa_jax.model.transformer import init_router_bias, Transformer
from europa_jax.parallel import comm, layout, offload, sharding
from europa_jax.parallel.layout import Layout
from europa_jax.train import optim, qk_clip
from europa_jax.train.objective import loss_and_stats, loss_denominators, target_weights

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    router_bias_LE: jax.Array  # aux-loss-free balancing bias, outside the gradient


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The pieces a run is made of; `build_trainer` derives them from a config and a mesh."""

    cfg: Config
    mesh: Mesh
    model: Transformer
    tx: optax.GradientTransformation
    layout: Layout  # every parameter's layout on this mesh, resolved once
    state_shardings: TrainState
    # the train state's shapes, dtypes and shardings: what restore, plan and import use
    abstract_state: TrainState
    batch_sharding: NamedSharding
    param_specs: Any  # PartitionSpecs of the parameters
    spmd: comm.SpmdContext

    @property
    def abstract_params(self) -> Any:
        return self.abstract_state.params

    def loss(self, params, router_bias_LE, batch: Batch, denominators=None):
        """`loss_and_stats` run as one shard_map over the whole mesh (explicit SPMD).

        Inside, every device holds its batch rows and parameter shards; the model gathers
        each weight where it is used and exchanges MoE tokens itself (comm.py), so all
        communication of the forward and backward pass is explicit in the lowered HLO.
        `denominators` (`loss_denominators`): divide the summed losses by these instead of
        this batch's own counts (a microbatch's share of the global batch's means:
        `gradients`); 0 = the batch's own.
        """
        batch_spec = self.batch_sharding.spec
        body = functools.partial(_loss_in_context, self.spmd, self.model)
        sharded = jax.shard_map(
            body, mesh=self.mesh,
            in_specs=(self.param_specs, P(), {k: batch_spec for k in batch}, P()),
            out_specs=(P(), P()), check_vma=False)
        if denominators is None:  # 0: this batch's own counts
            denominators = jnp.zeros((2 + self.cfg.model.mtp_layers,), jnp.float32)
        return sharded(comm.cast_for_entry(params, self.spmd), router_bias_LE, batch,
                       denominators)


def dummy_batch(cfg: Config, batch_size: int | None = None) -> Batch:
    b, s = batch_size or cfg.data.global_batch_size, cfg.data.seq_len
    return {"tokens": jnp.zeros((b, s), jnp.int32), "segment_ids": jnp.ones((b, s), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))}


def abstract_params(cfg: Config) -> Any:
    """The parameter tree as ShapeDtypeStructs (stored shapes, no shardings), from the
    model's own init traced shape-only: the one derivation of the parameters' structure."""
    return _abstract_params(cfg.model, cfg.execution, cfg.data.seq_len)


@functools.lru_cache(maxsize=16)
def _abstract_params(model_cfg: ModelConfig, ex: ExecutionConfig, seq_len: int) -> Any:
    model = Transformer(model_cfg, ex)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    return jax.eval_shape(lambda: model.init(
        jax.random.key(0), tokens, jnp.ones_like(tokens),
        jnp.arange(seq_len, dtype=jnp.int32)[None], init_router_bias(model_cfg)))["params"]


def build_trainer(cfg: Config, mesh: Mesh) -> Trainer:
    model = Transformer(cfg.model, cfg.execution, remat_policy=offload.remat_policy(cfg.offload),
                        row_trip_policy=offload.row_trip_policy(cfg.offload, cfg.execution.remat))
    mesh_shape = sharding.mesh_shape_of(mesh)
    on_mesh = layout.for_mesh(cfg.model, mesh_shape,
                              pad_multiple=cfg.execution.param_pad_multiple)
    shapes = abstract_params(cfg)
    param_specs = on_mesh.specs(shapes)
    # the optimizer lays Muon's matrices out over this mesh (one whole matrix per device)
    # and scales them by the model's shapes (else the stored ones: the same if unpadded)
    padded = cfg.execution.param_pad_multiple > 1
    tx = optim.build_optimizer(cfg.optim, cfg.train.steps, mesh, param_specs,
                               model_shapes=param_table.model_shapes(shapes, cfg.model) if padded
                               else None)
    placed_on = sharding.placement_mesh(mesh)
    param_shardings = jax.tree.map(lambda spec: NamedSharding(placed_on, spec), param_specs,
                                   is_leaf=lambda x: isinstance(x, P))
    replicated = NamedSharding(placed_on, P())
    opt_shapes = jax.eval_shape(tx.init, shapes)
    opt_shardings = shardings_like_params(opt_shapes, shapes, param_shardings, replicated)
    state_shardings = offload.place_state(
        TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                   router_bias_LE=replicated),
        TrainState(step=None, params=shapes, opt_state=opt_shapes, router_bias_LE=None),
        cfg.offload)
    state_shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=shapes,
                              opt_state=opt_shapes, router_bias_LE=jax.ShapeDtypeStruct(
                                  param_table.ROUTER_BIAS.shape(cfg.model), jnp.float32))
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            state_shapes, state_shardings)
    batch_spec = sharding.resolve_spec(("batch", "seq"), (cfg.data.global_batch_size,
                                                          cfg.data.seq_len), mesh_shape)
    return Trainer(cfg, mesh, model, tx, on_mesh, state_shardings, abstract,
                   NamedSharding(placed_on, batch_spec), param_specs,
                   spmd_context(cfg, mesh, on_mesh))


def spmd_context(cfg: Config, mesh: Mesh, on_mesh: Layout) -> comm.SpmdContext:
    """What the model's collectives and kernels need: the parameters' layout on the mesh,
    the wire settings and the platform of the mesh's devices (which may be GPUs compiled
    for on a CPU machine)."""
    exchange = cfg.comm.expert_exchange
    platform = sharding.mesh_platform(mesh)
    if exchange == "auto":
        exchange = "dense" if platform == "cpu" else "ragged"
    kernels.grouped_matmul_impl(cfg.execution, platform)  # a kernel this platform lacks: fail now
    kernels.attention_impl(cfg.execution, platform)
    return comm.SpmdContext(layout=on_mesh, comm=dataclasses.replace(
        cfg.comm, expert_exchange=exchange), platform=platform,
        devices_per_node=cfg.mesh.devices_per_node)


def shardings_like_params(tree: Any, abstract_params: Any, param_shardings: Any,
                          replicated: NamedSharding) -> Any:
    """Shard each optimizer-state leaf like the parameter whose key path it ends with.

    (optax.tree_map_params cannot see through `optax.partition`'s masked states.) Small
    leaves such as step counts or Newton–Schulz coefficients are replicated; a larger leaf
    without a parameter is an error, so no parameter-sized buffer is silently replicated.
    """
    by_path = {tuple(path): (leaf.shape, shard) for (path, leaf), shard in zip(
        jax.tree_util.tree_flatten_with_path(abstract_params)[0], jax.tree.leaves(param_shardings))}

    def choose(path, leaf):
        for start in range(len(path)):
            match = by_path.get(tuple(path[start:]))
            if match and match[0] == leaf.shape:
                return match[1]
        if leaf.size <= 64:
            return replicated
        raise ValueError(f"optimizer state {jax.tree_util.keystr(path)} {leaf.shape} matches "
                         "no parameter")

    return jax.tree_util.tree_map_with_path(choose, tree)


def _init_fn(trainer: Trainer):
    cfg = trainer.cfg

    def init(key):
        batch = dummy_batch(cfg, batch_size=1)
        variables = trainer.model.init(key, batch["tokens"], batch["segment_ids"],
                                       batch["positions"], init_router_bias(cfg.model))
        params = nn.unbox(variables["params"])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=trainer.tx.init(params),
                          router_bias_LE=init_router_bias(cfg.model))

    return init


def init_state(trainer: Trainer, seed: int) -> TrainState:
    """Parameters and optimizer state created directly in their shards."""
    with jax.set_mesh(trainer.mesh):
        return jax.jit(_init_fn(trainer), out_shardings=trainer.state_shardings)(
            jax.random.key(seed))


def abstract_batch(trainer: Trainer) -> Batch:
    shape = (trainer.cfg.data.global_batch_size, trainer.cfg.data.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=trainer.batch_sharding)
            for k in ("tokens", "segment_ids", "positions")}


def _loss_in_context(ctx: comm.SpmdContext, model: Transformer, params, router_bias_LE, batch,
                     denominators):
    with comm.spmd(ctx):
        return loss_and_stats(model, params, router_bias_LE, batch, denominators)


def eval_step(state: TrainState, batch: Batch, *, trainer: Trainer):
    """(mean next-token loss, number of targets) of a batch: the training forward, no update."""
    params = offload.to_device(state.params, trainer.state_shardings.params)
    _, stats = trainer.loss(params, state.router_bias_LE, batch)
    return stats["lm_loss"], target_weights(batch["segment_ids"]).sum()


def jit_eval_step(trainer: Trainer):
    step = functools.partial(eval_step, trainer=trainer)
    return jax.jit(step, in_shardings=(trainer.state_shardings, trainer.batch_sharding))


def microbatches(trainer: Trainer, batch: Batch) -> Batch:
    """The global batch as `train.microbatches` microbatches stacked on a leading axis:
    microbatch i holds the i-th share of every device's own rows (device-major rows), so
    the split moves nothing between devices."""
    m = trainer.cfg.train.microbatches
    batch_axes = trainer.batch_sharding.spec[0]
    named = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    shape = sharding.mesh_shape_of(trainer.mesh)
    shards = math.prod(shape[a] for a in named)

    def split(x_BS):
        b, s = x_BS.shape
        x_MBS = x_BS.reshape(shards, m, b // (shards * m), s).swapaxes(0, 1).reshape(
            m, b // m, s)
        return jax.lax.with_sharding_constraint(
            x_MBS, NamedSharding(trainer.batch_sharding.mesh, P(None, batch_axes, None)))

    return {k: split(v) for k, v in batch.items()}


def merge_stats(a: dict, b: dict) -> dict:
    """Two microbatches' stats as one batch's: maxima (attention logits) by max, counts
    (expert loads, routed and exchanged rows, dispatches) by sum."""
    return {k: jnp.maximum(a[k], b[k]) if "max" in k else a[k] + b[k] for k in a}


def gradients(trainer: Trainer, params, router_bias_LE, batch: Batch):
    """((loss, stats), gradients) of the global batch's mean loss.

    With `train.microbatches` m > 1 the batch runs in m pieces (a `lax.scan`: each piece
    gathers the weights again and holds only its own activations). Each piece's summed
    loss is divided by the *global* batch's target count, so the pieces' losses and
    gradients add up to exactly the whole batch's (gradients summed in float32, in the
    parameters' shardings); stats merge as one batch's (`merge_stats`), so the router-bias
    update and QK-clip see the whole batch.
    """
    grad_fn = jax.value_and_grad(trainer.loss, has_aux=True)
    m = trainer.cfg.train.microbatches
    if m == 1:
        return grad_fn(params, router_bias_LE, batch)
    denominators = loss_denominators(trainer.cfg.model, batch["segment_ids"])
    pieces = microbatches(trainer, batch)
    first = jax.tree.map(lambda x: x[0], pieces)
    _, stats_shape = jax.eval_shape(trainer.loss, params, router_bias_LE, first, denominators)
    param_shardings = jax.tree.map(lambda s: s.with_memory_kind("device"),
                                   trainer.state_shardings.params)

    def zeros(p, s):
        return jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s)

    def add(carry, piece):
        loss, stats, grads = carry
        (loss_i, stats_i), grads_i = grad_fn(params, router_bias_LE, piece, denominators)
        grads = jax.tree.map(lambda g, gi: g + gi.astype(jnp.float32), grads, grads_i)
        return (loss + loss_i, merge_stats(stats, stats_i), grads), None

    init = (jnp.zeros((), jnp.float32),
            {k: jnp.full(v.shape, -jnp.inf if "max" in k else 0, v.dtype)
             for k, v in stats_shape.items()},
            jax.tree.map(zeros, params, param_shardings))
    (loss, stats, grads), _ = jax.lax.scan(add, init, pieces)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return (loss, stats), grads


def train_step(state: TrainState, batch: Batch, *, trainer: Trainer):
    """One optimizer step; pure, so it is jitted once with shardings and donation."""
    cfg, tx = trainer.cfg, trainer.tx
    # Offloaded leaves arrive in host memory; out_shardings send the new ones back there.
    state = state.replace(params=offload.to_device(state.params, trainer.state_shardings.params),
                          opt_state=offload.to_device(state.opt_state,
                                                      trainer.state_shardings.opt_state))
    (loss, stats), grads = gradients(trainer, state.params, state.router_bias_LE, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # MuonClip: heads whose logits of this forward exceeded τ are scaled back (no-op if off)
    logit_max_LH = stats["attention_logit_max_LH"]
    replicated = NamedSharding(sharding.placement_mesh(trainer.mesh), P())
    params, heads_clipped = qk_clip.clip(params, logit_max_LH, cfg.optim.qk_clip_threshold,
                                         cfg.model, replicated,
                                         scanned=cfg.execution.scan_layers)
    counts_LE = stats["expert_counts_E"]
    router_bias_LE = updated_router_bias(state.router_bias_LE, counts_LE,
                                         cfg.model.router_bias_update_rate)
    load_LE = counts_LE.astype(jnp.float32)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    metrics = {
        "loss": stats["lm_loss"],  # the next-token loss; the objective adds seq_aux_loss
        "grad_norm": grad_norm,
        "finite": finite,
        "lr": optim.schedule(cfg.optim, cfg.train.steps)(state.step),
        "expert_load_max_over_mean": jnp.mean(load_LE.max(-1) / load_LE.mean(-1)),
        # per MoE layer, for the report: the balance and the bias that keeps it
        "expert_load_max_over_mean_per_layer": load_LE.max(-1) / load_LE.mean(-1),
        "router_bias_spread_per_layer": router_bias_LE.max(-1) - router_bias_LE.min(-1),
        "moe_dropped_fraction": 1.0 - stats["processed_copies"].sum()
        / stats["routed_copies"].sum(),
        # token rows that crossed devices in the MoE exchange, per routed token copy (one
        # row per remote expert copy would be moe_remote_copy_fraction)
        "moe_exchanged_rows_per_copy": stats["exchanged_rows"].sum()
        / stats["routed_copies"].sum(),
        "moe_remote_copy_fraction": stats["remote_copies"].sum() / stats["routed_copies"].sum(),
        # dispatches whose rows overflowed the bounded exchange buffers into a second round
        # (exact, slower): near 0 when execution.moe_buffer_factor suits the routing
        "moe_overflow_rounds_per_dispatch": stats["overflow_rounds"].sum()
        / stats["dispatches"].sum(),
        # the largest pre-softmax attention logit (scale·q·k) of the step, before the clip
        "attention_logit_max": logit_max_LH.max(),
        "attention_logit_max_per_layer": logit_max_LH.max(axis=-1),
        "qk_clip_heads_clipped": heads_clipped,
    }
    for extra in ("seq_aux_loss", "mtp_loss"):  # in the objective when configured
        if extra in stats:
            metrics[extra] = stats[extra]
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           router_bias_LE=router_bias_LE)
    return revert_if_nonfinite(finite, new_state, state), metrics


def revert_if_nonfinite(finite: jax.Array, new: TrainState, old: TrainState) -> TrainState:
    """`new`, or `old` with the step counted when the loss or a gradient was NaN/Inf.

    One bad batch (or an overflow) must not poison the weights or the Adam/Muon moments;
    the loop's `checkpoint.nan_policy` decides whether the run goes on. The step still
    advances so that the step count keeps matching the batches consumed.
    """
    kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return kept.replace(step=new.step)


def jit_train_step(trainer: Trainer):
    step = functools.partial(train_step, trainer=trainer)
    return jax.jit(step, in_shardings=(trainer.state_shardings, trainer.batch_sharding),
                   out_shardings=(trainer.state_shardings, None), donate_argnums=0)
