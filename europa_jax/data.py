"""Embedded default corpus + sequence-packing input pipeline (no download).

The default corpus is the running interpreter's own standard library source:
it exists on every machine that can run us, needs no network, and is a few
tens of MB of real text -- enough for smoke tests and tiny-model training.

Tokenisation is byte level: tokens 0..255 are raw bytes and ``EOS_ID`` (256)
is appended to every document, so the model's vocab must be at least
``BYTE_VOCAB_SIZE`` (the caller validates that).

Pipeline (all Grain, so the returned iterator is checkpointable through
``get_state()`` / ``set_state()``)::

    MapDataset(paths) -> shuffle(seed) -> repeat() -> map(read + encode)
        -> to_iter_dataset -> ConcatThenSplitIterDataset(seq_len) -> batch

Per-row semantics (B = this process's rows, S = seq_len):

* ``tokens_BS``: documents are concatenated in shuffled order and cut into
    rows of exactly ``S`` tokens; a document longer than the space left in a row
    continues at the start of the next row.  Within an epoch no token is lost or
    duplicated.  The stream is infinite (epochs follow each other, each with a
    fresh permutation), so rows are always full and there is no padding.
* ``segment_ids_BS``: 1, 2, 3, ... numbering the document pieces within a
    row in order; 0 would mean padding (it cannot occur with the infinite
    stream, but consumers should still treat 0 as "no document").
* ``positions_BS``: position within the document piece.  Positions restart at
    0 at every segment start -- including the continuation of a document that
    was split across rows (the continuation cannot attend to the previous row
    anyway, so restarting keeps RoPE positions consistent with what it sees).
"""

from __future__ import annotations

import functools
import os
import pathlib
import sysconfig
from collections.abc import Iterator, Mapping, Sequence

import grain
import numpy as np

EOS_ID = 256
BYTE_VOCAB_SIZE = 257
KNOWN_SOURCES = ("stdlib",)

# Directories pruned from the stdlib walk: third-party packages are not part
# of the stdlib and the test suites are huge, noisy (binary-ish fixtures,
# intentionally malformed code) and would dominate the corpus.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
)


def stdlib_sources(max_documents: int | None = None) -> list[pathlib.Path]:
    """Sorted ``.py`` files of this interpreter's stdlib (first ``max_documents``)."""
    if max_documents is not None and max_documents < 1:
        raise ValueError(
            f"data.max_documents must be >= 1 or None (all), got {max_documents}"
        )
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found: list[pathlib.Path] = []
    # os.walk (not rglob) so excluded trees are pruned instead of traversed.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        found.extend(pathlib.Path(dirpath) / f for f in filenames if f.endswith(".py"))
    if not found:
        raise FileNotFoundError(f"no stdlib .py files found under {root}")
    # Walk order is filesystem dependent; sorting makes the corpus (and hence
    # the shuffled order for a seed) identical on every host of a job.
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return found if max_documents is None else found[:max_documents]


def encode_bytes(text_or_bytes: str | bytes) -> np.ndarray:
    """Byte-level tokens (int32) with ``EOS_ID`` appended."""
    if isinstance(text_or_bytes, str):
        text_or_bytes = text_or_bytes.encode("utf-8")
    tokens_T = np.empty(len(text_or_bytes) + 1, dtype=np.int32)
    tokens_T[:-1] = np.frombuffer(text_or_bytes, dtype=np.uint8)
    tokens_T[-1] = EOS_ID
    return tokens_T


def _read_document(path: str) -> dict[str, np.ndarray]:
    # Runs lazily inside the pipeline, so construction never reads the corpus.
    return {"tokens": encode_bytes(pathlib.Path(path).read_bytes())}


def _stack_process_rows(
    rows: Sequence[Mapping[str, np.ndarray]], *, lo: int, hi: int
) -> dict[str, np.ndarray]:
    # Every process packs the full global batch (packing is sequential, so rows
    # cannot be produced independently) and keeps only its contiguous slice;
    # this makes the union over processes exactly the single-process batch.
    mine = rows[lo:hi]
    return {
        "tokens": np.stack([r["tokens"] for r in mine]).astype(np.int32),
        "segment_ids": np.stack([r["tokens_segment_ids"] for r in mine]).astype(
            np.int32
        ),
        "positions": np.stack([r["tokens_positions"] for r in mine]).astype(
            np.int32
        ),
    }


def _tuplify_remainder_slices(state):
    if not isinstance(state, Mapping):
        return state
    return {
        k: (
            {f: tuple(sl) for f, sl in v.items()}
            if k == "remainder_slices"
            else _tuplify_remainder_slices(v)
        )
        for k, v in state.items()
    }


class _JsonSafeStateIterator(grain.DatasetIterator):
    """Pass-through iterator whose ``set_state`` accepts JSON-round-tripped state.

    Grain 0.2.18's ConcatThenSplit stores ``remainder_slices`` as tuples and
    tests ``slice != (-1, -1)``.  After a JSON round trip (which is what
    ``DatasetIterator.save`` / Orbax do) the tuples come back as lists, the
    comparison is always true, and a restore taken at a row boundary that
    coincides with a document boundary silently drops a whole document.
    Converting the slices back to tuples makes restores exact.
    """

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._parent)

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        self._parent.set_state(_tuplify_remainder_slices(state))


def _validate(
    *,
    source: str,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
) -> None:
    if source not in KNOWN_SOURCES:
        raise ValueError(
            f"data.source: unknown source {source!r}; expected one of:"
            f" {', '.join(KNOWN_SOURCES)}"
        )
    if seq_len < 2:
        raise ValueError(f"data.seq_len must be >= 2, got {seq_len}")
    if process_count < 1:
        raise ValueError(f"process_count must be >= 1, got {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index must be in [0, {process_count}), got {process_index}"
        )
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(
            f"data.global_batch_size must be a positive multiple of process_count"
            f" ({process_count}), got {global_batch_size}"
        )
    # Grain's index shuffle takes a uint32 seed.
    if not 0 <= seed < 2**32:
        raise ValueError(f"data.seed must be in [0, 2**32), got {seed}")


def make_batch_iterator(
    *,
    source: str,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    max_documents: int | None,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """Infinite iterator of this process's packed batches.

    Returns a ``grain.DatasetIterator``: use ``get_state()`` / ``set_state()``
    (JSON-serialisable, JSON round trips restore exactly) to checkpoint and
    restore the input position.  Each batch is a dict with
    int32 arrays ``tokens``, ``segment_ids``, ``positions`` of shape
    ``[global_batch_size // process_count, seq_len]``; process ``i`` gets rows
    ``[i * B, (i + 1) * B)`` of every global batch.
    """
    _validate(
        source=source,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    paths = [str(p) for p in stdlib_sources(max_documents)]
    docs = (
        grain.MapDataset.source(paths)
        .shuffle(seed=seed)
        # repeat() after shuffle: ShuffleMapDataset derives a per-epoch seed
        # from the index // len, so every epoch gets a different permutation.
        .repeat()
        .map(_read_document)
    )
    # num_threads=0: documents are small local files, reading them is cheaper
    # than thread hand-off + GIL contention; it also keeps the state a plain
    # {"next_index": n}.
    docs_iter = docs.to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    )
    # ConcatThenSplit adds tokens_segment_ids (1.., 0 = padding) and
    # tokens_positions (restart at 0 for every piece, including the
    # continuation of a split document) -- exactly the semantics we want.
    rows_S = grain.experimental.ConcatThenSplitIterDataset(
        docs_iter, length_struct={"tokens": seq_len}
    )
    rows_per_process = global_batch_size // process_count
    lo = process_index * rows_per_process
    batches_BS = rows_S.batch(
        global_batch_size,
        drop_remainder=True,
        batch_fn=functools.partial(
            _stack_process_rows, lo=lo, hi=lo + rows_per_process
        ),
    )
    return _JsonSafeStateIterator(iter(batches_BS))
