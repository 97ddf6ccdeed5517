"""The decoder block: x + attention(norm(x)), then + MLP or MoE(norm(·)).

Its layers are built by `block_layers` into whichever module calls it, so a multi-token
prediction module (mtp.py) holds the same parameters under the same roles as a decoder
block (`attention.w_q_b`, `moe.w_gate`, …) next to its own.

Shape suffixes: the project's legend (europa_jax/__init__.py).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax

from europa_jax.config import ExecutionConfig, ModelConfig
from europa_jax.model import layer_input
from europa_jax.model.attention import MLAttention
from europa_jax.model.layers import RMSNorm, SwiGLU
from europa_jax.model.experts.moe import MoE


def block_layers(cfg: ModelConfig, ex: ExecutionConfig, is_moe: bool, x_BSD, segment_ids_BS,
                 cos_BSP2, sin_BSP2, router_bias_E, tokens_BS, branch_in_BSD=None):
    """A pre-norm block's layers, created in the module whose compact method calls this.

    Returns the new residual stream and the layer's stats: each head's largest attention
    logit on this device (`attention_logit_max_H`, for QK-clip) and, in MoE blocks, the
    MoE's counts (moe.py). `segment_ids_BS` are attention's (the node's rows under context
    parallelism); `tokens_BS` marks this device's own real tokens (the MoE's sequence
    balance). The branches read `branch_in_BSD` when given (the row loop reads each trip's
    row from tiles made for all the rows), else what `layer_input.for_branches` makes of
    `x_BSD`.
    """
    if branch_in_BSD is None:
        x_BSD, branch_in_BSD = layer_input.for_branches(ex, x_BSD)
    attn_BSD, logit_max_H = MLAttention(cfg, ex, report_logit_max=True, name="attention")(
        RMSNorm(cfg, ex, name="attention_norm")(branch_in_BSD), segment_ids_BS, cos_BSP2, sin_BSP2)
    h_branch_BSD, h_BSD = layer_input.after_attention(x_BSD, branch_in_BSD, attn_BSD)
    mlp_in_BSD = RMSNorm(cfg, ex, name="mlp_norm")(h_branch_BSD)
    if is_moe:
        mlp_out_BSD, stats = MoE(cfg, ex, name="moe")(mlp_in_BSD, router_bias_E, tokens_BS)
    else:
        mlp_out_BSD, stats = SwiGLU(cfg, ex, name="mlp")(mlp_in_BSD), {}
    return h_BSD + mlp_out_BSD, {**stats, "attention_logit_max_H": logit_max_H}


class DecoderBlock(nn.Module):
    """One decoder layer (`block_layers`): dense MLP or MoE."""

    ROLE_ROOT = True  # parameter roles are paths inside a block (param_table.py)
    cfg: ModelConfig
    ex: ExecutionConfig
    is_moe: bool

    @nn.compact
    def __call__(self, x_BSD, segment_ids_BS, cos_BSP2, sin_BSP2, router_bias_E, tokens_BS):
        return block_layers(self.cfg, self.ex, self.is_moe, x_BSD, segment_ids_BS, cos_BSP2,
                            sin_BSP2, router_bias_E, tokens_BS)


def under_policy(block_cls: type[nn.Module], ex: ExecutionConfig, policy: Callable | None):
    """A block class under the activation policy: offload.py's if given, else execution.remat."""
    if policy is None and ex.remat == "full":  # recompute all; keep only block inputs
        policy = jax.checkpoint_policies.nothing_saveable
    if policy is None:
        return block_cls
    return nn.remat(block_cls, policy=policy, prevent_cse=not ex.scan_layers)
