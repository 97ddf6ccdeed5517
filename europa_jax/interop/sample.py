"""`europa-jax sample RUN_DIR --prompt TEXT`: text from a run's checkpoint, with our own model.

The checkpoint's parameters are read from disk (like export, verified against their
fingerprints) onto one device, the prompt is encoded with the run's tokenizer
(hf_tokenizer_files.run_tokenizer), and tokens are generated one at a time, greedily
(temperature 0, the default) or by sampling from softmax(logits / temperature) with a
seeded key, until EOS or `max_new_tokens`.

Tokens come from multi-head latent attention's cache (model/decode.py): the prompt runs
once, then each new token is one position's forward against every layer's cached latents
and RoPE'd keys — O(length) work per token. The cache holds prompt + max_new_tokens
positions. `generate(cached=False)` is the reference it is tested against: the training
model's forward (model/transformer.py) over the whole row for every token, real tokens in
segment 1 and padding in segment 0 after them, which causal attention never lets a real
token see. Both run outside the SPMD step with the exact pure-JAX kernels (blockwise
attention, blocked expert matmul), dropless MoE and no remat, on any one device. Ids past
the tokenizer's vocabulary (model.vocab_size may be larger) are never produced.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np

from europa_jax import param_table
from europa_jax.config import Config, ConfigError, ExecutionConfig, ModelConfig
from europa_jax.config_loader import from_dict
from europa_jax.data.corpus import DataError
from europa_jax.interop import hf_tokenizer_files
from europa_jax.job import exit_codes
from europa_jax.store import saved_checkpoints

DEFAULT_MAX_NEW_TOKENS = 64


class SampleError(ConfigError):
    """Bad input to `sample` (run directory, checkpoint, prompt, lengths); one line."""


@dataclasses.dataclass(frozen=True)
class Sample:
    text: str              # the generated continuation, EOS not included
    ids: list[int]         # generated ids (ending in EOS when it stopped there)
    prompt_ids: list[int]
    stop: str              # "eos" | "max_new_tokens"
    step: int              # the checkpoint's step

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def sampling_configs(cfg: Config) -> tuple[ModelConfig, ExecutionConfig]:
    """The run's model (dropless) and the kernels and settings of a one-device forward."""
    return (dataclasses.replace(cfg.model, moe_capacity_factor=None),
            dataclasses.replace(cfg.execution, attention="blockwise", grouped_matmul="blocked",
                                moe_chunk_tokens=0, remat="none"))


def read_parameters(run_dir: str | Path, step: int | None = None
                    ) -> tuple[Config, dict, np.ndarray, int]:
    """(config, nested parameters, router bias [L, E], step) of a checkpoint, as host
    arrays in their stored shapes, each checked against its saved fingerprint."""
    step_dir = saved_checkpoints.step_dir_of(run_dir, step, "sample from", SampleError)
    meta = saved_checkpoints.read_meta(step_dir)
    cfg: Config = from_dict(Config, meta["config"])
    params: dict = {}
    bias = None
    for key, expected in meta["fingerprint"].items():
        if not (key.startswith("params.") or key == param_table.ROUTER_BIAS.key):
            continue
        value = saved_checkpoints.open_saved_array(step_dir, key).read().result()
        if saved_checkpoints.host_bit_sum(value) != expected:
            raise saved_checkpoints.CheckpointError(
                f"{step_dir}: {key} does not match its saved fingerprint (corrupted "
                "checkpoint); sample another --step")
        if key == param_table.ROUTER_BIAS.key:
            bias = value
            continue
        *parents, leaf = key.split(".")[1:]
        node = params
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    if bias is None:
        raise saved_checkpoints.CheckpointError(
            f"{step_dir}: no {param_table.ROUTER_BIAS.key} in the checkpoint")
    return cfg, params, bias, int(meta["step"])


class Sampler:
    """A checkpoint's model and tokenizer, ready to generate (load once, sample often)."""

    def __init__(self, run_dir: str | Path, step: int | None = None,
                 tokenizer: str | Path | None = None):
        import jax
        import jax.numpy as jnp

        from europa_jax.model.decode import CachedTransformer
        from europa_jax.model.transformer import Transformer

        self.cfg, params, bias, self.step = read_parameters(run_dir, step)
        run_tok, why = hf_tokenizer_files.run_tokenizer(self.cfg, tokenizer)
        if run_tok is None:
            raise SampleError(f"{run_dir}: the run's tokenizer is unknown: {why}")
        self.run_tokenizer = run_tok
        self.tokenizer = run_tok.load()
        self.model_cfg, self.execution = sampling_configs(self.cfg)
        self.params = jax.tree.map(jnp.asarray, params)
        self.bias = jnp.asarray(bias)
        # what can be emitted: the tokenizer's ids that the model has
        self.vocab = min(run_tok.vocab_size, self.model_cfg.vocab_size)
        model = Transformer(self.model_cfg, self.execution)
        cached_model = CachedTransformer(self.model_cfg, self.execution)
        vocab = self.vocab

        def choose(logits_V, key, temperature):
            """Greedy at temperature 0, else a draw from softmax(logits / temperature)."""
            logits_V = jnp.where(jnp.arange(logits_V.shape[0]) < vocab, logits_V, -jnp.inf)
            greedy = jnp.argmax(logits_V).astype(jnp.int32)
            drawn = jax.random.categorical(key, logits_V / jnp.maximum(temperature, 1e-30))
            return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)

        def next_token(params, bias, tokens_S, n, key, temperature):
            """The token after the first `n` of `tokens_S` (the rest is padding)."""
            s = tokens_S.shape[0]
            index_S = jnp.arange(s, dtype=jnp.int32)
            real_S = index_S < n
            segments_S = real_S.astype(jnp.int32)
            positions_S = jnp.where(real_S, index_S, 0)
            logits_1SV, _ = model.apply({"params": params}, tokens_S[None], segments_S[None],
                                        positions_S[None], bias)
            return choose(logits_1SV[0, n - 1], key, temperature)

        def cached_next_token(params, bias, tokens_T, cache, key, temperature):
            """The token after `tokens_T` (the prompt, then each new token) and the cache
            that now holds them too."""
            logits_1V, cache = cached_model.apply({"params": params}, tokens_T[None], cache,
                                                  bias)
            return choose(logits_1V[0], key, temperature), cache

        self._next_token = jax.jit(next_token)
        self._cached_next_token = jax.jit(cached_next_token, donate_argnums=3)

    def encode(self, prompt: str | bytes) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def generate(self, prompt: str | bytes | list[int], *,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
                 seed: int = 0, cached: bool = True) -> Sample:
        """Continue `prompt` (a text, or ids) until EOS or `max_new_tokens` new tokens;
        `cached=False` recomputes the whole row per token (the reference)."""
        import jax
        import jax.numpy as jnp

        check_settings(max_new_tokens, temperature)
        prompt_ids = ([int(i) for i in prompt] if isinstance(prompt, list)
                      else self.encode(prompt))
        if not prompt_ids:
            raise SampleError("--prompt: empty (the model needs at least one token to "
                              "continue)")
        bad = [i for i in prompt_ids if not 0 <= i < self.vocab]
        if bad:
            raise SampleError(f"prompt id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        total = len(prompt_ids) + max_new_tokens
        context = self.model_cfg.max_position_embeddings
        if total > context:
            raise SampleError(f"--max-new-tokens: the prompt's {len(prompt_ids)} tokens + "
                              f"{max_new_tokens} new = {total} > model.max_position_embeddings "
                              f"{context}")
        new_tokens = (self._cached_tokens if cached else self._uncached_tokens)(
            prompt_ids, total, jax.random.key(seed), jnp.float32(temperature))
        eos = self.run_tokenizer.eos_id
        generated, stop = [], "max_new_tokens"
        for token in itertools.islice(new_tokens, max_new_tokens):
            generated.append(token)
            if token == eos:
                stop = "eos"
                break
        text = self.tokenizer.decode([t for t in generated if t != eos])
        return Sample(text=text, ids=generated, prompt_ids=prompt_ids, stop=stop,
                      step=self.step)

    def _cached_tokens(self, prompt_ids: list[int], total: int, key, temperature):
        """The new tokens, one per step of the cached decoder: the prompt's step, then one
        position each (the cache holds `total` positions)."""
        import jax
        import jax.numpy as jnp

        from europa_jax.model.decode import LatentCache
        from europa_jax.model.layers import DTYPES

        cache = LatentCache.empty(self.model_cfg, 1, total, DTYPES[self.execution.compute_dtype])
        feed_T = jnp.asarray(prompt_ids, jnp.int32)
        for i in itertools.count():
            token, cache = self._cached_next_token(self.params, self.bias, feed_T, cache,
                                                   jax.random.fold_in(key, i), temperature)
            yield int(token)
            feed_T = token[None]

    def _uncached_tokens(self, prompt_ids: list[int], total: int, key, temperature):
        """The reference: the whole row (rounded up to the attention block) per token."""
        import jax
        import jax.numpy as jnp

        block = self.execution.attention_block_size
        tokens_S = np.zeros(-(-total // block) * block, np.int32)
        tokens_S[:len(prompt_ids)] = prompt_ids
        for n in itertools.count(len(prompt_ids)):
            token = int(self._next_token(self.params, self.bias, jnp.asarray(tokens_S),
                                         jnp.int32(n), jax.random.fold_in(key, n - len(prompt_ids)),
                                         temperature))
            yield token
            tokens_S[n] = token


def check_settings(max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 1:
        raise SampleError(f"--max-new-tokens: {max_new_tokens} must be >= 1")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise SampleError(f"--temperature: {temperature} must be >= 0 (0 = greedy)")


def sample(run_dir: str | Path, prompt: str | bytes | list[int], *,
           max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
           seed: int = 0, step: int | None = None, tokenizer: str | Path | None = None
           ) -> Sample:
    """Load `run_dir`'s checkpoint (the latest, or `step`) and continue `prompt`."""
    if isinstance(prompt, (str, bytes)) and not prompt:
        raise SampleError("--prompt: empty (the model needs at least one token to continue)")
    check_settings(max_new_tokens, temperature)  # before the checkpoint is read
    return Sampler(run_dir, step, tokenizer).generate(
        prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)


def run(args) -> int:
    """The `sample` command: args has run_dir, prompt, max_new_tokens, temperature, seed,
    step (and optionally json, tokenizer). Prints the generated text (then, with --json,
    one JSON line); a bad input is one line on stderr and exit code 2."""
    from europa_jax.store.saved_checkpoints import CheckpointError

    max_new = getattr(args, "max_new_tokens", None)
    try:
        result = sample(args.run_dir, args.prompt,
                        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
                        temperature=getattr(args, "temperature", None) or 0.0,
                        seed=getattr(args, "seed", None) or 0, step=getattr(args, "step", None),
                        tokenizer=getattr(args, "tokenizer", None))
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"europa-jax: error: {e}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    if getattr(args, "json", False):  # stdout is then JSON alone: the text is in it
        print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        print(result.text)
    return exit_codes.OK
