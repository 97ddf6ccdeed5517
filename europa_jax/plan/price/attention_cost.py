"""The attention the slowest GPU runs per step, from a distribution of document lengths.

Every GPU holds the same tokens, but document-masked attention costs Σ L(L+1)/2 query-key
pairs per row, and the step waits for the GPU with the most. Which GPU that is, and how
much it holds, depends on the documents of the batch and on the balancer, so the plan
samples global batches: a stream of document lengths (a prepared corpus's, from its
offsets, or a model of documents.py: Dolma's measured mix by default, the long-tailed
stress case on request) is cut into global batches of B·S tokens as the
input pipeline cuts it (a document that does not fit opens the next batch), each batch is
laid out by the real balancer (data/packing.py, as `data.balance` says), and the slowest
*unit* is read off: a rank, or with `execution.attention_context_parallel` a node, whose
GPUs share its rows' pairs evenly (parallel/comm.py AttentionGroup).

Reported per GPU of the slowest unit: pairs expected (mean over batches), p95 and the
worst case (every row one document: S(S+1)/2 per row), beside the mean over all GPUs
(perfect balance). Those are the pairs the model needs. The kernels run more
(`kernel_pairs`): the forward whole key tiles from each query tile's earliest document
start, the backward whole chunk pairs (flash_backward.py) that any row of its call — a
rank's rows, or a node's under context parallelism — can see; their expected, p95 and
worst case per GPU are reported for the unit whose kernels cost the most. With
`block_skipping` (the recipe's FlexAttention, which skips masked blocks in both passes)
the backward runs the forward's tile pairs.

Shape suffixes (europa_jax/__init__.py): W documents, Z placed pieces, B rows, J ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from europa_jax.config import Config
from europa_jax.data import packing
from europa_jax.data.batch_plan import stream_chunk
from europa_jax.model import attention
from europa_jax.plan.price import documents
from europa_jax.plan.price.step_time import backward_per_forward

DEFAULT_BATCHES = 32


def corpus_lengths(path: str | Path) -> np.ndarray:
    """Every document length of a prepared corpus (its offsets files; no tokens read)."""
    from europa_jax.data.corpus import TokenCorpus

    corpus = TokenCorpus(path)
    return corpus.lengths(np.arange(len(corpus), dtype=np.int64)).astype(np.int64)


def global_batches(lengths_W: np.ndarray, batch_tokens: int, n: int, seed: int = 0):
    """Piece lengths of `n` consecutive global batches of a shuffled document stream (the
    stream repeats, reshuffled, when it runs out), each exactly `batch_tokens`, cut as the
    input pipeline cuts them (batch_plan.stream_chunk)."""
    epochs: dict[int, np.ndarray] = {}

    def document_at(i: int) -> int:
        epoch, k = divmod(i, len(lengths_W))
        if epoch not in epochs:
            epochs[epoch] = np.random.default_rng((seed, epoch)).permutation(len(lengths_W))
        return int(epochs[epoch][k])

    mean = max(1.0, float(np.mean(lengths_W)))
    position = offset = 0
    for _ in range(n):
        _, _, piece_lengths, position, offset = stream_chunk(
            document_at, lambda ids: lengths_W[ids], mean, batch_tokens, position, offset)
        yield piece_lengths


def unit_pairs(length_X: np.ndarray, *, seq_len: int, n_ranks: int, ranks_per_unit: int,
               balance: bool, kernels: tuple[int, int] | None = None):
    """(pairs per rank [J], pairs per GPU of each unit [U]) of one global batch as the
    balancer lays it out; with `kernels` = (tile, chunk) also the pairs the
    kernels run per GPU of each unit, forward and backward ([U] each: `kernel_pairs`)."""
    placed = packing.pack(length_X, seq_len=seq_len, n_ranks=n_ranks, balance=balance,
                          ranks_per_unit=ranks_per_unit)
    n_rows = int(length_X.sum()) // seq_len
    length_Z = placed.length_Z.astype(np.float64)
    pairs_B = np.bincount(placed.row_Z, weights=length_Z * (length_Z + 1) / 2, minlength=n_rows)
    rank_J = packing.rank_cost(pairs_B, n_ranks)
    units = n_ranks // ranks_per_unit
    unit_U = packing.rank_cost(rank_J, units) / ranks_per_unit
    if kernels is None:
        return rank_J, unit_U
    tile, chunk = kernels
    fwd_B, bwd_U = kernel_pairs(placed, seq_len=seq_len, n_ranks=n_ranks,
                                ranks_per_call=ranks_per_unit, tile=tile, chunk=chunk)
    return rank_J, unit_U, (packing.rank_cost(fwd_B, units) / ranks_per_unit,
                            bwd_U / ranks_per_unit)


def kernel_pairs(placed: packing.Placement, *, seq_len: int, n_ranks: int, ranks_per_call: int,
                 tile: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward pairs per row [B], backward pairs per unit of `ranks_per_call` ranks [U])
    the attention kernels run on a laid-out batch: the count
    flash_backward.kernel_pair_fraction makes of one row, for every row at once. A
    backward runs each row's own chunk pairs (flash_backward loops over a call's rows),
    chosen by the row's document starts; a unit's GPUs share its rows' pairs. `chunk` 0:
    no pairwise backward (whole causal triangles)."""
    length_Z = placed.length_Z.astype(np.int64)
    start_Z = np.cumsum(length_Z) - length_Z  # rows are full and in order: global offsets
    n_rows = int(length_Z.sum()) // seq_len

    def doc_start(row_Q, local_Q):
        """The local start of the document holding each (row, position)."""
        pos_Q = row_Q * seq_len + local_Q
        return start_Z[np.searchsorted(start_Z, pos_Q, side="right") - 1] - row_Q * seq_len

    rows = np.arange(n_rows)
    q0 = np.arange(0, seq_len, tile)
    row_Q, q0_Q = np.repeat(rows, len(q0)), np.tile(q0, n_rows)
    q1_Q = np.minimum(q0_Q + tile, seq_len)
    k0_Q = doc_start(row_Q, q0_Q) // tile * tile  # the tile-aligned earliest key read
    n_Q = (q1_Q - q0_Q).astype(np.float64)
    fwd_B = np.bincount(row_Q, weights=n_Q * (q1_Q - k0_Q) - n_Q * (n_Q - 1) / 2,
                        minlength=n_rows)
    units, per_rank = n_ranks // ranks_per_call, n_rows // n_ranks
    if not chunk:
        return fwd_B, np.full(units, ranks_per_call * per_rank * seq_len * (seq_len + 1) / 2)
    x = -(-seq_len // chunk)
    i_X = np.arange(x)
    first_BX = np.where(i_X * chunk < seq_len,
                        doc_start(np.repeat(rows, x), np.tile(np.minimum(i_X * chunk,
                                                                         seq_len - 1), n_rows)
                                  ).reshape(n_rows, x), seq_len)
    off_B = (i_X - first_BX // chunk).sum(axis=-1)  # key chunks j < i a query chunk sees
    per_row_B = x * chunk * (chunk + 1) / 2 + off_B * float(chunk) ** 2
    # rows are device-major: a unit's rows are consecutive
    return fwd_B, per_row_B.reshape(units, ranks_per_call * per_rank).sum(axis=1)


def slowest_pairs(cfg: Config, lengths_W: np.ndarray | None = None, *, source: str = "",
                  documents_model: str = documents.DEFAULT, batches: int = DEFAULT_BATCHES,
                  seed: int = 0, context_parallel: bool | None = None,
                  block_skipping: bool = False) -> dict[str, Any]:
    """Attention pairs per GPU of the slowest unit per step, over `batches` sampled global
    batches of `cfg`'s layout (the module docstring). `lengths_W`: the documents, named by
    `source` (default: enough of `documents_model`, documents.py, for every batch);
    `context_parallel`: as the config's model says unless given (benchmarks compare both);
    `block_skipping`: the backward runs the forward's tile pairs (module docstring)."""
    seq, rows, ranks = cfg.data.seq_len, cfg.data.global_batch_size, cfg.mesh.n_devices
    if context_parallel is None:
        context_parallel = cfg.execution.attention_context_parallel
    unit = cfg.mesh.node_group if context_parallel else 1
    if lengths_W is None:
        lengths_W = documents.lengths(documents_model, batches * rows * seq, seed)
        source = documents.MODELS[documents_model][0]
    source = source or f"{len(lengths_W):,} given document lengths"
    tile = attention.LIBRARY_SEQ_MULTIPLE
    chunk = attention.backward_chunk_for(seq, cfg.execution.attention_backward_chunk)
    ratio = backward_per_forward(cfg.model.qk_head_dim, cfg.model.v_head_dim)
    slowest, mean, rank_ratio, node_ratio, run = [], [], [], [], []
    for length_X in global_batches(lengths_W, rows * seq, batches, seed):
        rank_J, unit_U, (fwd_U, bwd_U) = unit_pairs(
            length_X, seq_len=seq, n_ranks=ranks, ranks_per_unit=unit,
            balance=cfg.data.balance, kernels=(tile, chunk))
        if block_skipping:
            bwd_U = fwd_U
        slowest.append(unit_U.max())
        # the unit whose kernels cost the most (a backward pair is ~2.5 forward ones)
        u = int(np.argmax(fwd_U + ratio * bwd_U))
        run.append((fwd_U[u], bwd_U[u]))
        mean.append(rank_J.mean())
        rank_ratio.append(packing.max_over_mean(rank_J))
        node_ratio.append(packing.max_over_mean(
            packing.rank_cost(rank_J, ranks // cfg.mesh.node_group)))
    slowest, run = np.asarray(slowest), np.asarray(run)
    per_rank_rows = rows // ranks
    worst = float(per_rank_rows * seq * (seq + 1) / 2)  # every row one document
    # …and what the kernels run then (a sequence shorter than a chunk is padded to it)
    _, _, worst_run = unit_pairs(np.full(rows, seq), seq_len=seq, n_ranks=ranks,
                                 ranks_per_unit=unit, balance=False,
                                 kernels=(tile, chunk))
    if block_skipping:
        worst_run = (worst_run[0], worst_run[0])
    return {
        "documents": source, "batches": batches, "block_skipping": block_skipping,
        "slowest_unit": "node" if unit > 1 else "rank",
        "balance": cfg.data.balance,
        "pairs_per_gpu": {
            "expected": float(slowest.mean()),
            "p95": float(np.percentile(slowest, 95)),
            "max_sampled": float(slowest.max()),
            "worst_case": worst,
            "mean_over_gpus": float(np.mean(mean)),
        },
        # what the kernels run on the GPU of the unit they cost the most on
        "kernel_pairs_per_gpu": {
            name: {"expected": float(run[:, i].mean()),
                   "p95": float(np.percentile(run[:, i], 95)),
                   "worst_case": float(worst_run[i].max())}
            for i, name in enumerate(("forward", "backward"))},
        "kernel_tile": tile, "backward_chunk": chunk,
        "cost_max_over_mean": {"per_rank": float(np.mean(rank_ratio)),
                               "per_node": float(np.mean(node_ratio))},
    }
