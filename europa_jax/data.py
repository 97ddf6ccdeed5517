"""Training input pipeline on Grain: shuffled documents → balanced packed rows → this process.

    MapDataset.range(docs).shuffle(seed).repeat()      a fresh permutation every epoch
      → _PlanDataset          next R·S tokens of the stream, packed into R rows and laid
                              out over N ranks (lengths only: no tokens are read)
      → .map(_ReadRows)       this process's rows: tokens, segment_ids, positions
      → ThreadPrefetch        batches are made while the step runs
      → BatchIterator         what the loop holds: __next__, .stats, get_state/set_state

Every process computes the same plan for the whole global batch from document lengths
(8 bytes of metadata per document), then reads the tokens of its own rows only.  Rows
are device-major (row r lives on rank r // (R / N)); process i holds ranks
[i·N/P, (i+1)·N/P) and so rows [i·R/P, (i+1)·R/P), the contiguous block that
`jax.make_array_from_process_local_data` expects for a batch sharded over (data, expert).

Per row (B rows of this process, S = seq_len):
* ``tokens_BS``: every global batch is exactly the next R·S tokens of the shuffled
  stream, so within an epoch no token is lost or duplicated.  A document longer than a
  row, or one that does not fit, is split; a piece never shares a segment with another.
* ``segment_ids_BS``: 1, 2, 3, ... per document piece within a row (0 = padding; rows
  are always full, so it does not occur).
* ``positions_BS``: position within the piece, restarting at 0 for every piece,
  including the continuation of a split document (it cannot attend to its head anyway).

The iterator state is three integers plus a fingerprint of the pipeline settings; it is
global (the same on every process), so a run can resume with a different process count.
"""

from __future__ import annotations

import atexit
import hashlib
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grain
import numpy as np

from europa_jax import packing
from europa_jax.config import MIN_SEQ_LEN
from europa_jax.corpus import MANIFEST, DataError, TokenCorpus

if TYPE_CHECKING:
    from europa_jax.config import Config


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """One global batch: pieces of documents and the (rank-laid-out) row each goes to."""

    index: int
    doc_P: np.ndarray
    start_P: np.ndarray
    length_P: np.ndarray
    row_P: np.ndarray       # sorted; pieces of a row are in stream order
    rank_cost_N: np.ndarray


@dataclass(frozen=True, kw_only=True)
class BatchStats:
    """Host-side facts about the batch just returned (never sent to the device)."""

    batch: int
    attention_cost_max_over_mean: float
    rank_cost_N: np.ndarray   # Σ piece length² per rank (every rank holds R/N · S tokens)
    documents_split: int      # documents cut into more than one piece in this batch


class _Planner:
    """Chunks the shuffled document stream and packs each chunk into a global batch."""

    def __init__(self, corpus: TokenCorpus, order: grain.MapDataset, *, seq_len: int,
                 n_rows: int, n_ranks: int, balance: bool):
        self.corpus, self.order = corpus, order
        self.seq_len, self.n_rows, self.n_ranks, self.balance = seq_len, n_rows, n_ranks, balance
        self.mean_length = max(1.0, corpus.manifest.tokens / corpus.manifest.documents)

    def _chunk(self, position: int, offset: int):
        """Pieces covering the next R·S stream tokens from (position, offset), and the end."""
        need = self.n_rows * self.seq_len
        docs, starts, lengths = [], [], []
        while need:
            # Fetch a little more than the expected number of documents in one go.
            block = min(1 << 16, int(need / self.mean_length * 1.1) + 8)
            ids = np.array([self.order[i] for i in range(position, position + block)],
                           dtype=np.int64)
            start = np.zeros(block, dtype=np.int64)
            start[0] = offset
            avail = self.corpus.lengths(ids) - start
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
            else:  # the rest of document k opens the next batch
                position, offset = position + k, int(start[k] + take[k])
            need = 0
        return (np.concatenate(docs), np.concatenate(starts), np.concatenate(lengths),
                position, offset)

    def plan(self, index: int, position: int, offset: int) -> tuple[BatchPlan, int, int]:
        doc_C, start_C, length_C, position, offset = self._chunk(position, offset)
        placed = packing.pack(length_C, seq_len=self.seq_len, n_ranks=self.n_ranks,
                              balance=self.balance)
        piece_P = placed.piece_P
        plan = BatchPlan(index=index, doc_P=doc_C[piece_P],
                         start_P=start_C[piece_P] + placed.offset_P, length_P=placed.length_P,
                         row_P=placed.row_P,
                         rank_cost_N=packing.rank_cost(placed.row_cost(self.n_rows),
                                                       self.n_ranks))
        return plan, position, offset


class _PlanIterator(grain.DatasetIterator):
    def __init__(self, planner: _Planner, fingerprint: dict):
        super().__init__()
        self._planner, self._fingerprint = planner, fingerprint
        self._batch = self._position = self._offset = 0

    def __next__(self) -> BatchPlan:
        plan, self._position, self._offset = self._planner.plan(self._batch, self._position,
                                                                self._offset)
        self._batch += 1
        return plan

    def get_state(self) -> dict:
        return {"batch": self._batch, "position": self._position, "offset": self._offset,
                "pipeline": dict(self._fingerprint)}

    def set_state(self, state: dict) -> None:
        saved = state.get("pipeline")
        if saved != self._fingerprint:
            diff = {k: (saved or {}).get(k) for k, v in self._fingerprint.items()
                    if (saved or {}).get(k) != v}
            raise DataError(f"data iterator state was saved for a different pipeline: saved "
                            f"{diff}, this run {({k: self._fingerprint[k] for k in diff})}")
        self._batch, self._position, self._offset = (int(state["batch"]), int(state["position"]),
                                                     int(state["offset"]))


class _PlanDataset(grain.IterDataset):
    def __init__(self, order: grain.MapDataset, planner: _Planner, fingerprint: dict):
        super().__init__(order)
        self._planner, self._fingerprint = planner, fingerprint

    def __iter__(self) -> _PlanIterator:
        return _PlanIterator(self._planner, self._fingerprint)


class _ReadRows:
    """Plan → this process's rows [lo, hi): reads only those rows' tokens."""

    def __init__(self, corpus: TokenCorpus, *, lo: int, hi: int, seq_len: int):
        self.corpus, self.lo, self.hi, self.seq_len = corpus, lo, hi, seq_len
        self.vocab_size = int(corpus.manifest.tokenizer["vocab_size"])

    def __call__(self, plan: BatchPlan) -> dict:
        a, b = np.searchsorted(plan.row_P, [self.lo, self.hi])
        doc_P, start_P, length_P = plan.doc_P[a:b], plan.start_P[a:b], plan.length_P[a:b]
        row_P = plan.row_P[a:b] - self.lo
        pieces = self.corpus.read_many(doc_P, start_P, start_P + length_P)
        shape = (self.hi - self.lo, self.seq_len)
        # Pieces are sorted by row and every row is exactly full, so the concatenation
        # is the row-major token matrix.
        tokens_BS = np.concatenate(pieces).astype(np.int32).reshape(shape)
        first_P = np.searchsorted(row_P, row_P)  # index of the row's first piece
        segment_P = np.arange(len(row_P)) - first_P + 1
        piece_start_P = np.cumsum(length_P) - length_P
        positions = np.arange(tokens_BS.size) - np.repeat(piece_start_P, length_P)
        if int(tokens_BS.max(initial=0)) >= self.vocab_size:
            bad = int(np.searchsorted(np.cumsum(length_P), np.argmax(tokens_BS >= self.vocab_size),
                                      side="right"))
            raise DataError(f"{self.corpus.path}: document {doc_P[bad]} holds a token id >= "
                            f"the manifest's vocab {self.vocab_size}; the shard is corrupt")
        rank_cost_N = plan.rank_cost_N
        return {"tokens": tokens_BS,
                "segment_ids": np.repeat(segment_P, length_P).astype(np.int32).reshape(shape),
                "positions": positions.astype(np.int32).reshape(shape),
                "stats": BatchStats(
                    batch=plan.index,
                    attention_cost_max_over_mean=packing.max_over_mean(rank_cost_N),
                    rank_cost_N=rank_cost_N,
                    documents_split=int(len(plan.doc_P) - len(np.unique(plan.doc_P))))}


class BatchIterator(grain.DatasetIterator):
    """This process's batches: dicts of int32 [B, S] `tokens`, `segment_ids`, `positions`.

    `stats` describes the batch last returned.  `get_state()` is a small JSON-able dict
    naming the next batch; `set_state(state)` on a freshly built iterator (same corpus
    and settings) makes it yield exactly what the saved one would have yielded next.
    """

    def __init__(self, parent: grain.DatasetIterator):
        super().__init__(parent)
        self.stats: BatchStats | None = None
        _live_iterators.add(self)

    def __next__(self) -> dict[str, np.ndarray]:
        element = next(self._parent)
        self.stats = element.pop("stats")
        return element

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state)


# A prefetch thread still running when the interpreter finalizes is killed inside native
# code and aborts the process (exit 134), so live iterators are closed at exit.
_live_iterators: weakref.WeakSet[BatchIterator] = weakref.WeakSet()


@atexit.register
def _close_live_iterators() -> None:
    for iterator in list(_live_iterators):
        iterator.close()
        # Drop the pipeline now: Grain's prefetch iterator would otherwise run its
        # __del__ during module teardown and print an ignored exception.
        iterator._parents = ()


def make_batch_iterator(corpus: TokenCorpus, *, seq_len: int, global_batch_size: int,
                        n_ranks: int = 1, seed: int = 0, balance: bool = True,
                        max_documents: int | None = None, process_index: int = 0,
                        process_count: int = 1, prefetch: int = 2) -> BatchIterator:
    """Infinite iterator of this process's rows [i·B, (i+1)·B), B = global_batch_size / P."""
    _validate(seq_len=seq_len, global_batch_size=global_batch_size, n_ranks=n_ranks, seed=seed,
              max_documents=max_documents, process_index=process_index,
              process_count=process_count, prefetch=prefetch)
    n_documents = min(len(corpus), max_documents or len(corpus))
    fingerprint = {"corpus": _corpus_id(corpus), "documents": n_documents, "seq_len": seq_len,
                   "global_batch_size": global_batch_size, "n_ranks": n_ranks, "seed": seed,
                   "balance": balance}
    # repeat() after shuffle: the shuffle reseeds per epoch (index // length), so every
    # epoch is a new permutation; indexing it is O(1) memory, never a materialized list.
    order = grain.MapDataset.range(n_documents).shuffle(seed=seed).repeat()
    planner = _Planner(corpus, order, seq_len=seq_len, n_rows=global_batch_size,
                       n_ranks=n_ranks, balance=balance)
    rows = global_batch_size // process_count
    dataset = _PlanDataset(order, planner, fingerprint).map(
        _ReadRows(corpus, lo=process_index * rows, hi=(process_index + 1) * rows,
                  seq_len=seq_len))
    if prefetch:
        dataset = grain.experimental.ThreadPrefetchIterDataset(
            dataset, prefetch_buffer_size=prefetch)
    return BatchIterator(iter(dataset))


def _corpus_id(corpus: TokenCorpus) -> str:
    digest = hashlib.sha256("".join(s.tokens_sha256 for s in corpus.manifest.shards).encode())
    return digest.hexdigest()[:16]


def _validate(*, seq_len, global_batch_size, n_ranks, seed, max_documents, process_index,
              process_count, prefetch) -> None:
    if seq_len < MIN_SEQ_LEN:
        raise DataError(f"data.seq_len: {seq_len} is below the minimum {MIN_SEQ_LEN}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} not in [0, process_count="
                        f"{process_count})")
    if n_ranks < 1 or n_ranks % process_count:
        raise DataError(f"ranks: {n_ranks} devices do not split evenly over {process_count} "
                        "processes")
    if global_batch_size < 1 or global_batch_size % n_ranks:
        raise DataError(f"data.global_batch_size: {global_batch_size} is not a positive "
                        f"multiple of the {n_ranks} ranks")
    if not 0 <= seed < 2**32:  # Grain's index shuffle takes a uint32 seed
        raise DataError(f"data.seed: {seed} not in [0, 2**32)")
    if max_documents is not None and max_documents < 1:
        raise DataError(f"data.max_documents: {max_documents} must be >= 1 or null (all)")
    if prefetch < 0:
        raise DataError(f"data.prefetch: {prefetch} must be >= 0")


# ----------------------------------------------------------------------------- from a config


def open_corpus(cfg: Config) -> TokenCorpus:
    """The configured corpus, checked against the model's vocab and the expected tokenizer."""
    from europa_jax import prepare

    data = cfg.data
    path = prepare.stdlib_corpus() if data.source == "stdlib" else Path(data.path)
    corpus = TokenCorpus(path)
    manifest_path = path / MANIFEST
    vocab = int(corpus.manifest.tokenizer["vocab_size"])
    if vocab > cfg.model.vocab_size:
        raise DataError(f"{manifest_path}: tokenizer vocab {vocab} > model.vocab_size "
                        f"{cfg.model.vocab_size}; the model cannot embed every token")
    if data.tokenizer is not None:
        kind, sha = _tokenizer_identity(data.tokenizer)
        have = corpus.manifest.tokenizer
        if (kind, sha) != (have["kind"], have.get("sha256")):
            raise DataError(f"{manifest_path}: corpus was prepared with {have['kind']} "
                            f"'{have['name']}' (sha256 {str(have.get('sha256'))[:12]}) but "
                            f"data.tokenizer is {data.tokenizer} (sha256 {str(sha)[:12]})")
    return corpus


def _tokenizer_identity(spec: str) -> tuple[str, str | None]:
    if spec == "bytes":
        return "bytes", None
    try:
        return "huggingface", hashlib.sha256(Path(spec).read_bytes()).hexdigest()
    except OSError as e:
        raise DataError(f"data.tokenizer: {spec}: cannot read ({e.strerror or e}); expected "
                        "'bytes' or a tokenizer.json") from None


def batch_iterator_for(cfg: Config, *, process_index: int = 0, process_count: int = 1
                       ) -> BatchIterator:
    """The loop's iterator: ranks are the mesh's devices (the batch is sharded over all)."""
    data = cfg.data
    return make_batch_iterator(
        open_corpus(cfg), seq_len=data.seq_len, global_batch_size=data.global_batch_size,
        n_ranks=cfg.mesh.n_devices, seed=data.seed, balance=data.balance,
        max_documents=data.max_documents, process_index=process_index,
        process_count=process_count, prefetch=data.prefetch)
