"""The Hugging Face `DeepseekV3ForCausalLM` layout: tensor names, transposes, config.json.

Our weights are `x @ W` with logical dimensions kept apart (`w_q_b[Q, H, K]`); HF Linear
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

import numpy as np

from europa_jax.config import ConfigError, ModelConfig

# Our path inside a block → (HF name inside `model.layers.<i>.`, number of leading "in" dims;
# None for vectors, copied as they are).
ATTENTION = {
    "attention.w_q_a": ("self_attn.q_a_proj.weight", 1),
    "attention.q_a_norm.scale": ("self_attn.q_a_layernorm.weight", None),
    "attention.w_q_b": ("self_attn.q_b_proj.weight", 1),
    "attention.w_kv_a": ("self_attn.kv_a_proj_with_mqa.weight", 1),
    "attention.kv_a_norm.scale": ("self_attn.kv_a_layernorm.weight", None),
    "attention.w_kv_b": ("self_attn.kv_b_proj.weight", 1),
    "attention.w_o": ("self_attn.o_proj.weight", 2),
    "attention_norm.scale": ("input_layernorm.weight", None),
    "mlp_norm.scale": ("post_attention_layernorm.weight", None),
}
DENSE_MLP = {
    "mlp.w_gate": ("mlp.gate_proj.weight", 1),
    "mlp.w_up": ("mlp.up_proj.weight", 1),
    "mlp.w_down": ("mlp.down_proj.weight", 1),
}
MOE = {
    "moe.w_router": ("mlp.gate.weight", 1),
    "moe.shared.w_gate": ("mlp.shared_experts.gate_proj.weight", 1),
    "moe.shared.w_up": ("mlp.shared_experts.up_proj.weight", 1),
    "moe.shared.w_down": ("mlp.shared_experts.down_proj.weight", 1),
}
EXPERTS = {  # [E, in, out] stacks, one HF tensor per expert
    "moe.w_gate": "gate_proj.weight",
    "moe.w_up": "up_proj.weight",
    "moe.w_down": "down_proj.weight",
}
ROUTER_BIAS = "router_bias_LE"
ROUTER_BIAS_NAME = "mlp.gate.e_score_correction_bias"
# Routing decides discrete choices: transformers keeps these two in float32 whatever the
# model dtype, and so do we on export.
FLOAT32_ALWAYS = ("mlp.gate.weight", ROUTER_BIAS_NAME)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one HF tensor lives in our state: `key[index]`, then `to_hf` with `n_in`."""

    key: str  # Orbax/leaf key, e.g. "params.moe_layers.moe.w_gate"
    index: tuple[int, ...]  # layer (if scanned) and expert (if per-expert)
    n_in: int | None  # leading dims that are the Linear's input; None for the other kinds
    kind: str = "linear"  # linear | expert (one of an [E, in, out] stack) | vector | embedding | lm_head
    # the item's shape as the model uses it; stored with zero padding where it differs
    # (model.param_pad_multiple, sharding.storage_shape). None: as stored.
    shape: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]
    source: Source


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


def block_key(cfg: ModelConfig, layer: int, path: str) -> tuple[str, tuple[int, ...]]:
    """Leaf key and leading index of HF layer `layer`'s `path` (scanned or unrolled stacks)."""
    moe = layer >= cfg.n_dense_layers
    stack, i = ("moe_layers", layer - cfg.n_dense_layers) if moe else ("dense_layers", layer)
    if cfg.scan_layers:
        return f"params.{stack}.{path}", (i,)
    return f"params.{stack}_{i}.{path}", ()


def tensors(cfg: ModelConfig, our_shapes: dict[str, tuple[int, ...]],
            model_shapes: dict[str, tuple[int, ...]] | None = None) -> Iterator[HFTensor]:
    """Every HF tensor in file order: embedding, layer 0 … L-1, final norm, LM head.

    `our_shapes` maps leaf keys to shapes (of our abstract state), so the plan (names,
    shapes, bytes, files) is known before a single weight is read; `model_shapes` the same
    keys to the shapes the model uses (checkpoint.model_param_shapes), where storage pads.
    """
    v = cfg.vocab_size
    model_shapes = model_shapes or {}

    def make(name, key, index, n_in, kind="linear"):
        per_item = tuple(our_shapes[key][len(index):])
        used = tuple(model_shapes.get(key, our_shapes[key])[len(index):])
        source = Source(key, index, n_in, kind, used if used != per_item else None)
        return HFTensor(name, hf_shape(used, dataclasses.replace(source, shape=None), v),
                        source)

    yield make("model.embed_tokens.weight", "params.embedding", (), None, "embedding")
    for layer in range(cfg.n_layers):
        prefix = f"model.layers.{layer}."
        moe = layer >= cfg.n_dense_layers
        for path, (name, n_in) in {**ATTENTION, **(MOE if moe else DENSE_MLP)}.items():
            if path.startswith("moe.shared.") and not cfg.n_shared_experts:
                continue
            key, index = block_key(cfg, layer, path)
            yield make(prefix + name, key, index, n_in, "vector" if n_in is None else "linear")
        if moe:
            yield make(prefix + ROUTER_BIAS_NAME, ROUTER_BIAS, (layer - cfg.n_dense_layers,),
                       None, "vector")
            for expert in range(cfg.n_routed_experts):
                for path, name in EXPERTS.items():
                    key, index = block_key(cfg, layer, path)
                    yield make(f"{prefix}mlp.experts.{expert}.{name}", key, index + (expert,), 1,
                               "expert")
    yield make("model.norm.weight", "params.final_norm.scale", (), None, "vector")
    yield make("lm_head.weight", "params.lm_head", (), None, "lm_head")


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
           "num_nextn_predict_layers": 0, "attention_dropout": 0.0,
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
