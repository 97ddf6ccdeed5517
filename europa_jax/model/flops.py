"""Parameter counts and analytic FLOPs, from shapes only (nothing is allocated).

Conventions (those of the DeepSeek-V3 and Kimi-K2 model cards): `total` counts every
parameter of the unpadded model; `active` counts what one token uses — all of it except
the routed experts it was not sent to. Both include the embedding and the LM head.
"""

from __future__ import annotations

import numpy as np

from europa_jax import param_table
from europa_jax.config import ModelConfig


def _counts(cfg: ModelConfig) -> dict[str, int]:
    """Per kind, the model's parameters (no storage padding, no vocabulary padding rows)."""
    counts = {"total": 0, "routed": 0, "embedding": 0, "vectors": 0}
    for row in param_table.ROWS.values():
        n = param_table.layer_count(row, cfg) * param_table.size(row, cfg)
        if "vocab" in row.axes:  # padding rows only make the mesh divide
            n = n // cfg.padded_vocab_size * cfg.vocab_size
        counts["total"] += n
        counts["routed"] += n if "experts" in row.axes else 0
        counts["embedding"] += n if row.hf.kind == "embedding" else 0
        counts["vectors"] += n if row.hf.kind == "vector" else 0
    return counts


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total, active and routed-expert parameter counts, from the parameter table."""
    counts = _counts(cfg)
    total, routed = counts["total"], counts["routed"]
    active = total - routed + routed * cfg.top_k // cfg.n_routed_experts
    return {"total_params": total, "active_params": active, "routed_expert_params": routed}


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights each token multiplies by (forward): active params minus the embedding
    lookup and the norm scales."""
    counts = _counts(cfg)
    return (parameter_counts(cfg)["active_params"] - counts["embedding"] - counts["vectors"])


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
