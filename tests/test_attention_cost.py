"""The plan's attention pricing (plan/price/attention_cost.py): batches cut from a document
stream as the pipeline cuts them, laid out by the real balancer, the slowest rank or node."""

import dataclasses

import numpy as np
import pytest

from europa_jax.config import MeshConfig
from europa_jax.data.corpus import CorpusWriter
from europa_jax.plan.price import attention_cost, documents
from conftest import config_path

S = 64


def test_global_batches_are_exact_and_continue_the_cut_document():
    lengths_W = np.array([100, 30, 7, 200, 64, 1])
    batches = list(attention_cost.global_batches(lengths_W, 128, 6, seed=3))
    assert all(b.sum() == 128 for b in batches) and all((b > 0).all() for b in batches)
    # every epoch holds each document whole once (402 tokens): the pieces of the first
    # epoch's 402 tokens tile its documents, a cut document's rest opening the next batch
    ends = set(np.cumsum(np.concatenate(batches)).tolist())
    assert 402 in ends  # the epoch boundary
    first_epoch = np.random.default_rng((3, 0)).permutation(len(lengths_W))
    assert set(np.cumsum(lengths_W[first_epoch]).tolist()) <= ends


def test_unit_pairs_of_a_known_batch():
    """8 ranks in 2 nodes, 1 row each: two whole-row documents and 48 of 8 tokens."""
    length_X = np.array([S, S] + [8] * 48)
    long_row, short_row = S * (S + 1) / 2, 8 * 8 * 9 / 2
    rank_J, unit_U = attention_cost.unit_pairs(length_X, seq_len=S, n_ranks=8,
                                               ranks_per_unit=1, balance=True)
    assert sorted(rank_J) == [short_row] * 6 + [long_row] * 2
    np.testing.assert_array_equal(unit_U, rank_J)
    _, node_U = attention_cost.unit_pairs(length_X, seq_len=S, n_ranks=8, ranks_per_unit=4,
                                          balance=True)
    np.testing.assert_array_equal(node_U, [(long_row + 3 * short_row) / 4] * 2)


def cfg_of(tiny_cfg, *, rows=32, data=4, expert=4, balance=True):
    return dataclasses.replace(
        tiny_cfg, mesh=MeshConfig(data=data, expert=expert),
        data=dataclasses.replace(tiny_cfg.data, global_batch_size=rows, balance=balance))


def test_whole_row_documents_make_the_expected_the_worst_case(tiny_cfg):
    cfg = cfg_of(tiny_cfg)
    for cp in (False, True):
        r = attention_cost.slowest_pairs(cfg, np.full(50, S), batches=4, context_parallel=cp)
        pairs = r["pairs_per_gpu"]
        assert pairs["expected"] == pairs["worst_case"] == 2 * S * (S + 1) / 2
        assert r["slowest_unit"] == ("node" if cp else "rank")


def test_context_parallelism_lowers_the_slowest_gpu_of_the_long_tail(tiny_cfg):
    cfg = cfg_of(tiny_cfg, rows=64, data=8)
    lengths_W = documents.long_tail_lengths(4000, seed=1) // 40 + 1  # rows of 64
    by_rank = attention_cost.slowest_pairs(cfg, lengths_W, batches=8, context_parallel=False)
    by_node = attention_cost.slowest_pairs(cfg, lengths_W, batches=8, context_parallel=True)
    r, n = by_rank["pairs_per_gpu"], by_node["pairs_per_gpu"]
    # the same tokens (pieces are cut at other row ends: a few pairs apart)
    assert r["mean_over_gpus"] == pytest.approx(n["mean_over_gpus"], rel=1e-3)
    assert n["mean_over_gpus"] <= n["expected"] < r["expected"] <= r["worst_case"]
    assert by_node["cost_max_over_mean"]["per_node"] < by_rank["cost_max_over_mean"]["per_node"]
    # without balancing the slowest rank is never lighter
    unbalanced = attention_cost.slowest_pairs(cfg_of(tiny_cfg, rows=64, data=8, balance=False),
                                              lengths_W, batches=8, context_parallel=False)
    assert unbalanced["pairs_per_gpu"]["expected"] >= r["expected"]


def test_a_corpus_s_lengths_are_read_from_its_offsets(tmp_path):
    with CorpusWriter(tmp_path / "c", vocab_size=300) as writer:
        for n in (5, 17, 3):
            writer.add(np.arange(n) % 300)
        writer.commit(tokenizer={"kind": "bytes", "name": "synthetic", "sha256": None,
                                 "vocab_size": 300, "eos_id": 0})
    np.testing.assert_array_equal(attention_cost.corpus_lengths(tmp_path / "c"), [5, 17, 3])


def test_kernel_pairs_are_the_kernels_count_of_every_row():
    """kernel_pairs counts, for all rows at once, what flash_backward.kernel_pair_fraction
    counts of one: the forward's key tiles from each query tile's document start, the
    backward's chunk pairs (one row per call here)."""
    from europa_jax.data import packing
    from europa_jax.model import flash_backward

    rng = np.random.default_rng(0)
    s, tile, chunk, rows = 1024, 128, 256, 6
    lengths = rng.integers(1, 900, 40)
    lengths = lengths[np.cumsum(lengths) <= s * rows]
    length_X = np.append(lengths, s * rows - lengths.sum())
    placed = packing.pack_in_order(length_X, seq_len=s)
    fwd_B, bwd_C = attention_cost.kernel_pairs(placed, seq_len=s, n_ranks=rows,
                                               ranks_per_call=1, tile=tile, chunk=chunk)
    causal = s * (s + 1) / 2
    for r in range(rows):
        docs = placed.length_Z[placed.row_Z == r].tolist()
        ref = flash_backward.kernel_pair_fraction(docs, seq_len=s, chunk=chunk, tile=tile)
        assert fwd_B[r] == pytest.approx(ref["forward"] * causal)
        assert bwd_C[r] == pytest.approx(ref["backward"] * causal)
    # one document per row: the whole causal row each way
    whole = packing.pack_in_order(np.full(rows, s), seq_len=s)
    fwd_B, bwd_C = attention_cost.kernel_pairs(whole, seq_len=s, n_ranks=rows,
                                               ranks_per_call=1, tile=tile, chunk=chunk)
    np.testing.assert_allclose(fwd_B, causal)
    np.testing.assert_allclose(bwd_C, causal)


def test_each_row_of_a_call_runs_only_its_own_chunk_pairs():
    """A call of 4 rows (a node's, under context parallelism), one of them a whole-row
    document: that row runs the whole causal backward, the others only their own
    documents' chunk pairs, as each would alone (flash_backward loops over rows)."""
    from europa_jax.data import packing

    s, tile, chunk = 512, 128, 128
    length_X = np.array([s] + [64] * 24)  # a whole row, then 3 rows of 8 short documents
    placed = packing.pack_in_order(length_X, seq_len=s)
    fwd_B, bwd_U = attention_cost.kernel_pairs(placed, seq_len=s, n_ranks=4, ranks_per_call=4,
                                               tile=tile, chunk=chunk)
    causal = s * (s + 1) / 2
    _, alone_U = attention_cost.kernel_pairs(placed, seq_len=s, n_ranks=4, ranks_per_call=1,
                                             tile=tile, chunk=chunk)
    assert alone_U[0] == causal and (alone_U[1:] < causal / 2).all()
    assert bwd_U.tolist() == [alone_U.sum()]  # not 4 × causal, what the rows' union needs
    diagonal = s // chunk * chunk * (chunk + 1) / 2  # 64-long documents: diagonal pairs only
    assert alone_U[1:].tolist() == [diagonal] * 3
    assert fwd_B[0] == causal and (fwd_B[1:] < causal / 2).all()


def test_the_plan_reports_the_kernels_pairs_beside_the_model_s(tiny_cfg):
    cfg = cfg_of(tiny_cfg)
    lengths_W = documents.long_tail_lengths(2000, seed=2) // 40 + 1
    r = attention_cost.slowest_pairs(cfg, lengths_W, batches=4, context_parallel=True)
    run, worst = r["kernel_pairs_per_gpu"], r["pairs_per_gpu"]["worst_case"]
    for way in ("forward", "backward"):
        assert 0 < run[way]["expected"] <= run[way]["p95"] <= run[way]["worst_case"]
    # the kernels run at least the pairs the model needs (masked ones too); rows shorter
    # than a kernel tile or a backward chunk are padded to it
    assert run["forward"]["expected"] >= r["pairs_per_gpu"]["mean_over_gpus"]
    assert run["forward"]["worst_case"] == worst  # the 64-position row in one 128-tile
    chunk = r["backward_chunk"]
    assert chunk == 128 and run["backward"]["worst_case"] == worst / (S * (S + 1)) * (
        chunk * (chunk + 1))


@pytest.mark.slow
def test_the_backward_loops_are_priced_at_the_trips_the_documents_make():
    """The plan prices the memory-bound kernels of the attention backward's pair loop at
    the trips the document model gives (as its FLOPs), not at one document per row."""
    from europa_jax.config_loader import load_config
    from europa_jax.plan.program import gpu_program

    cfg = load_config(config_path("europa-952b.yaml"))
    s, chunk = cfg.data.seq_len, cfg.execution.attention_backward_chunk
    x = s // chunk
    op = "jit(train_step)/transpose(jvp())/attention/attention_kernel/while/body"

    def pairs(per_row):
        return {"kernel_pairs_per_gpu": {"backward": {"expected": per_row}}}

    assert gpu_program.expected_trips(cfg)(op) == (x - 1) / 2  # one document per row
    whole = s * (s + 1) / 2  # a causal row: every later query chunk, (X − 1)/2 a key chunk
    assert gpu_program.expected_trips(cfg, pairs(whole))(op) == pytest.approx((x - 1) / 2)
    diagonal = x * chunk * (chunk + 1) / 2  # short documents: no off-diagonal pair
    assert gpu_program.expected_trips(cfg, pairs(diagonal))(op) == 0.0
    assert gpu_program.expected_trips(cfg, pairs(diagonal + 4 * chunk**2))(op) == 4 / x
    assert gpu_program.expected_trips(cfg, pairs(diagonal))("…/moe/while/body") == 0.0
