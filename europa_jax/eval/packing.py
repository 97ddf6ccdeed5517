"""Scoring requests packed into the rows of the evaluation forward.

lm-eval asks for the log-likelihood of many short continuations (a multiple-choice
question is one request per choice, tens of tokens each). One request per row would leave
most of a training-length row as padding, so requests are placed back to back in rows the
way the data pipeline packs documents for training: each its own segment (document id),
positions restarting at 0, so the causal document mask keeps them apart and every request
is scored as if it were alone in a row. Rows are filled best-fit in order of decreasing
length, then cut into batches of the forward's row count; the last batch is padded with
empty rows (segment 0).

A request is cut as lm-eval's Hugging Face backend cuts it: the model reads
`(context + continuation)[-(L + 1):][:-1]` for rows of L positions and is scored on its
last `len(continuation)` predictions, so log-likelihoods match it request by request.

Shape suffixes (europa_jax/__init__.py): B rows, S positions.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Scoring:
    """One request: the model reads `inputs`, position j predicts `targets[j]`, and the
    last `scored` predictions are the continuation's."""

    inputs: np.ndarray   # int32 [n]
    targets: np.ndarray  # int32 [n]: inputs shifted left by one, then the last token
    scored: int


def scoring(context: list[int], continuation: list[int], length: int) -> Scoring:
    """The request as rows of `length` positions hold it (the context cut from the left)."""
    if not context or not continuation:
        raise ValueError("a scored request needs a context token and a continuation token")
    if len(continuation) > length:
        raise ValueError(f"a continuation of {len(continuation)} tokens does not fit the "
                         f"evaluation rows of {length} (train.eval_tasks_seq_len)")
    whole = np.asarray((context + continuation)[-(length + 1):], np.int32)
    return Scoring(inputs=whole[:-1], targets=whole[1:], scored=len(continuation))


@dataclasses.dataclass(frozen=True)
class Batch:
    """One forward's rows, and where each request of it is scored."""

    tokens_BS: np.ndarray
    segments_BS: np.ndarray   # 1, 2, … per request in a row; 0 = padding
    positions_BS: np.ndarray  # from 0 in every request
    targets_BS: np.ndarray
    # (request index, row, first scored position, end): the positions that are its score
    spans: tuple[tuple[int, int, int, int], ...]


def pack(requests: list[Scoring], rows: int, length: int) -> list[Batch]:
    """Every request placed in a row of `length` positions; batches of `rows` rows."""
    placed = _best_fit([len(r.inputs) for r in requests], length)
    batches = []
    for first in range(0, len(placed), rows):
        shape = (rows, length)
        tokens, segments, positions, targets = (np.zeros(shape, np.int32) for _ in range(4))
        spans = []
        for b, row in enumerate(placed[first:first + rows]):
            start = 0
            for segment, i in enumerate(row, start=1):
                r = requests[i]
                n = len(r.inputs)
                stop = start + n
                tokens[b, start:stop] = r.inputs
                targets[b, start:stop] = r.targets
                segments[b, start:stop] = segment
                positions[b, start:stop] = np.arange(n, dtype=np.int32)
                spans.append((i, b, stop - r.scored, stop))
                start = stop
        batches.append(Batch(tokens, segments, positions, targets, tuple(spans)))
    return batches


def _best_fit(sizes: list[int], length: int) -> list[list[int]]:
    """Rows of request indices: longest first, each into the fullest row it still fits
    (the same layout on every process: ties go to the lower index)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free positions, row), sorted
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        size = sizes[i]
        if not 0 < size <= length:
            raise ValueError(f"request {i}: {size} tokens do not fit rows of {length}")
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            space, row = free.pop(at)
        else:
            space, row = length, len(rows)
            rows.append([])
        rows[row].append(i)
        if space - size:
            bisect.insort(free, (space - size, row))
    return rows


def totals(batch: Batch, logprob_BS: np.ndarray, greedy_BS: np.ndarray,
           into: list) -> None:
    """Each request's (sum of its scored log-probabilities, all of them greedy) into
    `into[request index]`."""
    for i, b, start, stop in batch.spans:
        into[i] = (float(logprob_BS[b, start:stop].sum(dtype=np.float64)),
                   bool(greedy_BS[b, start:stop].all()))
