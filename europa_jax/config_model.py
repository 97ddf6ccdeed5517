"""The model's section of the run configuration: what the model is — DeepSeek-V3 /
Kimi-K2 family shapes, routing and objective: what an exported config.json holds and what
defines the function the model computes (`model:` in a config file). How it runs —
kernels, precision, MoE buffers, recomputation — is config_execution.py's; config.py
holds the other sections and the checks across them. Imports no jax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from europa_jax.config_checks import ConfigError, positive


@dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """YaRN context extension (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V3 uses it."""

    type: Literal["none", "yarn"] = "none"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self):
        positive("model.rope_scaling", self, "factor", "original_max_position_embeddings")
        if self.type == "yarn" and self.factor < 1.0:
            raise ConfigError(f"model.rope_scaling.factor: {self.factor} < 1 makes no sense for yarn")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """DeepSeek-V3 / Kimi-K2 family shapes (MLA attention, sigmoid-routed MoE)."""

    vocab_size: int
    # Rows of the embedding/head are padded to a multiple of this so that the vocab
    # dimension divides the mesh (2^k vocabularies do not divide 96 nodes × 4).
    vocab_pad_multiple: int = 128
    d_model: int
    n_layers: int
    n_dense_layers: int = 1
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dense_ffn_dim: int
    n_routed_experts: int
    n_shared_experts: int = 1
    expert_ffn_dim: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    # Aux-loss-free balancing (DeepSeek-V3 §2.1.2): bias += rate * sign(mean_load - load).
    router_bias_update_rate: float = 1e-3
    # The complementary sequence-wise balance loss (DeepSeek-V3 §2.1.2, eq. 17-20): α ×
    # Σ_i f_i·P_i per sequence, averaged over the batch's sequences, summed over MoE layers
    # (model/experts/moe.py sequence_balance). 0 = off; DeepSeek-V3 used 1e-4.
    seq_aux_loss_weight: float = 0.0
    # Multi-token prediction (DeepSeek-V3 §2.2): this many sequential MTP modules after the
    # main model, module k predicting t_{i+k+1} (the token k after the next) from the
    # previous module's states and the embedding of t_{i+k} (model/mtp.py); their mean
    # loss × λ = `mtp_loss_weight` joins the objective. 0 = off; DeepSeek-V3 used 1 module,
    # λ = 0.3 for its first 10T tokens and 0.1 after. Exported as layers `n_layers`… for
    # vLLM's speculative decoding (interop/hf_layout.py).
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    max_position_embeddings: int = 4096
    init_std: float = 0.02
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # null = dropless. A float bounds rows per peer to ceil(factor · T·K / ep); rows past
    # it are dropped (moe_dropped_fraction).
    moe_capacity_factor: float | None = None

    def __post_init__(self):
        positive("model", self, "vocab_size", "vocab_pad_multiple", "d_model", "n_layers",
                  "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "dense_ffn_dim", "n_routed_experts",
                  "expert_ffn_dim", "top_k", "n_group", "topk_group", "rms_norm_eps",
                  "rope_theta", "max_position_embeddings", "init_std")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(f"model.n_dense_layers: {self.n_dense_layers} must be in [0, "
                              f"model.n_layers={self.n_layers}]")
        if self.n_shared_experts < 0:
            raise ConfigError(f"model.n_shared_experts: {self.n_shared_experts} must be >= 0")
        if self.top_k > self.n_routed_experts:
            raise ConfigError(f"model.top_k: {self.top_k} > model.n_routed_experts="
                              f"{self.n_routed_experts}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"model.n_group: {self.n_group} does not divide "
                              f"model.n_routed_experts={self.n_routed_experts}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"model.topk_group: {self.topk_group} > model.n_group={self.n_group}")
        experts_per_group = self.n_routed_experts // self.n_group
        if self.top_k > self.topk_group * experts_per_group:
            raise ConfigError(f"model.top_k: {self.top_k} > topk_group × experts per group = "
                              f"{self.topk_group * experts_per_group}; routing cannot pick that many")
        if self.n_group > 1 and experts_per_group < 2:
            raise ConfigError(f"model.n_group: {self.n_group} leaves {experts_per_group} expert per "
                              "group; group scores sum each group's top-2 experts")
        if not self.seq_aux_loss_weight >= 0:
            raise ConfigError(f"model.seq_aux_loss_weight: {self.seq_aux_loss_weight} must be "
                              ">= 0 (0: no sequence-wise balance loss)")
        if self.mtp_layers < 0:
            raise ConfigError(f"model.mtp_layers: {self.mtp_layers} must be >= 0 (0: no "
                              "multi-token prediction)")
        if self.mtp_layers and self.n_moe_layers == 0:
            raise ConfigError(f"model.mtp_layers: {self.mtp_layers} needs MoE layers (an MTP "
                              "module's block is a MoE block, as in DeepSeek-V3); model.n_dense_"
                              f"layers={self.n_dense_layers} = model.n_layers")
        if not self.mtp_loss_weight >= 0:
            raise ConfigError(f"model.mtp_loss_weight: {self.mtp_loss_weight} must be >= 0")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ConfigError(f"model.moe_capacity_factor: {self.moe_capacity_factor} must be "
                              "positive or null (dropless)")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim: {self.qk_rope_head_dim} must be even (RoPE "
                              "rotates pairs)")

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim
