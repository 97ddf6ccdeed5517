"""The training objective: next-token loss, sequence-wise balance loss, MTP loss.

`loss_and_stats` runs inside the SPMD step (train.Trainer.loss) or outside it on one
device; every sum is global (comm.psum_all), and a microbatch divides its sums by the
global batch's counts (`loss_denominators`) so that the pieces add up to the whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from europa_jax.config import ModelConfig
from europa_jax.model.transformer import Transformer
from europa_jax.parallel import comm
from europa_jax.train import qk_clip

Batch = dict[str, jax.Array]


def loss_and_stats(model: Transformer, params, router_bias_LE, batch: Batch,
                   denominators=None):
    """The training objective: the mean next-token cross entropy over tokens whose
    successor is in the same document (`stats["lm_loss"]`, the `loss` a run logs), plus,
    with `model.seq_aux_loss_weight` α > 0, α × the sequence-wise balance summed over MoE
    layers and averaged over the batch's sequences (`stats["seq_aux_loss"]`, moe.py), plus,
    with `model.mtp_layers` K > 0, λ = `model.mtp_loss_weight` × the mean over the K MTP
    modules of each one's mean cross entropy over its own targets (`stats["mtp_loss"]`,
    DeepSeek-V3 eq. 25; model/mtp.py).

    Sums are taken over every device under SPMD (comm.psum_all), so the means are global;
    so is the attention logit max (a max over every device, for QK-clip). Positive
    `denominators` [targets, rows, MTP targets × K] (`loss_denominators`) replace the
    batch's own counts (a microbatch's share of the global batch's means).
    """
    cfg = model.cfg
    tokens_BS, segments_BS = batch["tokens"], batch["segment_ids"]
    targets_BS = jnp.roll(tokens_BS, -1, axis=1)
    weight_BS = target_weights(segments_BS)
    nll_BS, stats = model.apply({"params": params}, tokens_BS, segments_BS,
                                batch["positions"], router_bias_LE, targets_BS)
    total = comm.psum_all(jnp.stack([jnp.sum(nll_BS * weight_BS), weight_BS.sum()]))
    stats["attention_logit_max_LH"] = qk_clip.global_max(stats["attention_logit_max_LH"])
    if denominators is None:
        denominators = jnp.zeros((2 + cfg.mtp_layers,), jnp.float32)
    denominators = jnp.asarray(denominators, jnp.float32)
    count = jnp.where(denominators[0] > 0, denominators[0], total[1])
    stats["lm_loss"] = loss = total[0] / jnp.maximum(count, 1.0)
    if cfg.seq_aux_loss_weight > 0:
        # per MoE layer, the same rows in each: sum the layers' balances, count rows once
        balance = comm.psum_all(jnp.stack([stats.pop("seq_balance_sum").sum(),
                                           stats.pop("seq_balance_rows")[0]]))
        rows = jnp.where(denominators[1] > 0, denominators[1], balance[1])
        stats["seq_aux_loss"] = cfg.seq_aux_loss_weight * balance[0] / jnp.maximum(rows, 1.0)
        loss = loss + stats["seq_aux_loss"]
    if cfg.mtp_layers:
        nll_KBS = stats.pop("mtp_nll_KBS")
        weight_KBS = mtp_target_weights(segments_BS, cfg.mtp_layers)
        sums_2K = comm.psum_all(jnp.stack([(nll_KBS * weight_KBS).sum(axis=(1, 2)),
                                           weight_KBS.sum(axis=(1, 2))]))
        counts_K = jnp.where(denominators[2:] > 0, denominators[2:], sums_2K[1])
        # the sum of the modules' means over K: microbatches' shares add up to the batch's
        stats["mtp_loss"] = (sums_2K[0] / jnp.maximum(counts_K, 1.0)).sum() / cfg.mtp_layers
        loss = loss + cfg.mtp_loss_weight * stats["mtp_loss"]
    return loss, stats


def target_weights(segments_BS: jax.Array, shift: int = 1) -> jax.Array:
    """1.0 where the token `shift` positions on is in the same document (a target), else 0.

    Documents are contiguous runs of one segment id, so equal ids `shift` apart mean the
    whole span is one document; the last `shift` positions of a row have no target."""
    same_doc_BS = (jnp.roll(segments_BS, -shift, axis=1) == segments_BS) & (segments_BS > 0)
    return same_doc_BS.at[:, segments_BS.shape[1] - shift:].set(False).astype(jnp.float32)


def mtp_target_weights(segments_BS: jax.Array, k: int) -> jax.Array:
    """[K, B, S]: MTP module k's targets (k+1 tokens on, model/mtp.py), as target_weights."""
    return jnp.stack([target_weights(segments_BS, shift) for shift in range(2, k + 2)])


def loss_denominators(cfg: ModelConfig, segments_BS: jax.Array) -> jax.Array:
    """The global batch's counts that a microbatch's sums are divided by: [targets, rows
    with a token, each MTP module's targets] (at least 1 each)."""
    counts = [target_weights(segments_BS).sum(), (segments_BS > 0).any(axis=1).sum()]
    if cfg.mtp_layers:
        counts += list(mtp_target_weights(segments_BS, cfg.mtp_layers).sum(axis=(1, 2)))
    return jnp.maximum(jnp.stack(counts), 1.0)
