"""The evaluation forward: the run's model on the run's mesh, rows sharded like training's.

Two programs, compiled once per run, over the same rows `[data.global_batch_size,
train.eval_tasks_seq_len]` (the training rows unless that key shortens them):
- `score`: each position's log-probability of its target and whether the target is the
  greedy choice, for lm-eval's log-likelihoods (packing.py lays requests out in the rows);
- `next_tokens`: each row's greedy next token after a given position, for generation.

Both run the model as `Trainer.loss` does: one `shard_map` over the whole mesh, every
device holding its rows and its parameter shards, the weights gathered and the MoE
tokens exchanged by the model itself (parallel/comm.py). The model differs from the
trained one in one setting only: the MoE is dropless (`model.moe_capacity_factor` null),
because a dropped token changes one request's score depending on what else shares its
batch. Softmax and argmax run on each device's own rows inside the shard_map, so only
`[rows, length]` numbers leave it (replicated: every process reads the same results, and
every process runs lm-eval alike). The vocabulary: log-probabilities are normalized over
the model's whole vocabulary as in training; the greedy choice is taken among the
tokenizer's ids only (`vocab`), since the model can never usefully emit another.

Cost: the [rows per device, length, vocabulary] float32 logits are the largest buffer,
and no gradient, optimizer or activation for a backward pass is held.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from europa_jax.model.transformer import Transformer
from europa_jax.parallel import comm, offload, sharding
from europa_jax.train.train import Trainer


def eval_rows(trainer: Trainer) -> tuple[int, int]:
    """(rows, positions) of one evaluation forward."""
    train, data = trainer.cfg.train, trainer.cfg.data
    return data.global_batch_size, train.eval_tasks_seq_len or data.seq_len


class EvalForward:
    """`score` and `next_tokens` for the weights given to `use`."""

    def __init__(self, trainer: Trainer, vocab: int):
        self.trainer = trainer
        self.rows, self.length = eval_rows(trainer)
        self.vocab = min(vocab, trainer.cfg.model.vocab_size)
        mesh = trainer.mesh
        placed = trainer.batch_sharding.mesh
        spec = sharding.resolve_spec(("batch", "seq"), (self.rows, self.length),
                                     sharding.mesh_shape_of(mesh))
        self.batch_sharding = NamedSharding(placed, spec)
        self.row_sharding = NamedSharding(placed, P(spec[0]))
        replicated = NamedSharding(placed, P())
        # the trained model's parameters and kernels; only the MoE made dropless
        model = Transformer(dataclasses.replace(trainer.cfg.model, moe_capacity_factor=None),
                            trainer.cfg.execution)
        params_in = trainer.state_shardings.params

        def sharded(body, extra_spec, out_specs):
            """`body(logits, extra, vocab)` on each device's rows; `extra` per position
            (targets) or per row (the last position)."""
            mapped = jax.shard_map(
                functools.partial(_in_context, trainer.spmd, model, body, self.vocab),
                mesh=mesh, in_specs=(trainer.param_specs, P(), spec, spec, spec, extra_spec),
                out_specs=out_specs, check_vma=False)

            def run(params, router_bias_LE, tokens_BS, segments_BS, positions_BS, extra):
                params = offload.to_device(params, params_in)
                return mapped(comm.cast_for_entry(params, trainer.spmd), router_bias_LE,
                              tokens_BS, segments_BS, positions_BS, extra)

            return jax.jit(run, in_shardings=(
                params_in, replicated, self.batch_sharding, self.batch_sharding,
                self.batch_sharding, NamedSharding(placed, extra_spec)), out_shardings=replicated)

        self._score = sharded(_score, spec, (spec, spec))
        self._next = sharded(_next_token, P(spec[0]), P(spec[0]))
        self._params = self._bias = None

    def use(self, params, router_bias_LE) -> "EvalForward":
        """The weights the next calls score with (a train state's, sharded as the trainer's)."""
        self._params, self._bias = params, router_bias_LE
        return self

    def score(self, tokens_BS, segments_BS, positions_BS, targets_BS
              ) -> tuple[np.ndarray, np.ndarray]:
        """(log p(target) float32 [B, S], target is the greedy choice bool [B, S])."""
        return self._call(self._score, tokens_BS, segments_BS, positions_BS, targets_BS)

    def next_tokens(self, tokens_BS, segments_BS, positions_BS, last_B) -> np.ndarray:
        """Each row's greedy token after position `last_B` (int32 [B])."""
        return self._call(self._next, tokens_BS, segments_BS, positions_BS, last_B)

    def _call(self, fn, tokens_BS, segments_BS, positions_BS, extra):
        if self._params is None:
            raise RuntimeError("EvalForward.use(params, router_bias) first")
        put = functools.partial(_global, self.batch_sharding)
        extra = (_global(self.row_sharding, extra) if np.ndim(extra) == 1 else put(extra))
        with jax.set_mesh(self.trainer.mesh):
            out = fn(self._params, self._bias, put(tokens_BS), put(segments_BS),
                     put(positions_BS), extra)
        return jax.tree.map(np.asarray, jax.device_get(out))


def _global(sharding_, host: np.ndarray) -> jax.Array:
    """A host array every process holds whole, as a global array (each process puts only
    its own devices' shards)."""
    host = np.asarray(host, np.int32)
    return jax.make_array_from_callback(host.shape, sharding_, lambda index: host[index])


def _in_context(ctx: comm.SpmdContext, model: Transformer, body, vocab: int, params,
                router_bias_LE, tokens_BS, segments_BS, positions_BS, extra):
    with comm.spmd(ctx):
        logits_BSV, _ = model.apply({"params": params}, tokens_BS, segments_BS, positions_BS,
                                    router_bias_LE)
    return body(logits_BSV, extra, vocab)


def _greedy(logits_BSV, vocab: int):
    """The argmax among the tokenizer's ids."""
    ids_V = jnp.arange(logits_BSV.shape[-1])
    return jnp.argmax(jnp.where(ids_V < vocab, logits_BSV, -jnp.inf), axis=-1).astype(jnp.int32)


def _score(logits_BSV, targets_BS, vocab: int):
    logprobs_BSV = jax.nn.log_softmax(logits_BSV, axis=-1)
    logprob_BS = jnp.take_along_axis(logprobs_BSV, targets_BS[..., None], axis=-1)[..., 0]
    return logprob_BS, _greedy(logits_BSV, vocab) == targets_BS


def _next_token(logits_BSV, last_B, vocab: int):
    logits_BV = logits_BSV[jnp.arange(logits_BSV.shape[0]), last_B]
    return _greedy(logits_BV, vocab)
