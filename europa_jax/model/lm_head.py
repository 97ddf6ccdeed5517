"""The LM head and the next-token loss, one sequence chunk at a time.

At europa-952b's shapes (65,536 tokens per GPU, a 262,272-row padded vocabulary) the f32
logits of a whole sequence are 68.75 GB, and the backward pass of a plain cross entropy
holds several buffers that size. `token_nll` makes the logits `chunk_tokens` positions at
a time under `jax.checkpoint`: the forward keeps only each chunk's per-token loss, the
backward recomputes one chunk's logits, takes their gradient and adds the chunk's share to
the head's gradient before the next chunk. Peak memory is one chunk's logits times a small
factor; the extra cost is the head matmul once more (2·T·D·V FLOPs, ~1 % of a step).

Shape suffixes (europa_jax/__init__.py): X chunks of the sequence, Y positions in one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def logits(x_BSD, head_DV, vocab_size: int):
    """float32 logits; padding rows of the vocabulary (there only to divide the mesh) are
    never predicted."""
    logits_BSV = jnp.einsum("bsd,dv->bsv", x_BSD, head_DV, preferred_element_type=jnp.float32)
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
