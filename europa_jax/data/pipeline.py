"""Training input pipeline on Grain: shuffled documents → balanced packed rows → this process.

    MapDataset.range(docs).shuffle(seed).repeat()      a fresh permutation every epoch
      → _PlanDataset          B·S tokens of the stream (pieces of a window of batches,
                              shuffled), packed into B rows and laid out over J ranks
                              (lengths only: no tokens are read; batch_plan.py)
      → .map(_ReadRows)       this process's rows: tokens, segment_ids, positions
      → ThreadPrefetch        batches are made while the step runs
      → BatchIterator         what the loop holds: __next__, .stats, get_state/set_state

Every process computes the same plan for the whole global batch from document lengths
(8 bytes of metadata per document), then reads the tokens of its own rows only.  Rows
are device-major (row r lives on rank r // (B / J)); process i holds ranks
[i·J/n, (i+1)·J/n) and so rows [i·B/n, (i+1)·B/n), the contiguous block that
`jax.make_array_from_process_local_data` expects for a batch sharded over (data, expert).

Per row (B rows of this process, S = seq_len):
* ``tokens_BS``: the global batches of a window (`window_batches`, data.shuffle_window_tokens)
  are exactly the window's next W·B·S tokens of the shuffled stream, cut into pieces of at
  most one row and shuffled, so no token is lost or duplicated and a batch mixes many
  documents even when one document is longer than a batch (W = 0: each batch is the next
  B·S tokens).  A document longer than a row, or one that does not fit, is split; a piece
  never shares a segment with another.
* ``segment_ids_BS``: 1, 2, 3, ... per document piece within a row (0 = padding; rows
  are always full, so it does not occur).
* ``positions_BS``: position within the piece, restarting at 0 for every piece,
  including the continuation of a split document (it cannot attend to its head anyway).

Shape suffixes (europa_jax/__init__.py): Z placed pieces, I sources, J ranks.

The iterator state is three integers (the batch index, and the stream position where its
window starts) plus a fingerprint of the pipeline settings; it is global (the same on every
process), so a run can resume with a different process count.
"""

from __future__ import annotations

import atexit
import hashlib
import weakref
from dataclasses import dataclass
import grain
import numpy as np

from europa_jax.config import MIN_SEQ_LEN
from europa_jax.data import packing
from europa_jax.data.batch_plan import BatchPlan, Planner, Stream
from europa_jax.data.corpus import DataError, TokenCorpus


@dataclass(frozen=True, kw_only=True)
class BatchStats:
    """Host-side facts about the batch just returned (never sent to the device)."""

    batch: int
    attention_cost_max_over_mean: float  # over ranks
    node_attention_cost_max_over_mean: float  # over nodes (ranks_per_node consecutive ranks)
    rank_cost_J: np.ndarray   # Σ piece length² per rank (every rank holds B/J · S tokens)
    documents_split: int      # documents cut into more than one piece in this batch
    documents_Z: np.ndarray   # corpus index of each piece in this process's rows
    sources_Z: np.ndarray     # the source (data.sources) of each of those pieces
    source_tokens_I: np.ndarray  # tokens of each source in the whole global batch
    source_epochs_I: np.ndarray  # epochs of each source's documents consumed so far


class _PlanIterator(grain.DatasetIterator):
    def __init__(self, planner: Planner, fingerprint: dict, paths: list[str]):
        super().__init__()
        self._planner, self._fingerprint = planner, fingerprint
        self._paths = paths  # the corpora's directories: for messages, not the fingerprint
        self._batch = 0
        self._positions = [0] * len(planner.streams)
        self._offsets = [0] * len(planner.streams)

    def __next__(self) -> BatchPlan:
        plan, self._positions, self._offsets = self._planner.plan(
            self._batch, self._positions, self._offsets)
        self._batch += 1
        return plan

    def get_state(self) -> dict:
        if len(self._positions) == 1:  # one corpus: the state as it always was
            where = {"position": self._positions[0], "offset": self._offsets[0]}
        else:
            where = {"positions": list(self._positions), "offsets": list(self._offsets)}
        return {"batch": self._batch, **where, "pipeline": dict(self._fingerprint),
                "corpus_paths": list(self._paths)}

    def set_state(self, state: dict) -> None:
        saved = state.get("pipeline")
        if saved != self._fingerprint:
            saved = saved or {}
            was = ", ".join(state.get("corpus_paths") or ["paths not recorded"])
            changes = [f"corpus {saved.get(k)} ({was}) → {v} ({', '.join(self._paths)})"
                       if k == "corpus" else f"{k} {saved.get(k)!r} → {v!r}"
                       for k, v in self._fingerprint.items() if saved.get(k) != v]
            way_on = ("Resume with the data settings it was saved with, or train into a "
                      "new --run-dir")
            if "shuffle_window" not in saved and "shuffle_window" in self._fingerprint:
                way_on = ("It was saved before batches were shuffled across a window: "
                          "resume it with --set data.shuffle_window_tokens=0, or train into "
                          "a new --run-dir")
            raise DataError(f"data iterator state was saved for a different pipeline: "
                            f"{'; '.join(changes)}. {way_on}")
        self._batch = int(state["batch"])
        if "positions" in state:
            self._positions = [int(p) for p in state["positions"]]
            self._offsets = [int(o) for o in state["offsets"]]
        else:
            self._positions, self._offsets = [int(state["position"])], [int(state["offset"])]


class _PlanDataset(grain.IterDataset):
    def __init__(self, order: grain.MapDataset, planner: Planner, fingerprint: dict,
                 paths: list[str]):
        super().__init__(order)
        self._planner, self._fingerprint, self._paths = planner, fingerprint, paths

    def __iter__(self) -> _PlanIterator:
        return _PlanIterator(self._planner, self._fingerprint, self._paths)


class _ReadRows:
    """Plan → this process's rows [lo, hi): reads only those rows' tokens."""

    def __init__(self, corpora: list[TokenCorpus], *, lo: int, hi: int, seq_len: int,
                 ranks_per_node: int):
        self.corpora, self.lo, self.hi, self.seq_len = corpora, lo, hi, seq_len
        self.ranks_per_node = ranks_per_node
        self.vocab_size = int(corpora[0].manifest.tokenizer["vocab_size"])

    def __call__(self, plan: BatchPlan) -> dict:
        a, b = np.searchsorted(plan.row_Z, [self.lo, self.hi])
        doc_Z, start_Z, length_Z = plan.doc_Z[a:b], plan.start_Z[a:b], plan.length_Z[a:b]
        source_Z, row_Z = plan.source_Z[a:b], plan.row_Z[a:b] - self.lo
        pieces = [None] * len(doc_Z)
        for k in np.unique(source_Z):
            mine = np.flatnonzero(source_Z == k)
            read = self.corpora[k].read_many(doc_Z[mine], start_Z[mine],
                                             start_Z[mine] + length_Z[mine])
            for i, piece in zip(mine, read):
                pieces[i] = piece
        shape = (self.hi - self.lo, self.seq_len)
        # Pieces are sorted by row and every row is exactly full, so the concatenation
        # is the row-major token matrix.
        tokens_BS = np.concatenate(pieces).astype(np.int32).reshape(shape)
        first_Z = np.searchsorted(row_Z, row_Z)  # index of the row's first piece
        segment_Z = np.arange(len(row_Z)) - first_Z + 1
        piece_start_Z = np.cumsum(length_Z) - length_Z
        positions = np.arange(tokens_BS.size) - np.repeat(piece_start_Z, length_Z)
        if int(tokens_BS.max(initial=0)) >= self.vocab_size:
            bad = int(np.searchsorted(np.cumsum(length_Z), np.argmax(tokens_BS >= self.vocab_size),
                                      side="right"))
            raise DataError(f"{self.corpora[source_Z[bad]].path}: document {doc_Z[bad]} holds "
                            f"a token id >= the manifest's vocab {self.vocab_size}; the shard "
                            "is corrupt")
        rank_cost_J = plan.rank_cost_J
        return {"tokens": tokens_BS,
                "segment_ids": np.repeat(segment_Z, length_Z).astype(np.int32).reshape(shape),
                "positions": positions.astype(np.int32).reshape(shape),
                "stats": BatchStats(
                    batch=plan.index,
                    attention_cost_max_over_mean=packing.max_over_mean(rank_cost_J),
                    node_attention_cost_max_over_mean=packing.max_over_mean(
                        packing.rank_cost(rank_cost_J, len(rank_cost_J) // self.ranks_per_node)),
                    rank_cost_J=rank_cost_J,
                    documents_split=_documents_split(plan),
                    documents_Z=doc_Z, sources_Z=source_Z,
                    source_tokens_I=plan.source_tokens_I,
                    source_epochs_I=plan.source_epochs_I)}


def _documents_split(plan: BatchPlan) -> int:
    """Documents cut into more than one piece in this batch (a document is its source and
    its index)."""
    keys = plan.source_Z * (int(plan.doc_Z.max(initial=0)) + 1) + plan.doc_Z
    return int(len(keys) - len(np.unique(keys)))


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


@dataclass(frozen=True, kw_only=True)
class Source:
    """One corpus of a mixture, its share of every batch's tokens, and which of its
    documents to draw from (None: all, or the first `max_documents`)."""

    corpus: TokenCorpus
    weight: float = 1.0
    documents: np.ndarray | None = None


def make_batch_iterator(corpus: TokenCorpus, *, documents: np.ndarray | None = None,
                        **kwargs) -> BatchIterator:
    """Infinite iterator of this process's rows [i·B, (i+1)·B), B = global_batch_size / P,
    from one corpus (make_mixture_iterator's keyword arguments).

    `documents`: the corpus indices to draw from (e.g. split_documents' training part);
    default all (the first `max_documents`).
    """
    return make_mixture_iterator([Source(corpus=corpus, documents=documents)], **kwargs)


def make_mixture_iterator(sources: list[Source], *, seq_len: int, global_batch_size: int,
                          n_ranks: int = 1, seed: int = 0, balance: bool = True,
                          max_documents: int | None = None, process_index: int = 0,
                          process_count: int = 1, prefetch: int = 2, ranks_per_node: int = 1,
                          balance_nodes: bool = False, window_batches: int = 0
                          ) -> BatchIterator:
    """This process's rows of global batches mixing `sources` by weight (batch_plan.py).

    `ranks_per_node`: consecutive ranks of one node (mesh.node_group), for the per-node
    attention cost; `balance_nodes`: balance nodes rather than ranks (attention context
    parallelism: a node's GPUs share its rows' attention); `window_batches`: global batches
    whose pieces are shuffled together (batch_plan.py; 0: each batch is the stream's next
    B·S tokens).
    """
    _validate(seq_len=seq_len, global_batch_size=global_batch_size, n_ranks=n_ranks, seed=seed,
              max_documents=max_documents, process_index=process_index,
              process_count=process_count, prefetch=prefetch)
    if window_batches < 0:
        raise DataError(f"data.shuffle_window_tokens: a window of {window_batches} batches; "
                        "expected >= 0")
    if ranks_per_node < 1 or n_ranks % ranks_per_node:
        raise DataError(f"mesh: {ranks_per_node} ranks per node (of mesh.expert within "
                        f"mesh.devices_per_node) do not divide the {n_ranks} ranks")
    streams, prints, seeds = [], [], []
    for k, source in enumerate(sources):
        # one corpus keeps the seed as it always was; the others derive theirs from it
        seeds.append((seed + 1_000_003 * k) % 2**32)
        stream, ident = _stream(source, max_documents, seeds[-1])
        streams.append(stream)
        prints.append(ident if len(sources) == 1 else {**ident, "weight": source.weight})
    shape = {"seq_len": seq_len, "global_batch_size": global_batch_size, "n_ranks": n_ranks,
             "seed": seed, "balance": balance}
    if balance_nodes:  # only then: fingerprints of runs from before the option stay equal
        shape["balance_nodes"] = ranks_per_node
    if window_batches:  # likewise: W = 0 is the stream order of runs saved before windows
        shape["shuffle_window"] = window_batches
    fingerprint = ({**prints[0], **shape} if len(sources) == 1
                   else {"sources": prints, **shape})
    planner = Planner(streams, [s.weight for s in sources], seq_len=seq_len,
                      n_rows=global_batch_size, n_ranks=n_ranks, balance=balance,
                      ranks_per_unit=ranks_per_node if balance_nodes else 1,
                      window_batches=window_batches, shuffle_seeds=seeds)
    rows = global_batch_size // process_count
    paths = [str(s.corpus.path) for s in sources]
    dataset = _PlanDataset(streams[0].order, planner, fingerprint, paths).map(
        _ReadRows([s.corpus for s in sources], lo=process_index * rows,
                  hi=(process_index + 1) * rows, seq_len=seq_len,
                  ranks_per_node=ranks_per_node))
    if prefetch:
        dataset = grain.experimental.ThreadPrefetchIterDataset(
            dataset, prefetch_buffer_size=prefetch)
    return BatchIterator(iter(dataset))


def _stream(source: Source, max_documents: int | None, seed: int) -> tuple[Stream, dict]:
    """A source's document stream and what identifies it in the iterator's fingerprint."""
    corpus = source.corpus
    n_documents = min(len(corpus), max_documents or len(corpus))
    ident = {"corpus": _corpus_id(corpus), "documents": n_documents}
    # repeat() after shuffle: the shuffle reseeds per epoch (index // length), so every
    # epoch is a new permutation; indexing it is O(1) memory, never a materialized list.
    if source.documents is None:
        order = grain.MapDataset.range(n_documents).shuffle(seed=seed).repeat()
        return Stream(corpus=corpus, order=order, n_documents=n_documents), ident
    documents = np.asarray(source.documents, dtype=np.int64)
    if not len(documents) or documents.max() >= len(corpus) or documents.min() < 0:
        raise DataError(f"{corpus.path}: documents to draw from must be a non-empty "
                        f"subset of its {len(corpus)} documents")
    ident.update(documents=len(documents), document_ids=hashlib.sha256(
        documents.astype("<i8").tobytes()).hexdigest()[:16])
    order = (grain.MapDataset.range(len(documents)).shuffle(seed=seed).repeat()
             .map(lambda i: int(documents[i])))
    return Stream(corpus=corpus, order=order, n_documents=len(documents)), ident


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
