"""How the model runs, apart from what it is (`execution:` in a config file): attention
and expert kernels, FP8 GEMMs, MoE buffers and chunking, the loss's chunks, activation
recomputation, layer scanning, compute dtype and storage padding.

None of these is written to an exported config.json nor changes the function the model
computes (config_model.py holds what does); a run may change them and keep its
checkpoints' meaning. Imports no jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from europa_jax.config_checks import ConfigError, positive


@dataclass(frozen=True, kw_only=True)
class ExecutionConfig:
    """Kernels, precision, buffers and memory policy of the model's program."""

    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    # A weight with no data-shardable dimension that is a multiple of this is stored with
    # one dimension zero-padded to one (sharding.storage_shape): on 96 nodes, 96, so that
    # no weight is copied on every node. 1 = never pad.
    param_pad_multiple: int = 1
    attention_block_size: int = 512  # the blockwise kernel's query/key block length
    # Attention kernel (model/kernels.py): auto = on CPU `dense` (all [S, S] scores at once)
    # where one device's scores fit, else the blockwise scan; tokamax's flash attention on
    # GPU (Mosaic GPU; `tokamax_triton`: its Triton kernel; `tokamax_xla`: tokamax's XLA
    # path, which builds a [S, S] mask: tests only).
    attention: Literal["auto", "dense", "blockwise", "tokamax", "tokamax_triton",
                       "tokamax_xla"] = "auto"
    # tokamax's flash attention backward (GPU) runs on pairs of chunks of this many
    # positions and skips the pairs no query can see (model/flash_backward.py): short
    # documents cost their own length, not the row's. 0 = tokamax's own backward.
    attention_backward_chunk: int = 8192
    # Context parallelism over the node (parallel/comm.py AttentionGroup): the node's GPUs
    # compute the attention of all the node's rows together, each for n_heads / mesh.expert
    # heads, so a GPU holding one 65,536-token document no longer sets the step; the data
    # balancer then balances nodes, not single ranks (data/packing.py).
    attention_context_parallel: bool = False
    # The loss makes logits this many positions at a time (f32 [B, chunk, V]); 0 = whole
    # sequence. At 65,536 × 262,272 the whole sequence's logits are 68.75 GB per GPU.
    loss_chunk_tokens: int = 4096
    # Expert matmuls (moe.grouped_swiglu): auto = blocked on CPU (exact, fast on XLA:CPU),
    # tokamax's grouped-matmul kernel on GPU; ragged_dot is jax.lax's (dense on GPU today).
    grouped_matmul: Literal["auto", "blocked", "tokamax", "tokamax_triton",
                            "ragged_dot"] = "auto"
    # FP8 for the weight GEMMs, forward and backward (model/fp8/fp8_linear.py; docs/open-
    # questions.md): `tensor` = e4m3 operands (e5m2 gradients) with one power-of-two scale
    # per tensor, what XLA's GPU compiler runs as cuBLASLt FP8 GEMMs on Hopper; `block` =
    # DeepSeek-V3's 1×128 / 128×128 scales, emulated (a numerics study: on a GPU no faster
    # than bf16). Attention's projections, the dense MLPs, the shared experts and the MTP
    # projection; never the router, the head or attention's scores.
    fp8_gemms: Literal["none", "tensor", "block"] = "none"
    # The routed experts' GEMMs in DeepSeek-V3's FP8, emulated (`block`): with the `blocked`
    # expert kernel only — no FP8 grouped GEMM with block scales exists for Hopper.
    fp8_expert_gemms: Literal["none", "block"] = "none"
    # Dropless buffers are sized at this multiple of their expected fill under uniform
    # routing (model/experts/moe.py): rows per peer of the exchange, copies per expert window.
    # What does not fit goes in an overflow round (exchange) or window (experts): exact.
    moe_buffer_factor: float = 1.25
    # Library grouped matmuls visit the local experts this many at a time, each group's
    # copies in windows (model/experts/expert_windows.py); 0 = the fewest groups whose window is
    # at most 65,536 copies. Must divide the local experts.
    moe_expert_groups: int = 0
    # Each MoE layer dispatches its tokens this many at a time (0 = all at once): dropless
    # buffers are sized by the chunk (ep·chunk·K rows), not by the whole 65,536-token row.
    moe_chunk_tokens: int = 0
    # With k rows per device (data.global_batch_size = k × devices), each decoder layer
    # gathers its weights once and then runs the rows one at a time (model/row_loop.py):
    # the gathered bytes of k rows at the temporaries of one.
    row_loop: bool = False
    # What each decoder layer's branches read of its input, and so what the activation
    # policy keeps of it for the backward (model/layer_input.py): the input itself, or an
    # e4m3 copy in 1×128 tiles at half the bytes (the residual stream stays exact).
    layer_input_format: Literal["compute_dtype", "e4m3"] = "compute_dtype"
    scan_layers: bool = True
    remat: Literal["none", "full"] = "full"

    def __post_init__(self):
        positive("execution", self, "param_pad_multiple", "attention_block_size")
        if self.moe_chunk_tokens < 0:
            raise ConfigError(f"execution.moe_chunk_tokens: {self.moe_chunk_tokens} must be >= 0")
        if self.attention_backward_chunk < 0:
            raise ConfigError(f"execution.attention_backward_chunk: "
                              f"{self.attention_backward_chunk} must be >= 0 (0: tokamax's own "
                              "backward)")
        if self.loss_chunk_tokens < 0:
            raise ConfigError(f"execution.loss_chunk_tokens: {self.loss_chunk_tokens} must be >= 0")
        if self.moe_buffer_factor <= 0:
            raise ConfigError(f"execution.moe_buffer_factor: {self.moe_buffer_factor} must be "
                              "positive")
        if self.moe_expert_groups < 0:
            raise ConfigError(f"execution.moe_expert_groups: {self.moe_expert_groups} must be "
                              ">= 0")


# The keys that were the model's (`model.x`) before they became the execution section's:
# a config file or `--set` naming one is refused, a checkpoint's saved config is moved
# (config_loader.saved_config).
MOVED_FROM_MODEL = tuple(ExecutionConfig.__dataclass_fields__)
