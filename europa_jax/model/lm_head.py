"""The LM head and the next-token loss, one sequence chunk at a time.

At europa-952b's shapes (65,536 tokens per GPU, a 262,272-row padded vocabulary) the f32
logits of a whole sequence are 68.75 GB, and the backward pass of a plain cross entropy
holds several buffers that size. `token_nll` makes the logits `chunk_tokens` positions at
a time under `jax.checkpoint`: the forward keeps only each chunk's per-token loss, the
backward recomputes one chunk's logits, takes their gradient and adds the chunk's share to
the head's gradient before the next chunk. Peak memory is one chunk's logits times a small
factor; the extra cost is the head matmul once more (2·T·D·V FLOPs, ~1 % of a step).

The logits are float32 and so is their gradient; the head's two backward GEMMs take that
gradient in the compute dtype (`head_matmul`), as the forward takes its operands: with a
float32 operand XLA runs them in TF32 at half the BF16 peak (on europa-952b 493 TFLOP per
GPU per step, `europa-jax plan`'s `tf32_gemms` line), and softmax − one-hot, in [−1, 1],
loses nothing BF16's 8 bits do not already lose in the forward's operands.

Shape suffixes (europa_jax/__init__.py): X chunks of the sequence, Y positions in one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


@jax.custom_vjp
def head_matmul(x_BSD, head_DV):
    """float32 logits of `x_BSD` @ `head_DV`; the gradient's GEMMs in x's dtype (module
    docstring), accumulating in float32."""
    return jnp.einsum("bsd,dv->bsv", x_BSD, head_DV, preferred_element_type=jnp.float32)


def _head_matmul_fwd(x_BSD, head_DV):
    return head_matmul(x_BSD, head_DV), (x_BSD, head_DV)


def _head_matmul_bwd(saved, g_BSV):
    x_BSD, head_DV = saved
    g_BSV = g_BSV.astype(x_BSD.dtype)
    dx_BSD = jnp.einsum("bsv,dv->bsd", g_BSV, head_DV, preferred_element_type=jnp.float32)
    dhead_DV = jnp.einsum("bsd,bsv->dv", x_BSD, g_BSV, preferred_element_type=jnp.float32)
    return dx_BSD.astype(x_BSD.dtype), dhead_DV.astype(head_DV.dtype)


head_matmul.defvjp(_head_matmul_fwd, _head_matmul_bwd)


def logits(x_BSD, head_DV, vocab_size: int):
    """float32 logits; padding rows of the vocabulary (there only to divide the mesh) are
    never predicted."""
    logits_BSV = head_matmul(x_BSD, head_DV)
    if head_DV.shape[1] > vocab_size:
        logits_BSV = jnp.where(jnp.arange(head_DV.shape[1]) < vocab_size, logits_BSV, -1e30)
    return logits_BSV


def token_nll(x_BSD, head_DV, targets_BS, vocab_size: int, chunk_tokens: int):
    """Each position's cross entropy against its target, float32 [B, S].

    `chunk_tokens` = 0, or one that is not below S, makes all logits at once (still
    recomputed in the backward); otherwise it must divide S (config.py checks).
    """
    b, s, d = x_BSD.shape

    @jax.checkpoint  # save the chunk's inputs, not its [B, C, V] logits
    def chunk_nll(x_BYD, targets_BY):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits(x_BYD, head_DV, vocab_size), targets_BY)

    if chunk_tokens == 0 or chunk_tokens >= s:
        return chunk_nll(x_BSD, targets_BS)
    n = s // chunk_tokens
    x_XBYD = x_BSD.reshape(b, n, chunk_tokens, d).swapaxes(0, 1)
    targets_XBY = targets_BS.reshape(b, n, chunk_tokens).swapaxes(0, 1)
    # A sequential map: one chunk's logits live at a time, forward and backward.
    nll_XBY = jax.lax.map(lambda chunk: chunk_nll(*chunk), (x_XBYD, targets_XBY))
    return nll_XBY.swapaxes(0, 1).reshape(b, s)
