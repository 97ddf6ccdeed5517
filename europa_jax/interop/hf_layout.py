"""The Hugging Face `DeepseekV3ForCausalLM` layout: tensor names, transposes, config.json.

Each parameter's HF name and `n_in` are in its row of the table (param_table.py). Our
weights are `x @ W` with logical dimensions kept apart (`w_q_b[Q, H, K]`); HF Linear
weights are `[out, in]` with heads flattened into `out`. Every conversion is therefore
"flatten the first `n_in` dims as in, the rest as out, transpose" — exact, no arithmetic.
Expert stacks `[E, ...]` are written per expert (`mlp.experts.<e>.*`), the aux-loss-free
router bias (train state, not a parameter) as `mlp.gate.e_score_correction_bias`, and the
vocabulary padding rows (there only to divide the mesh) are dropped.

RoPE needs no permutation: we rotate interleaved pairs (x[2i], x[2i+1]), which is what
transformers does with `rope_interleave=True`, DeepSeek-V3's checkpoint convention.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import jax
import numpy as np

from europa_jax import param_table
from europa_jax.config import ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one HF tensor lives in our state: `key[index]`, then `to_hf` with `n_in`."""

    key: str  # Orbax/leaf key, e.g. "params.moe_layers.moe.w_gate"
    index: tuple[int, ...]  # layer (if scanned) and expert (if per-expert)
    n_in: int | None  # leading dims that are the Linear's input; None for the other kinds
    kind: str = "linear"  # linear | expert (one of an [E, in, out] stack) | vector | embedding | lm_head
    # the item's shape as the model uses it; stored with zero padding where it differs
    # (execution.param_pad_multiple, sharding.storage_shape). None: as stored.
    shape: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]
    source: Source
    float32: bool = False  # written as float32 whatever the export dtype (the router)
    # a copy of another tensor of the file (an MTP module's embedding and head, which are
    # the model's own): written on export, not read back on import
    mirror: bool = False


def to_hf(x: np.ndarray, source: Source, vocab_size: int) -> np.ndarray:
    """Our layout → HF layout (a view where possible; callers copy as they cast)."""
    if source.shape is not None and tuple(x.shape) != source.shape:  # drop storage padding
        x = x[tuple(slice(0, n) for n in source.shape)]
    if source.kind == "embedding":
        return x[:vocab_size]
    if source.kind == "lm_head":
        return x[:, :vocab_size].T
    if source.kind == "vector":
        return x
    return x.reshape(math.prod(x.shape[:source.n_in]), -1).T


def from_hf(t: np.ndarray, source: Source, our_shape: tuple[int, ...]) -> np.ndarray:
    """HF layout → our layout for one tensor (vocab and storage padding: zeros)."""
    if source.shape is not None and source.shape != tuple(our_shape):
        ours = from_hf(t, dataclasses.replace(source, shape=None), source.shape)
        return np.pad(ours, [(0, m - n) for n, m in zip(source.shape, our_shape)])
    if source.kind == "embedding":
        return np.concatenate([t, np.zeros((our_shape[0] - t.shape[0], t.shape[1]), t.dtype)])
    if source.kind == "lm_head":
        return np.concatenate([t.T, np.zeros((t.shape[1], our_shape[1] - t.shape[0]), t.dtype)],
                              axis=1)
    if source.kind == "vector":
        return t.reshape(our_shape)
    return t.T.reshape(our_shape)


def hf_shape(our_shape: tuple[int, ...], source: Source, vocab_size: int) -> tuple[int, ...]:
    return to_hf(np.empty(our_shape, np.uint8), source, vocab_size).shape


def block_key(cfg: ModelConfig, layer: int, role: str,
              scanned: bool) -> tuple[str, tuple[int, ...]]:
    """Leaf key and leading index of HF layer `layer`'s `role` (`scanned` stacks,
    `execution.scan_layers`, or unrolled ones);
    layers `n_layers` … are the MTP modules, as DeepSeek-V3's release numbers them."""
    dense_stack, moe_stack, mtp_stack = param_table.STACKS
    if layer >= cfg.n_layers:
        stack, i = mtp_stack, layer - cfg.n_layers
    elif layer >= cfg.n_dense_layers:
        stack, i = moe_stack, layer - cfg.n_dense_layers
    else:
        stack, i = dense_stack, layer
    key, index = param_table.stack_key(stack, i, scanned)
    return f"params.{key}.{role}", index


def state_shapes(abstract_params, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Leaf key (as the checkpoint names it) → stored shape, of the parameters and the
    router bias: the part of the train state the Hugging Face layout maps."""
    shapes = {"params." + ".".join(param_table.key_names(path)): tuple(leaf.shape)
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    shapes[param_table.ROUTER_BIAS.key] = param_table.ROUTER_BIAS.shape(cfg)
    return shapes


def tensors(cfg: ModelConfig, our_shapes: dict[str, tuple[int, ...]],
            scanned: bool) -> Iterator[HFTensor]:
    """Every HF tensor in file order: embedding, layer 0 … L-1, the MTP modules as layers
    L … L+K-1 (with copies of the embedding and head, `mirror`, as DeepSeek-V3 ships them
    and vLLM's `deepseek_mtp` reads them), final norm, LM head.

    `our_shapes` maps the leaf keys of our train state (its parameters and the router
    bias) to their stored shapes, so the plan (names, shapes, bytes, files) is known
    before a single weight is read. Which tensors a layer has is which of the table's
    block roles its stack holds (dense MLP or MoE, shared experts or not).
    """
    v = cfg.vocab_size

    def make(name, key, index, hf: param_table.HF, model_shape, precision, mirror=False):
        per_item = tuple(our_shapes[key][len(index):])
        model_shape = tuple(model_shape)
        source = Source(key, index, hf.n_in, hf.kind,
                        model_shape if model_shape != per_item else None)
        return HFTensor(name, hf_shape(model_shape, dataclasses.replace(source, shape=None), v),
                        source, precision.float32_export, mirror)

    rows = list(param_table.ROWS.items())  # in file order
    first_block = next(i for i, (_, p) in enumerate(rows) if p.where != "model")
    head = rows[:first_block]
    tail = [(role, p) for role, p in rows[first_block:] if p.where == "model"]
    block = [(role, p) for role, p in rows if p.where != "model"]
    for role, p in head:
        yield make(p.hf.name, f"params.{role}", (), p.hf, p.shape(cfg), p.precision)
    bias = param_table.ROUTER_BIAS
    for layer in range(cfg.n_layers + cfg.mtp_layers):
        prefix = f"model.layers.{layer}."
        present = [(role, p) + block_key(cfg, layer, role, scanned) for role, p in block]
        present = [(role, p, key, index) for role, p, key, index in present if key in our_shapes]
        for role, p, key, index in present:
            if p.hf.kind != "expert":
                yield make(prefix + p.hf.name, key, index, p.hf, p.shape(cfg), p.precision)
        if layer >= cfg.n_dense_layers:
            yield make(prefix + bias.hf.name, bias.key, (layer - cfg.n_dense_layers,), bias.hf,
                       bias.shape(cfg)[1:], bias.precision)
            for expert in range(cfg.n_routed_experts):
                for role, p, key, index in present:
                    if p.hf.kind == "expert":
                        yield make(prefix + p.hf.name.format(expert=expert), key,
                                   index + (expert,), p.hf, p.shape(cfg)[1:], p.precision)
        if layer >= cfg.n_layers:  # an MTP module: the shared embedding and head, again
            for role, name in (("embedding", "embed_tokens.weight"),
                               ("lm_head", "shared_head.head.weight")):
                p = param_table.row(role)
                yield make(prefix + name, f"params.{role}", (), p.hf, p.shape(cfg),
                           p.precision, mirror=True)
    for role, p in tail:
        yield make(p.hf.name, f"params.{role}", (), p.hf, p.shape(cfg), p.precision)


# ----------------------------------------------------------------------------- config.json

# HF config key → our ModelConfig field, for everything that is the same number.
SAME_VALUE = {
    "vocab_size": "vocab_size", "hidden_size": "d_model", "intermediate_size": "dense_ffn_dim",
    "moe_intermediate_size": "expert_ffn_dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "n_shared_experts": "n_shared_experts",
    "n_routed_experts": "n_routed_experts", "routed_scaling_factor": "routed_scaling_factor",
    "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "qk_nope_head_dim": "qk_nope_head_dim", "n_group": "n_group", "topk_group": "topk_group",
    "num_experts_per_tok": "top_k", "first_k_dense_replace": "n_dense_layers",
    "norm_topk_prob": "norm_topk_prob", "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta", "max_position_embeddings": "max_position_embeddings",
}
# What our model always is; an HF config that says otherwise is another architecture.
FIXED = {"hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
         "rope_interleave": True, "scoring_func": "sigmoid"}
ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim")


def hf_config(cfg: ModelConfig, dtype: str, eos_token_id: int | None) -> dict:
    """config.json for `DeepseekV3ForCausalLM` (also read by vLLM and SGLang)."""
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           **{hf: getattr(cfg, ours) for hf, ours in SAME_VALUE.items()}, **FIXED,
           "num_key_value_heads": cfg.n_heads, "topk_method": "noaux_tc",
           "num_nextn_predict_layers": cfg.mtp_layers, "attention_dropout": 0.0,
           "initializer_range": cfg.init_std, "torch_dtype": dtype, "use_cache": True,
           "bos_token_id": None, "eos_token_id": eos_token_id}
    # The form DeepSeek-V3's own config.json uses (`rope_scaling` + top-level `rope_theta`):
    # transformers 4 and 5, vLLM and SGLang all read it.
    if cfg.rope_scaling.type == "yarn":
        out["rope_scaling"] = {"type": "yarn", **{k: getattr(cfg.rope_scaling, k)
                                                  for k in ROPE_KEYS}}
    else:
        out["rope_scaling"] = None
    return out


def check_hf_config(hf: dict, cfg: ModelConfig, where: str) -> None:
    """Refuse (one line) an HF config whose architecture or shapes differ from `cfg`."""
    archs = hf.get("architectures") or []
    if "DeepseekV3ForCausalLM" not in archs and hf.get("model_type") != "deepseek_v3":
        raise ConfigError(f"{where}: architectures={archs} model_type={hf.get('model_type')!r}; "
                          "expected DeepseekV3ForCausalLM (DeepSeek-V3/Kimi-K2 layout)")
    rope = _hf_rope(hf)
    for hf_key, ours in SAME_VALUE.items():
        theirs = rope["rope_theta"] if hf_key == "rope_theta" else hf.get(hf_key)
        if theirs is not None and not _same(theirs, getattr(cfg, ours)):
            raise ConfigError(f"{where}: {hf_key}={theirs!r} but the config has "
                              f"model.{ours}={getattr(cfg, ours)!r}")
    for key, value in FIXED.items():
        if key in hf and hf[key] != value:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (expected {value!r})")
    mtp = hf.get("num_nextn_predict_layers") or 0
    if cfg.mtp_layers > mtp:
        raise ConfigError(f"{where}: num_nextn_predict_layers={mtp} but the config has "
                          f"model.mtp_layers={cfg.mtp_layers} (more MTP modules than it holds)")
    heads = hf.get("num_key_value_heads", cfg.n_heads)
    if heads != cfg.n_heads:
        raise ConfigError(f"{where}: num_key_value_heads={heads} must equal num_attention_heads")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if (kind == "yarn") != (cfg.rope_scaling.type == "yarn") or kind not in ("yarn", "default"):
        raise ConfigError(f"{where}: rope type {kind!r} but the config has "
                          f"model.rope_scaling.type={cfg.rope_scaling.type!r}")
    if kind == "yarn":
        for key in ROPE_KEYS:
            if key in rope and not _same(rope[key], getattr(cfg.rope_scaling, key)):
                raise ConfigError(f"{where}: rope {key}={rope[key]!r} but the config has "
                                  f"model.rope_scaling.{key}={getattr(cfg.rope_scaling, key)!r}")


def _hf_rope(hf: dict) -> dict:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return rope


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b
