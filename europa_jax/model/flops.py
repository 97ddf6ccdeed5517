"""Parameter counts and analytic FLOPs, from shapes only (nothing is allocated).

Conventions (those of the DeepSeek-V3 and Kimi-K2 model cards): `total` counts every
parameter of the unpadded model; `active` counts what one token uses — all of it except
the routed experts it was not sent to. Both include the embedding and the LM head.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from europa_jax.config import ModelConfig


def _path_names(path) -> list[str]:
    return [str(getattr(p, "key", p)) for p in path]


def parameter_counts(cfg: ModelConfig, abstract_params: Any) -> dict[str, int]:
    """Total, active and routed-expert parameter counts of an abstract parameter tree."""
    total = routed = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        names = _path_names(path)
        n = math.prod(leaf.shape)
        if names[-1] in ("embedding", "lm_head"):  # padding rows only make the mesh divide
            n = n // cfg.padded_vocab_size * cfg.vocab_size
        total += n
        if "moe" in names and "shared" not in names and names[-1] in ("w_gate", "w_up", "w_down"):
            routed += n
    active = total - routed + routed * cfg.top_k // cfg.n_routed_experts
    return {"total_params": total, "active_params": active, "routed_expert_params": routed}


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights each token multiplies by (forward): active params minus the embedding lookup."""
    d, h = cfg.d_model, cfg.n_heads
    attention = (d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
                 + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                 + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                 + h * cfg.v_head_dim * d)
    dense_mlp = 3 * d * cfg.dense_ffn_dim
    moe = (d * cfg.n_routed_experts
           + 3 * d * cfg.expert_ffn_dim * (cfg.top_k + cfg.n_shared_experts))
    return (cfg.n_layers * attention + cfg.n_dense_layers * dense_mlp
            + cfg.n_moe_layers * moe + d * cfg.vocab_size)


def causal_pairs(segment_ids_BS: np.ndarray) -> int:
    """Query-key pairs that causal, document-masked attention actually needs (Σ L(L+1)/2)."""
    pairs = 0
    for row in np.asarray(segment_ids_BS):
        _, lengths = np.unique(row[row > 0], return_counts=True)
        pairs += int(np.sum(lengths * (lengths + 1) // 2))
    return pairs


def train_flops(cfg: ModelConfig, n_tokens: int, n_attention_pairs: int) -> float:
    """Forward + backward FLOPs: 6·N per token plus, in every layer, 6·(QKᵀ + PV) per visible pair."""
    matmul = 6.0 * matmul_params_per_token(cfg) * n_tokens
    per_pair = 2.0 * cfg.n_layers * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return matmul + 3.0 * per_pair * n_attention_pairs
