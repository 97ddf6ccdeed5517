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

Batches that mix documents (`window_batches` W > 0, data.shuffle_window_tokens): the next
W batches' share of each source's stream is cut into pieces of at most one row (a longer
document is split there anyway: a row holds S tokens), the pieces are shuffled (seeded by
the source's seed and the window's index), and batch b of the window takes its share from
the shuffled pieces in turn. A batch is then rows of many documents instead of the next
B·S tokens of one long file, while the window still holds every stream token once and
each batch each source's exact share; balancing (packing.py) works on the batch's pieces
as before. W = 0 is the stream order itself.

The plan state is the batch index and, per source, the stream position (document and
offset) — with a window, the position where the batch's window starts; every process
computes the same plans, so the state is global.
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
                 n_ranks: int, balance: bool, ranks_per_unit: int = 1,
                 window_batches: int = 0, shuffle_seeds: list[int] | None = None):
        """`ranks_per_unit`: consecutive ranks balanced together (packing.pack);
        `window_batches`: batches whose pieces are shuffled together (0: stream order),
        `shuffle_seeds`: one per stream, for that shuffle."""
        self.streams, self.weights_I = streams, np.asarray(weights_I, dtype=np.float64)
        self.seq_len, self.n_rows, self.n_ranks, self.balance = seq_len, n_rows, n_ranks, balance
        self.ranks_per_unit = ranks_per_unit
        self.window_batches = window_batches
        self.shuffle_seeds = list(shuffle_seeds or [0] * len(streams))
        self._window: _Window | None = None  # the last window planned: its batches follow

    def plan(self, index: int, positions: list[int], offsets: list[int]
             ) -> tuple[BatchPlan, list[int], list[int]]:
        """Batch `index`'s plan and the stream positions to keep after it. Without a window
        `positions`/`offsets` are where the batch starts and the return is where it ends;
        with one they are where the batch's window starts, and the return is the same until
        the window's last batch, then where the next window starts."""
        if not self.window_batches:
            need_I = shares(self.weights_I, index, self.n_rows * self.seq_len)
            parts, positions, offsets = self._chunks(need_I, positions, offsets)
            epochs_I = self._epochs(positions)
        else:
            window = index // self.window_batches
            key = (window, tuple(positions), tuple(offsets))
            if self._window is None or self._window.key != key:
                self._window = self._plan_window(window, key, positions, offsets)
            within = index - window * self.window_batches
            parts, need_I = self._window.batch(within)
            last = within == self.window_batches - 1
            epochs_I = self._window.epochs_I(within + 1)
            if last:
                positions = list(self._window.end_positions)
                offsets = list(self._window.end_offsets)
        source_X, doc_X, start_X, length_X = (np.concatenate(x) for x in zip(*parts))
        placed = packing.pack(length_X, seq_len=self.seq_len, n_ranks=self.n_ranks,
                              balance=self.balance, ranks_per_unit=self.ranks_per_unit)
        piece_Z = placed.piece_Z
        plan = BatchPlan(index=index, source_Z=source_X[piece_Z], doc_Z=doc_X[piece_Z],
                         start_Z=start_X[piece_Z] + placed.offset_Z, length_Z=placed.length_Z,
                         row_Z=placed.row_Z,
                         rank_cost_J=packing.rank_cost(placed.row_cost(self.n_rows),
                                                       self.n_ranks),
                         source_tokens_I=need_I, source_epochs_I=epochs_I)
        return plan, positions, offsets

    def _chunks(self, need_I, positions, offsets):
        """Each source's next `need_I[k]` stream tokens as (source, doc, start, length)
        pieces, and the positions after them."""
        parts, positions, offsets = [], list(positions), list(offsets)
        for k, stream in enumerate(self.streams):
            doc, start, length, positions[k], offsets[k] = stream.chunk(
                int(need_I[k]), positions[k], offsets[k])
            parts.append((np.full(len(doc), k, np.int64), doc, start, length))
        return parts, positions, offsets

    def _epochs(self, positions) -> np.ndarray:
        return np.array([p / s.n_documents for p, s in zip(positions, self.streams)])

    def _plan_window(self, window: int, key, positions, offsets) -> "_Window":
        batch_tokens = self.n_rows * self.seq_len
        first = window * self.window_batches
        need_WI = np.stack([shares(self.weights_I, first + b, batch_tokens)
                            for b in range(self.window_batches)])
        parts, end_positions, end_offsets = self._chunks(need_WI.sum(axis=0), positions,
                                                         offsets)
        shuffled = []
        for k, (source, doc, start, length) in enumerate(parts):
            doc, start, length = split_pieces(doc, start, length, self.seq_len)
            rng = np.random.Generator(np.random.PCG64(
                np.random.SeedSequence([self.shuffle_seeds[k], window])))
            order = rng.permutation(len(doc))
            shuffled.append((np.full(len(doc), k, np.int64), doc[order], start[order],
                             length[order]))
        return _Window(key=key, need_WI=need_WI, pieces=shuffled,
                       start_epochs_I=self._epochs(positions),
                       end_epochs_I=self._epochs(end_positions),
                       end_positions=end_positions, end_offsets=end_offsets)


def split_pieces(doc_X, start_X, length_X, most: int):
    """The pieces cut into pieces of at most `most` tokens (a piece's head first)."""
    count_X = -(-length_X // most)
    first_Y = np.repeat(np.cumsum(count_X) - count_X, count_X)
    k_Y = np.arange(int(count_X.sum())) - first_Y  # which cut of its piece
    length_Y = np.repeat(length_X, count_X) - k_Y * most
    return (np.repeat(doc_X, count_X), np.repeat(start_X, count_X) + k_Y * most,
            np.minimum(length_Y, most))


def take_tokens(doc_X, start_X, length_X, lo: int, hi: int):
    """Tokens [lo, hi) of the sequence of pieces, as pieces (the first and last cut)."""
    end_X = np.cumsum(length_X)
    begin_X = end_X - length_X
    a, b = np.searchsorted(end_X, lo, side="right"), np.searchsorted(begin_X, hi, side="left")
    skip = np.maximum(lo - begin_X[a:b], 0)
    length = np.minimum(end_X[a:b], hi) - begin_X[a:b] - skip
    return doc_X[a:b], start_X[a:b] + skip, length


@dataclass(frozen=True, kw_only=True)
class _Window:
    """One window's shuffled pieces per source, and how many tokens each batch takes."""

    key: tuple
    need_WI: np.ndarray       # tokens of each source in each batch of the window
    pieces: list              # per source: (source, doc, start, length), shuffled
    start_epochs_I: np.ndarray
    end_epochs_I: np.ndarray
    end_positions: list[int]
    end_offsets: list[int]

    def batch(self, within: int):
        """(the pieces of the window's batch `within`, its tokens per source)."""
        before_I = self.need_WI[:within].sum(axis=0)
        parts = []
        for k, (_, doc, start, length) in enumerate(self.pieces):
            lo = int(before_I[k])
            doc_Z, start_Z, length_Z = take_tokens(doc, start, length, lo,
                                                   lo + int(self.need_WI[within, k]))
            parts.append((np.full(len(doc_Z), k, np.int64), doc_Z, start_Z, length_Z))
        return parts, self.need_WI[within]

    def epochs_I(self, batches_done: int) -> np.ndarray:
        """Epochs consumed after `batches_done` of the window's batches (by tokens taken)."""
        share = batches_done / len(self.need_WI)
        return self.start_epochs_I + share * (self.end_epochs_I - self.start_epochs_I)
