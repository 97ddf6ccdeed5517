"""Tests for europa_jax.data.packing: exact row filling, conservation, balance."""

import numpy as np
import pytest

from europa_jax.data import packing

S = 64


def long_tailed_lengths(rng, n_rows, seq_len=S):
    """Random lengths (some longer than a row) trimmed to exactly n_rows · seq_len tokens."""
    lengths = np.maximum(1, rng.lognormal(np.log(seq_len / 6), 1.3, size=4 * n_rows * 8))
    lengths = lengths.astype(np.int64)
    cum = np.cumsum(lengths)
    k = int(np.searchsorted(cum, n_rows * seq_len))
    lengths = lengths[:k + 1]
    lengths[-1] -= int(cum[k]) - n_rows * seq_len
    return lengths[lengths > 0]


def assert_exact_cover(placed: packing.Placement, length_X, n_rows, seq_len=S):
    # Every row is exactly full ...
    np.testing.assert_array_equal(np.bincount(placed.row_Z, weights=placed.length_Z,
                                              minlength=n_rows), seq_len)
    assert placed.row_Z.max() < n_rows and (placed.length_Z > 0).all()
    # ... and the placed intervals of each chunk piece tile it exactly once.
    for c, n in enumerate(length_X):
        mine = placed.piece_Z == c
        order = np.argsort(placed.offset_Z[mine])
        starts, lens = placed.offset_Z[mine][order], placed.length_Z[mine][order]
        assert starts[0] == 0 and starts[-1] + lens[-1] == n, c
        np.testing.assert_array_equal(starts[1:], (starts + lens)[:-1])
        assert (lens <= seq_len).all()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("pack", [packing.pack_in_order, packing.pack_balanced])
def test_packers_fill_rows_and_conserve_every_token(seed, pack):
    rng = np.random.default_rng(seed)
    n_rows = 16
    length_X = long_tailed_lengths(rng, n_rows)
    assert length_X.max() > S  # exercises splitting of over-long documents
    placed = pack(length_X, seq_len=S)
    assert_exact_cover(placed, length_X, n_rows)
    # Sorted by row, then stream order: what the reader relies on.
    key = placed.row_Z * (len(length_X) + 1) + placed.piece_Z
    assert (np.diff(key) >= 0).all()


def test_pack_in_order_is_concat_then_split():
    length_X = np.array([10, 100, 3, 15])  # 128 tokens = 2 rows of 64
    placed = packing.pack_in_order(length_X, seq_len=S)
    np.testing.assert_array_equal(placed.piece_Z, [0, 1, 1, 2, 3])
    np.testing.assert_array_equal(placed.offset_Z, [0, 0, 54, 0, 0])
    np.testing.assert_array_equal(placed.length_Z, [10, 54, 46, 3, 15])
    np.testing.assert_array_equal(placed.row_Z, [0, 0, 1, 1, 1])


def test_pack_balanced_spreads_long_documents():
    # Four 40-token documents and many 1-token ones; in stream order the long ones land
    # two to a row.  Balanced: one long document per row.
    length_X = np.array([40, 40, 40, 40] + [1] * 96)
    in_order = packing.pack_in_order(length_X, seq_len=S).row_cost(4)
    balanced = packing.pack_balanced(length_X, seq_len=S).row_cost(4)
    assert packing.max_over_mean(in_order) > 1.5
    assert packing.max_over_mean(balanced) == pytest.approx(1.0)
    assert balanced.max() == 40**2 + 24


def test_pack_balanced_whole_rows_for_overlong_documents_and_determinism():
    length_X = np.array([2 * S + 5, 59, 30, 20, 14])  # 4 rows
    placed = packing.pack_balanced(length_X, seq_len=S)
    full = placed.length_Z == S
    assert full.sum() == 2 and set(placed.piece_Z[full]) == {0}
    again = packing.pack_balanced(length_X, seq_len=S)
    for name in ("piece_Z", "offset_Z", "length_Z", "row_Z"):
        np.testing.assert_array_equal(getattr(placed, name), getattr(again, name))


def test_pack_keeps_stream_order_when_balancing_would_raise_the_maximum():
    # Two over-long documents give LPT 4 whole S² rows for 2 ranks of 2 rows; stream
    # order, offset by a 32-token document, cuts them into cheaper pieces.
    length_X = np.array([32, 2 * S, 2 * S - 32])
    balanced = packing.pack_balanced(length_X, seq_len=S, n_ranks=2).row_cost(4)
    in_order = packing.pack_in_order(length_X, seq_len=S).row_cost(4)
    assert packing.rank_cost(balanced, 2).max() > packing.rank_cost(in_order, 2).max()
    chosen = packing.pack(length_X, seq_len=S, n_ranks=2, balance=True).row_cost(4)
    np.testing.assert_array_equal(chosen, in_order)


def test_packers_reject_a_chunk_that_is_not_whole_rows():
    with pytest.raises(ValueError, match="not a whole number of 64-token rows"):
        packing.pack_balanced(np.array([10, 20]), seq_len=S)


def test_pack_balanced_evens_rank_sums_with_device_major_rows():
    # Two rows per rank.  In stream order rank 0 gets both 60-token documents.
    length_X = np.array([60, 60, 50, 50] + [4] * 48 + [2] * 50)
    assert length_X.sum() == 8 * S
    in_order = packing.pack_in_order(length_X, seq_len=S).row_cost(8)
    balanced = packing.pack_balanced(length_X, seq_len=S, n_ranks=4).row_cost(8)
    assert packing.rank_cost(in_order, 4).max() > 6000
    # One big document per rank; a 60-rank must also hold 68 small tokens (>= 136 cost).
    np.testing.assert_array_equal(packing.rank_cost(balanced, 4), [3776, 3776, 2808, 2808])
    # pack() takes the balanced layout here, and stream order when balance is off.
    chosen = packing.pack(length_X, seq_len=S, n_ranks=4, balance=True).row_cost(8)
    np.testing.assert_array_equal(chosen, balanced)
    np.testing.assert_array_equal(
        packing.pack(length_X, seq_len=S, n_ranks=4, balance=False).row_cost(8), in_order)
    with pytest.raises(ValueError, match="8 rows do not split evenly over 3 ranks"):
        packing.pack_balanced(length_X, seq_len=S, n_ranks=3)


def test_balancing_nodes_puts_long_documents_on_different_nodes():
    """8 ranks of 1 row in 2 nodes of 4: two whole-row documents and 48 of 8 tokens.
    Balancing ranks puts the two long rows on ranks 0 and 1, one node; balancing nodes
    (context parallelism: a node's GPUs share its rows' attention) one on each node."""
    length_X = np.array([S, S] + [8] * 48)
    assert length_X.sum() == 8 * S
    long_row, short_row = S ** 2, 8 * 8 ** 2  # Σ length² of a row
    by_rank = packing.pack(length_X, seq_len=S, n_ranks=8, balance=True).row_cost(8)
    np.testing.assert_array_equal(packing.rank_cost(by_rank, 2),
                                  [2 * long_row + 2 * short_row, 4 * short_row])
    by_node = packing.pack(length_X, seq_len=S, n_ranks=8, balance=True,
                           ranks_per_unit=4).row_cost(8)
    np.testing.assert_array_equal(packing.rank_cost(by_node, 2), [long_row + 3 * short_row] * 2)
    assert packing.max_over_mean(packing.rank_cost(by_node, 2)) == 1.0
    assert packing.max_over_mean(packing.rank_cost(by_rank, 2)) == pytest.approx(
        (2 * long_row + 2 * short_row) / (long_row + 3 * short_row))
    # per rank both layouts have one long row on some rank: the same max/mean
    assert packing.max_over_mean(by_node) == packing.max_over_mean(by_rank)
    with pytest.raises(ValueError, match="8 ranks do not split into units of 3"):
        packing.pack(length_X, seq_len=S, n_ranks=8, balance=True, ranks_per_unit=3)
