"""Which document pieces make each global batch, and where they go: lengths only, no tokens.

One or several sources (a weighted mixture), each a corpus with its own shuffled document
stream. Global batch b takes, from source k, exactly its share of the batch's B·S tokens:
cumulative shares are rounded once (round(W_k · b · B·S) with W_k the running sum of the
weights), so over any run every source is within two tokens of its weight and the batch
always holds B·S tokens. Each share is the next tokens of that source's stream (a document
that does not fit is split, its rest opens the source's next share), and the pieces of all
sources are packed into rows together (packing.py), so balancing sees the whole batch.

Shape suffixes (europa_jax/__init__.py): I sources, X pieces in stream order, Z placed
pieces, J ranks.

The plan state is the batch index and, per source, the stream position (document and
offset); every process computes the same plans, so the state is global.
"""

from __future__ import annotations

from dataclasses import dataclass

import grain
import numpy as np

from europa_jax.data import packing
from europa_jax.data.corpus import TokenCorpus


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """One global batch: pieces of documents and the (rank-laid-out) row each goes to."""

    index: int
    source_Z: np.ndarray
    doc_Z: np.ndarray
    start_Z: np.ndarray
    length_Z: np.ndarray
    row_Z: np.ndarray       # sorted; pieces of a row are in stream order
    rank_cost_J: np.ndarray  # Σ piece length² of each rank's rows
    source_tokens_I: np.ndarray  # tokens of each source in this batch
    source_epochs_I: np.ndarray  # epochs of each source's stream consumed by its end


@dataclass(frozen=True, kw_only=True)
class Stream:
    """One source: a corpus and its document order (corpus indices, repeated per epoch)."""

    corpus: TokenCorpus
    order: grain.MapDataset
    n_documents: int

    @property
    def mean_length(self) -> float:
        manifest = self.corpus.manifest
        return max(1.0, manifest.tokens / manifest.documents)

    def chunk(self, need: int, position: int, offset: int):
        """Pieces covering the next `need` stream tokens from (position, offset), and the end."""
        return stream_chunk(lambda i: self.order[i], self.corpus.lengths, self.mean_length,
                            need, position, offset)


def stream_chunk(document_at, lengths_of, mean_length: float, need: int, position: int,
                 offset: int):
    """(documents, starts, lengths of the pieces covering the next `need` tokens of a
    document stream from (position, offset), and the position and offset after them).
    `document_at(i)`: the stream's i-th document; `lengths_of(docs)`: their lengths."""
    docs, starts, lengths = [], [], []
    while need:
        # Fetch a little more than the expected number of documents in one go.
        block = min(1 << 16, int(need / mean_length * 1.1) + 8)
        ids = np.array([document_at(i) for i in range(position, position + block)],
                       dtype=np.int64)
        start = np.zeros(block, dtype=np.int64)
        start[0] = offset
        avail = lengths_of(ids) - start
        cum = np.cumsum(avail)
        k = int(np.searchsorted(cum, need))  # first document that reaches `need`
        if k == block:  # the block did not cover the chunk: take it all, fetch more
            docs.append(ids), starts.append(start), lengths.append(avail)
            need -= int(cum[-1])
            position, offset = position + block, 0
            continue
        take = avail[:k + 1].copy()
        take[k] = need - (int(cum[k - 1]) if k else 0)
        docs.append(ids[:k + 1]), starts.append(start[:k + 1]), lengths.append(take)
        if take[k] == avail[k]:
            position, offset = position + k + 1, 0
        else:  # the rest of document k opens the next chunk
            position, offset = position + k, int(start[k] + take[k])
        need = 0
    empty = np.zeros(0, np.int64)
    return (np.concatenate(docs) if docs else empty,
            np.concatenate(starts) if starts else empty,
            np.concatenate(lengths) if lengths else empty, position, offset)


def shares(weights_I: np.ndarray, batch: int, batch_tokens: int) -> np.ndarray:
    """Tokens of each source in global batch `batch`: differences of rounded cumulative
    shares, so they sum to `batch_tokens` and never drift from the weights."""
    running = np.cumsum(weights_I) / np.sum(weights_I)
    running[-1] = 1.0

    def through(b):  # tokens of each source in batches [0, b)
        bounds = np.round(running * (b * batch_tokens)).astype(np.int64)
        return np.diff(bounds, prepend=0)

    return through(batch + 1) - through(batch)


class Planner:
    """The plan of every global batch, from the sources' streams."""

    def __init__(self, streams: list[Stream], weights_I, *, seq_len: int, n_rows: int,
                 n_ranks: int, balance: bool, ranks_per_unit: int = 1):
        """`ranks_per_unit`: consecutive ranks balanced together (packing.pack)."""
        self.streams, self.weights_I = streams, np.asarray(weights_I, dtype=np.float64)
        self.seq_len, self.n_rows, self.n_ranks, self.balance = seq_len, n_rows, n_ranks, balance
        self.ranks_per_unit = ranks_per_unit

    def plan(self, index: int, positions: list[int], offsets: list[int]
             ) -> tuple[BatchPlan, list[int], list[int]]:
        need_I = shares(self.weights_I, index, self.n_rows * self.seq_len)
        parts = []
        positions, offsets = list(positions), list(offsets)
        for k, stream in enumerate(self.streams):
            doc, start, length, positions[k], offsets[k] = stream.chunk(
                int(need_I[k]), positions[k], offsets[k])
            parts.append((np.full(len(doc), k, np.int64), doc, start, length))
        source_X, doc_X, start_X, length_X = (np.concatenate(x) for x in zip(*parts))
        placed = packing.pack(length_X, seq_len=self.seq_len, n_ranks=self.n_ranks,
                              balance=self.balance, ranks_per_unit=self.ranks_per_unit)
        piece_Z = placed.piece_Z
        epochs_I = np.array([p / s.n_documents for p, s in zip(positions, self.streams)])
        plan = BatchPlan(index=index, source_Z=source_X[piece_Z], doc_Z=doc_X[piece_Z],
                         start_Z=start_X[piece_Z] + placed.offset_Z, length_Z=placed.length_Z,
                         row_Z=placed.row_Z,
                         rank_cost_J=packing.rank_cost(placed.row_cost(self.n_rows),
                                                       self.n_ranks),
                         source_tokens_I=need_I, source_epochs_I=epochs_I)
        return plan, positions, offsets
