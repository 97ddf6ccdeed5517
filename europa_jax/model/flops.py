"""Parameter counts and analytic FLOPs, from shapes only (nothing is allocated).

Conventions (those of the DeepSeek-V3 and Kimi-K2 model cards): `total` counts every
parameter of the unpadded main model; `active` counts what one token uses — all of it
except the routed experts it was not sent to. Both include the embedding and the LM head.
The multi-token prediction modules (model.mtp_layers) are counted apart, `mtp_params`,
without the embedding and head they share (DeepSeek-V3's "14B MTP module weights"
count the copies of both its release ships); training FLOPs include them.
"""

from __future__ import annotations

import numpy as np

from europa_jax import param_table
from europa_jax.config import ModelConfig


def _counts(cfg: ModelConfig, copies=param_table.layer_count) -> dict[str, int]:
    """Per kind, the main model's parameters (no storage padding, no vocabulary padding
    rows); with `copies=param_table.mtp_count`, the MTP modules'."""
    counts = {"total": 0, "routed": 0, "embedding": 0, "vectors": 0}
    for row in param_table.ROWS.values():
        n = copies(row, cfg) * param_table.size(row, cfg)
        if "vocab" in row.axes:  # padding rows only make the mesh divide
            n = n // cfg.padded_vocab_size * cfg.vocab_size
        counts["total"] += n
        counts["routed"] += n if "experts" in row.axes else 0
        counts["embedding"] += n if row.hf.kind == "embedding" else 0
        counts["vectors"] += n if row.hf.kind == "vector" else 0
    return counts


def _active(counts: dict[str, int], cfg: ModelConfig) -> int:
    return counts["total"] - counts["routed"] + counts["routed"] * cfg.top_k // cfg.n_routed_experts


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total, active and routed-expert parameter counts of the main model, and the MTP
    modules' own parameters, from the parameter table."""
    counts = _counts(cfg)
    return {"total_params": counts["total"], "active_params": _active(counts, cfg),
            "routed_expert_params": counts["routed"],
            "mtp_params": _counts(cfg, param_table.mtp_count)["total"]}


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights each token multiplies by (forward): active params minus the embedding
    lookup and the norm scales; with MTP modules, theirs and the LM head once more each."""
    counts, mtp = _counts(cfg), _counts(cfg, param_table.mtp_count)
    head = cfg.d_model * cfg.vocab_size
    return (_active(counts, cfg) - counts["embedding"] - counts["vectors"]
            + _active(mtp, cfg) - mtp["vectors"] + cfg.mtp_layers * head)


def causal_pairs(segment_ids_BS: np.ndarray) -> int:
    """Query-key pairs that causal, document-masked attention actually needs (Σ L(L+1)/2)."""
    pairs = 0
    for row in np.asarray(segment_ids_BS):
        _, lengths = np.unique(row[row > 0], return_counts=True)
        pairs += int(np.sum(lengths * (lengths + 1) // 2))
    return pairs


def train_flops(cfg: ModelConfig, n_tokens: int, n_attention_pairs: int) -> float:
    """Forward + backward FLOPs: 6·N per token plus, in every layer (the MTP modules'
    blocks too), 6·(QKᵀ + PV) per visible pair."""
    matmul = 6.0 * matmul_params_per_token(cfg) * n_tokens
    layers = cfg.n_layers + cfg.mtp_layers
    per_pair = 2.0 * layers * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return matmul + 3.0 * per_pair * n_attention_pairs
