"""Train state and the pure train step (the loop that runs it is loop.py).

State is built shape-only first (`jax.eval_shape`), shardings are derived from the
logical names, and only then is a jitted init run with `out_shardings`: no array is ever
materialized unsharded, and the same abstract tree serves restore and planning.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from europa_jax import optim, sharding
from europa_jax.config import Config
from europa_jax.model.moe import updated_router_bias
from europa_jax.model.transformer import Transformer, init_router_bias

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
    state_shardings: TrainState
    batch_sharding: NamedSharding
    abstract_params: Any  # ShapeDtypeStructs, unboxed


def dummy_batch(cfg: Config, batch_size: int | None = None) -> Batch:
    b, s = batch_size or cfg.data.global_batch_size, cfg.data.seq_len
    return {"tokens": jnp.zeros((b, s), jnp.int32), "segment_ids": jnp.ones((b, s), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))}


def abstract_variables(cfg: Config) -> Any:
    """Boxed (logically named) abstract parameters, from shapes alone."""
    model = Transformer(cfg.model)
    batch = dummy_batch(cfg, batch_size=1)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), batch["tokens"],
                                             batch["segment_ids"], batch["positions"],
                                             init_router_bias(cfg.model)))["params"]


def build_trainer(cfg: Config, mesh: Mesh) -> Trainer:
    model = Transformer(cfg.model)
    tx = optim.build_optimizer(cfg.optim, cfg.train.steps)
    boxed = abstract_variables(cfg)
    param_specs = sharding.specs_for(boxed, sharding.mesh_shape_of(mesh))
    abstract_params = nn.unbox(boxed)
    param_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs,
                                   is_leaf=lambda x: isinstance(x, P))
    replicated = NamedSharding(mesh, P())
    opt_shardings = shardings_like_params(jax.eval_shape(tx.init, abstract_params),
                                          abstract_params, param_shardings, replicated)
    state_shardings = TrainState(step=replicated, params=param_shardings,
                                 opt_state=opt_shardings, router_bias_LE=replicated)
    batch_spec = sharding.resolve_spec(("batch", "seq"), (cfg.data.global_batch_size,
                                                          cfg.data.seq_len),
                                       sharding.mesh_shape_of(mesh))
    return Trainer(cfg, mesh, model, tx, state_shardings, NamedSharding(mesh, batch_spec),
                   abstract_params)


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


def init_state(trainer: Trainer, seed: int) -> TrainState:
    """Parameters and optimizer state created directly in their shards."""
    cfg = trainer.cfg

    def init(key):
        batch = dummy_batch(cfg, batch_size=1)
        variables = trainer.model.init(key, batch["tokens"], batch["segment_ids"],
                                       batch["positions"], init_router_bias(cfg.model))
        params = nn.unbox(variables["params"])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=trainer.tx.init(params),
                          router_bias_LE=init_router_bias(cfg.model))

    with jax.set_mesh(trainer.mesh):
        return jax.jit(init, out_shardings=trainer.state_shardings)(jax.random.key(seed))


def loss_and_stats(model: Transformer, params, router_bias_LE, batch: Batch):
    """Mean next-token cross entropy over tokens whose successor is in the same document."""
    logits_BSV, stats = model.apply({"params": params}, batch["tokens"], batch["segment_ids"],
                                    batch["positions"], router_bias_LE)
    tokens_BS, segments_BS = batch["tokens"], batch["segment_ids"]
    targets_BS = jnp.roll(tokens_BS, -1, axis=1)
    same_doc_BS = (jnp.roll(segments_BS, -1, axis=1) == segments_BS) & (segments_BS > 0)
    weight_BS = same_doc_BS.at[:, -1].set(False).astype(jnp.float32)
    nll_BS = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS)
    loss = jnp.sum(nll_BS * weight_BS) / jnp.maximum(weight_BS.sum(), 1.0)
    return loss, stats


def train_step(state: TrainState, batch: Batch, *, model: Transformer,
               tx: optax.GradientTransformation, cfg: Config):
    """One optimizer step; pure, so it is jitted once with shardings and donation."""
    grad_fn = jax.value_and_grad(functools.partial(loss_and_stats, model), has_aux=True)
    (loss, stats), grads = grad_fn(state.params, state.router_bias_LE, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    counts_LE = stats["expert_counts_E"]
    router_bias_LE = updated_router_bias(state.router_bias_LE, counts_LE,
                                         cfg.model.router_bias_update_rate)
    load_LE = counts_LE.astype(jnp.float32)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "finite": finite,
        "lr": optim.schedule(cfg.optim, cfg.train.steps)(state.step),
        "expert_load_max_over_mean": jnp.mean(load_LE.max(-1) / load_LE.mean(-1)),
        "moe_dropped_fraction": 1.0 - stats["processed_copies"].sum()
        / stats["routed_copies"].sum(),
    }
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
    step = functools.partial(train_step, model=trainer.model, tx=trainer.tx, cfg=trainer.cfg)
    return jax.jit(step, in_shardings=(trainer.state_shardings, trainer.batch_sharding),
                   out_shardings=(trainer.state_shardings, None), donate_argnums=0)
