"""Packing documents into fixed-length rows, and balancing rows across ranks.

Pure NumPy on document *lengths*: every process computes the same plan for the whole
global batch from metadata alone, then reads only the tokens of its own rows.

Attention with a document mask costs Σ L² per row (one L×L causal triangle per
document piece), so at 65,536 tokens a row holding one long document costs up to ~60×
a row of 1K-token documents while both hold the same tokens.  Every rank then waits
for the most expensive one.  `pack_balanced` spreads long pieces over ranks (longest
first onto the cheapest rank with room: LPT scheduling, Graham 1969); rows stay exactly
full, so token counts per rank are equal by construction.

Shape suffixes (europa_jax/__init__.py): X the chunk's pieces in stream order, Z placed
pieces, B rows, J ranks, S seq_len.

* a *chunk* is one global batch's B·S tokens as pieces of documents (batch_plan.py: the
  next tokens of the shuffled document stream, or pieces drawn from a shuffled window of
  them).  Every global batch is exactly one chunk, whatever the layout, which is what
  makes "no token lost or duplicated" hold by construction.
* a *placement* says: tokens [offset, offset + length) of chunk piece c go to row r.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where each piece of a chunk goes; arrays of equal length P, sorted by (row, piece)."""

    piece_Z: np.ndarray   # index into the chunk
    offset_Z: np.ndarray  # first token taken from that chunk piece
    length_Z: np.ndarray
    row_Z: np.ndarray

    def row_cost(self, n_rows: int) -> np.ndarray:
        """Σ length² per row: the document-masked attention cost (float64: 65K² × pieces)."""
        return np.bincount(self.row_Z, weights=self.length_Z.astype(np.float64) ** 2,
                           minlength=n_rows)


def _sorted(piece, offset, length, row) -> Placement:
    as64 = [np.asarray(a, dtype=np.int64) for a in (piece, offset, length, row)]
    order = np.lexsort((as64[1], as64[0], as64[3]))  # by row, then stream order
    return Placement(piece_Z=as64[0][order], offset_Z=as64[1][order],
                     length_Z=as64[2][order], row_Z=as64[3][order])


def pack_in_order(length_X: np.ndarray, *, seq_len: int) -> Placement:
    """Concatenate-then-split: row r holds stream tokens [r·S, (r+1)·S) (no balancing)."""
    ends_X = np.cumsum(length_X)
    total = int(ends_X[-1])
    if total % seq_len:
        raise ValueError(f"chunk of {total} tokens is not a whole number of {seq_len}-token rows")
    # Every piece boundary and every row boundary starts a placed piece.
    starts = np.union1d(np.concatenate([[0], ends_X[:-1]]), np.arange(0, total, seq_len))
    lengths = np.diff(np.append(starts, total))
    piece = np.searchsorted(ends_X, starts, side="right")
    offset = starts - (ends_X[piece] - length_X[piece])
    return _sorted(piece, offset, lengths, starts // seq_len)


def pack_balanced(length_X: np.ndarray, *, seq_len: int, n_ranks: int = 1) -> Placement:
    """Fill rows exactly, longest piece first onto the cheapest rank with room for it.

    Rows are device-major: rank j owns rows [j·k, (j+1)·k), k = B / J.  A piece goes to
    the rank with the lowest Σ length² that has a row with room for it, into that
    rank's fullest such row (best fit keeps big holes for big pieces).  Pieces longer
    than a row are cut into full rows first, spread over ranks the same way (each costs
    S², nothing can share them).  A piece that fits in no row is cut to fill the row with
    the most room and its rest goes back into the queue; since the chunk holds exactly
    B·S tokens every row ends full.  Deterministic: ties go to the lower row / earlier
    piece, so every process computes the same plan.
    """
    length_X = np.asarray(length_X, dtype=np.int64)
    total = int(length_X.sum())
    if total % seq_len:
        raise ValueError(f"chunk of {total} tokens is not a whole number of {seq_len}-token rows")
    n_rows = total // seq_len
    if n_rows % n_ranks:
        raise ValueError(f"{n_rows} rows do not split evenly over {n_ranks} ranks")
    rank_of_row = np.arange(n_rows) // (n_rows // n_ranks)
    free_B = np.full(n_rows, seq_len, dtype=np.int64)
    rank_cost_J = np.zeros(n_ranks, dtype=np.float64)
    piece, offset, length, row = [], [], [], []
    # Max-heap on length; the piece index breaks ties so the order is reproducible.
    queue = []
    for c, n in enumerate(length_X.tolist()):
        full, rest = divmod(n, seq_len)
        queue += [(-seq_len, c, k * seq_len) for k in range(full)]
        if rest:
            queue.append((-rest, c, full * seq_len))
    heapq.heapify(queue)
    while queue:
        neg_n, c, off = heapq.heappop(queue)
        n = -neg_n
        fits = free_B >= n
        if fits.any():
            cost_B = np.where(fits, rank_cost_J[rank_of_row], np.inf)
            best = cost_B == cost_B.min()
            r = int(np.where(best, free_B, np.iinfo(np.int64).max).argmin())
        else:  # fits nowhere: fill the roomiest row, requeue the rest
            r = int(free_B.argmax())
            heapq.heappush(queue, (-(n - int(free_B[r])), c, off + int(free_B[r])))
            n = int(free_B[r])
        piece.append(c), offset.append(off), length.append(n), row.append(r)
        free_B[r] -= n
        rank_cost_J[rank_of_row[r]] += float(n) ** 2
    return _sorted(piece, offset, length, row)


def pack(length_X: np.ndarray, *, seq_len: int, n_ranks: int, balance: bool,
         ranks_per_unit: int = 1) -> Placement:
    """The global batch layout: stream order, or balanced when that lowers the slowest rank.

    `ranks_per_unit`: ranks that compute attention together (execution.attention_context_parallel:
    a node's GPUs share the attention of the node's rows), balanced as one unit — their
    rows' Σ length² together, so a long document shares its node with light rows.

    LPT keeps documents whole, so when over-long documents fill whole rows it can leave
    one rank with two S² rows where stream order's arbitrary cuts would not; the step
    waits for the most expensive rank, so the cheaper maximum wins (ties: balanced).
    """
    in_order = pack_in_order(length_X, seq_len=seq_len)
    if not balance:
        return in_order
    if n_ranks % ranks_per_unit:
        raise ValueError(f"{n_ranks} ranks do not split into units of {ranks_per_unit}")
    units = n_ranks // ranks_per_unit
    balanced = pack_balanced(length_X, seq_len=seq_len, n_ranks=units)
    n_rows = int(np.sum(length_X)) // seq_len
    worst = [rank_cost(p.row_cost(n_rows), units).max() for p in (balanced, in_order)]
    return balanced if worst[0] <= worst[1] else in_order


def rank_cost(row_cost_B: np.ndarray, n_ranks: int) -> np.ndarray:
    """Σ row cost per rank for the device-major layout."""
    return row_cost_B.reshape(n_ranks, -1).sum(axis=1)


def max_over_mean(values: np.ndarray) -> float:
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else 1.0
