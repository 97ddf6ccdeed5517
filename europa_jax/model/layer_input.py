"""What a decoder layer's backward keeps of its input (`execution.layer_input_format`).

The activation policies keep each layer's input (checkpoint name `layer_input`; offload.py
moves it to host memory) and recompute the layer from it in the backward. At europa-952b's
65,536 tokens that is 0.94 GB per layer per row in BF16: 57 GB of a GH200's Grace memory
at one row per GPU, 115 GB at two — over its 96 GB budget (docs/plan.md).

`e4m3` keeps it in half the bytes. The layer's two branches (attention, then the MLP or
MoE) read an e4m3 copy of the input, 1×128 tiles each with a float32 scale (DeepSeek-V3's
activation tiles, parallel/fp8_rows.py), and the policy keeps that copy: the backward
recomputes from exactly what the forward read, so the gradients are those of the model
that ran. The residual stream itself stays exact — the layer returns
`x + attention + mlp`, not `copy + …` — so rounding does not add up over the layers.
Gradients pass straight through the rounding (DeepSeek-V3 §3.3's cached FP8 activations
do the same); each value read moves by at most 2⁻⁴ of itself (fp8_rows.error_bound).

Shape suffixes: the project's legend (europa_jax/__init__.py).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from europa_jax.config import ExecutionConfig
from europa_jax.parallel import fp8_rows

NAME = "layer_input"


def for_branches(ex: ExecutionConfig, x_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the residual stream, what the layer's branches read), the second named `NAME` for
    the activation policy. In the compute dtype they are one array."""
    if ex.layer_input_format == "compute_dtype":
        x_BSD = checkpoint_name(x_BSD, NAME)
        return x_BSD, x_BSD
    return x_BSD, e4m3_copy(x_BSD)


def after_attention(x_BSD: jax.Array, branch_in_BSD: jax.Array,
                    attn_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(what the MLP's branch reads, the residual stream) after attention: the branch goes
    on from the copy it read, the stream from the exact input. One sum when they are one."""
    h_branch_BSD = branch_in_BSD + attn_BSD
    return h_branch_BSD, h_branch_BSD if branch_in_BSD is x_BSD else x_BSD + attn_BSD


def e4m3_copy(x_BSD: jax.Array) -> jax.Array:
    """`x` rounded through e4m3 in 1×128 tiles, in its own dtype; the tiles and their scales
    are what the policy keeps. Its derivative is the identity (straight through)."""
    return read(x_BSD, *e4m3_tiles(x_BSD))


def e4m3_tiles(x_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(e4m3 tiles [B, S, D], their float32 scales [B, S, D / tile]), named `NAME` — here,
    outside any custom rule, so that the policy sees them (a name inside a custom_jvp's
    function is invisible to jax.checkpoint: it would keep `x` instead)."""
    b, s, d = x_BSD.shape
    q_TD, scale_TX = fp8_rows.quantize(jax.lax.stop_gradient(x_BSD).reshape(b * s, d))
    return (checkpoint_name(q_TD.reshape(b, s, d), NAME),
            checkpoint_name(scale_TX.reshape(b, s, -1), NAME))


def read(x_BSD: jax.Array, q_BSD: jax.Array, scale_BSX: jax.Array) -> jax.Array:
    """What the branches read: `x`'s e4m3 tiles in `x`'s dtype, with `x`'s gradient."""
    b, s, d = q_BSD.shape
    copy_BSD = fp8_rows.dequantize(q_BSD.reshape(b * s, d), scale_BSX.reshape(b * s, -1),
                                   x_BSD.dtype).reshape(b, s, d)
    return _straight_through(x_BSD, copy_BSD)


@jax.custom_jvp
def _straight_through(x_BSD, copy_BSD):
    """`copy_BSD`, with `x_BSD`'s tangent. Its rule returns the copy itself, not a call that
    takes `x`: the backward then needs only the copy's tiles, never the exact input."""
    return copy_BSD


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    (_, copy_BSD), (dx_BSD, _) = primals, tangents
    return copy_BSD, dx_BSD
