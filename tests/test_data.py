"""Tests for europa_jax.data.pipeline: packing, balancing, per-process reads, exact resume.

The synthetic corpus makes every token say where it came from: token = doc · 1024 + position
in the document, so any batch can be checked against the corpus exactly.
"""

import dataclasses
import json
import re

import grain
import numpy as np
import pytest

from europa_jax.config import Config, ConfigError, DataConfig
from europa_jax.config_loader import from_dict, load_config
from europa_jax.data import packing, pipeline, sources as data_sources
from europa_jax.data.corpus import CorpusWriter, DataError, TokenCorpus
from conftest import config_path

S, ROWS, RANKS = 64, 8, 4          # 2 rows per rank
EPOCH_BATCHES = 4                  # the corpus holds exactly 4 global batches of tokens
STRIDE = 1024                      # token = doc * STRIDE + position


def long_tailed_lengths(seed, total):
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(12), 1.2, size=total)).astype(np.int64)
    lengths = np.minimum(lengths, 300)  # several documents span multiple rows
    cum = np.cumsum(lengths)
    k = int(np.searchsorted(cum, total))
    lengths = lengths[:k + 1]
    lengths[-1] -= int(cum[k]) - total
    return lengths[lengths > 0]


def write_identity_corpus(path, lengths):
    vocab = len(lengths) * STRIDE
    with CorpusWriter(path, vocab_size=vocab) as writer:
        for doc, n in enumerate(lengths):
            writer.add(doc * STRIDE + np.arange(n))
        writer.commit(tokenizer={"kind": "bytes", "name": "synthetic", "sha256": None,
                                 "vocab_size": vocab, "eos_id": 0})
    return TokenCorpus(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    lengths = long_tailed_lengths(0, EPOCH_BATCHES * ROWS * S)
    assert lengths.max() > 2 * S
    return write_identity_corpus(tmp_path_factory.mktemp("corpus") / "c", lengths)


def iterator(corpus, **overrides):
    kwargs = dict(seq_len=S, global_batch_size=ROWS, n_ranks=RANKS, seed=0, prefetch=2)
    kwargs.update(overrides)
    return pipeline.make_batch_iterator(corpus, **kwargs)


def take(it, n):
    return [next(it) for _ in range(n)]


@pytest.fixture(scope="module")
def two_epochs(corpus):
    return take(iterator(corpus), 2 * EPOCH_BATCHES)


def test_batches_are_int32_rows_of_this_process(two_epochs):
    for batch in two_epochs:
        assert set(batch) == {"tokens", "segment_ids", "positions"}
        for value in batch.values():
            assert value.shape == (ROWS, S) and value.dtype == np.int32


@pytest.mark.parametrize("balance", [True, False])
def test_each_epoch_holds_every_token_exactly_once(corpus, balance):
    batches = take(iterator(corpus, balance=balance), 2 * EPOCH_BATCHES)
    every = np.sort(np.concatenate([d * STRIDE + np.arange(n) for d, n in
                                    enumerate(corpus.lengths(np.arange(len(corpus))))]))
    for epoch in range(2):
        window = batches[epoch * EPOCH_BATCHES:(epoch + 1) * EPOCH_BATCHES]
        got = np.sort(np.concatenate([b["tokens"].ravel() for b in window]))
        np.testing.assert_array_equal(got, every)


@pytest.mark.parametrize("balance", [True, False])
def test_segments_are_document_pieces_and_positions_restart(corpus, balance):
    for batch in take(iterator(corpus, balance=balance), EPOCH_BATCHES):
        for tokens_S, seg_S, pos_S in zip(batch["tokens"], batch["segment_ids"],
                                          batch["positions"]):
            assert seg_S[0] == 1 and (seg_S > 0).all()  # rows are full: no padding
            assert set(np.diff(seg_S).tolist()) <= {0, 1}
            for seg in np.unique(seg_S):
                piece = tokens_S[seg_S == seg]
                # One document, consecutive tokens of it: never across a boundary.
                assert len(np.unique(piece // STRIDE)) == 1
                np.testing.assert_array_equal(np.diff(piece), 1)
                np.testing.assert_array_equal(pos_S[seg_S == seg], np.arange(len(piece)))


def test_epochs_are_reshuffled_and_seed_matters(corpus, two_epochs):
    first_docs = [np.unique(b["tokens"] // STRIDE) for b in two_epochs]
    assert not np.array_equal(first_docs[0], first_docs[EPOCH_BATCHES])
    other = take(iterator(corpus, seed=1), 1)[0]
    assert not np.array_equal(other["tokens"], two_epochs[0]["tokens"])


def rank_costs(batch):
    """Σ segment length² per rank, from the batch alone (device-major rows)."""
    cost_B = np.array([np.sum(np.unique(seg, return_counts=True)[1] ** 2.0)
                       for seg in batch["segment_ids"]])
    return packing.rank_cost(cost_B, RANKS)


def test_balancing_evens_attention_cost_over_the_same_tokens(corpus):
    balanced, in_order = iterator(corpus), iterator(corpus, balance=False)
    ratios = {True: [], False: []}
    for _ in range(2 * EPOCH_BATCHES):
        a, b = next(balanced), next(in_order)
        # Same chunk of the stream, laid out differently.
        np.testing.assert_array_equal(np.sort(a["tokens"], axis=None),
                                      np.sort(b["tokens"], axis=None))
        # The slowest rank is never slower than with stream order.
        assert rank_costs(a).max() <= rank_costs(b).max()
        for it, batch, key in ((balanced, a, True), (in_order, b, False)):
            ratios[key].append(it.stats.attention_cost_max_over_mean)
            assert it.stats.attention_cost_max_over_mean == pytest.approx(
                packing.max_over_mean(rank_costs(batch)))
    assert np.mean(ratios[True]) < np.mean(ratios[False]) - 0.1


def test_node_balancing_evens_the_nodes_and_reports_both_costs(corpus):
    """Nodes of 2 ranks: the per-node metric is the nodes' Σ length² max/mean, read from
    the batch alone; balancing nodes lowers it below balancing ranks."""
    by_rank = iterator(corpus, ranks_per_node=2)
    by_node = iterator(corpus, ranks_per_node=2, balance_nodes=True)
    node_ratios = {False: [], True: []}
    for _ in range(2 * EPOCH_BATCHES):
        for it, nodes in ((by_rank, False), (by_node, True)):
            batch = next(it)
            rank_J = rank_costs(batch)
            assert it.stats.attention_cost_max_over_mean == pytest.approx(
                packing.max_over_mean(rank_J))
            node_cost = packing.rank_cost(rank_J, RANKS // 2)
            assert it.stats.node_attention_cost_max_over_mean == pytest.approx(
                packing.max_over_mean(node_cost))
            node_ratios[nodes].append(it.stats.node_attention_cost_max_over_mean)
    assert np.mean(node_ratios[True]) < np.mean(node_ratios[False])
    with pytest.raises(DataError, match=r"mesh: 3 ranks per node \(of mesh.expert within mesh.devices_per_node\) do not divide"):
        iterator(corpus, ranks_per_node=3)


class RecordingCorpus(TokenCorpus):
    """Remembers every token range read (the real reader underneath)."""

    def __init__(self, path):
        super().__init__(path)
        self.reads = []

    def read_many(self, doc_Z, start_Z, stop_Z):
        self.reads += list(zip(doc_Z.tolist(), start_Z.tolist(), stop_Z.tolist()))
        return super().read_many(doc_Z, start_Z, stop_Z)


def test_two_processes_read_disjoint_shares_covering_each_document_once(corpus, two_epochs):
    procs = [RecordingCorpus(corpus.path) for _ in range(2)]
    its = [iterator(c, process_index=i, process_count=2, prefetch=0)
           for i, c in enumerate(procs)]
    for full in two_epochs[:EPOCH_BATCHES]:
        halves = [next(it) for it in its]
        for key in full:
            assert halves[0][key].shape == (ROWS // 2, S)
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), full[key])
    for c in procs:  # each process read its own rows' tokens and nothing else
        assert sum(stop - start for _, start, stop in c.reads) == EPOCH_BATCHES * ROWS // 2 * S
    covered = {}
    for doc, start, stop in procs[0].reads + procs[1].reads:
        covered.setdefault(doc, []).append((start, stop))
    lengths = corpus.lengths(np.arange(len(corpus)))
    assert sorted(covered) == list(range(len(corpus)))
    for doc, spans in covered.items():  # tiles [0, length) exactly: read once per epoch
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == lengths[doc]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("consumed", [0, 3, 6])
def test_json_state_resumes_exactly(corpus, two_epochs, consumed):
    it = iterator(corpus)
    take(it, consumed)
    state = json.loads(json.dumps(it.get_state()))
    restored = iterator(corpus)
    restored.set_state(state)
    for want, got in zip(two_epochs[consumed:], take(restored, 2 * EPOCH_BATCHES - consumed)):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_orbax_checkpoint_of_the_iterator_resumes_exactly(corpus, two_epochs, tmp_path):
    import orbax.checkpoint as ocp

    it = iterator(corpus)
    take(it, 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
    restored = iterator(corpus)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore(3, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(restored)))
    for want, got in zip(two_epochs[3:6], take(restored, 3)):
        np.testing.assert_array_equal(got["tokens"], want["tokens"])


def test_state_from_another_pipeline_is_refused_naming_what_changed_and_the_way_on(
        corpus, tmp_path):
    state = iterator(corpus).get_state()
    with pytest.raises(DataError, match=re.escape(
            "saved for a different pipeline: seq_len 64 → 32. Resume with the data settings "
            "it was saved with, or train into a new --run-dir")):
        iterator(corpus, seq_len=32).set_state(state)
    other = write_identity_corpus(tmp_path / "other", [S] * ROWS)
    with pytest.raises(DataError, match=re.escape(
            f"corpus {pipeline._corpus_id(corpus)} ({corpus.path}) → "
            f"{pipeline._corpus_id(other)} ({other.path})")):
        iterator(other).set_state(state)


WINDOW = 2  # batches whose pieces are shuffled together: two windows an epoch


def documents_per_batch(batches):
    return [len(np.unique(b["tokens"] // STRIDE)) for b in batches]


@pytest.mark.parametrize("balance", [True, False])
def test_a_window_holds_the_streams_tokens_once_and_its_batches_mix_documents(
        corpus, two_epochs, balance):
    windowed = take(iterator(corpus, window_batches=WINDOW, balance=balance),
                    2 * EPOCH_BATCHES)
    for w in range(2 * EPOCH_BATCHES // WINDOW):  # the same tokens as the stream's window
        span = slice(w * WINDOW, (w + 1) * WINDOW)
        np.testing.assert_array_equal(
            np.sort(np.concatenate([b["tokens"].ravel() for b in windowed[span]])),
            np.sort(np.concatenate([b["tokens"].ravel() for b in two_epochs[span]])))
    for batch in windowed:  # pieces of at most a row, each a document's consecutive tokens
        for tokens_S, seg_S, pos_S in zip(batch["tokens"], batch["segment_ids"],
                                          batch["positions"]):
            for seg in np.unique(seg_S):
                piece = tokens_S[seg_S == seg]
                assert len(np.unique(piece // STRIDE)) == 1
                np.testing.assert_array_equal(np.diff(piece), 1)
                np.testing.assert_array_equal(pos_S[seg_S == seg], np.arange(len(piece)))
    # drawn across the window: more documents a batch than the stream's next rows hold
    assert np.mean(documents_per_batch(windowed)) > np.mean(documents_per_batch(two_epochs))


@pytest.mark.parametrize("consumed", [1, 2, 5])
def test_a_state_inside_a_window_resumes_exactly(corpus, consumed):
    it = iterator(corpus, window_batches=3)
    want = take(it, 8)
    it = iterator(corpus, window_batches=3)
    take(it, consumed)
    restored = iterator(corpus, window_batches=3)
    restored.set_state(json.loads(json.dumps(it.get_state())))
    for a, b in zip(want[consumed:], take(restored, 8 - consumed)):
        for key in a:
            np.testing.assert_array_equal(b[key], a[key])
    assert restored.stats.batch == 7


def test_a_state_saved_before_windows_names_the_setting_that_resumes_it(corpus):
    state = iterator(corpus).get_state()
    with pytest.raises(DataError, match=re.escape(
            "shuffle_window None → 2. It was saved before batches were shuffled across a "
            "window: resume it with --set data.shuffle_window_tokens=0")):
        iterator(corpus, window_batches=2).set_state(state)


def test_the_default_runs_batches_mix_documents_and_validation_spans_the_held_out_files():
    """configs/tiny-cpu.yaml: no batch of its 200 steps is more than half one file (the
    stream's order made twelve batches in a row of one 68K-token script), and its
    validation batches draw from most of the 20 held-out files, not the head of one."""
    cfg = load_config(config_path("tiny-cpu.yaml"))
    it = data_sources.batch_iterator_for(cfg)
    for _ in range(cfg.train.steps):
        batch = next(it)
        tokens_Z = np.concatenate([np.bincount(seg_S)[1:] for seg_S in batch["segment_ids"]])
        per_document = np.bincount(it.stats.documents_Z, weights=tokens_Z)
        assert per_document.max() <= batch["tokens"].size / 2, it.stats.batch
    it.close()
    held_out = data_sources.split_documents(len(data_sources.open_corpus(cfg)),
                                            cfg.data.validation_fraction, cfg.data.seed)[1]
    validation = data_sources.validation_iterator_for(cfg)
    seen = set()
    for _ in range(cfg.train.eval_batches):
        next(validation)
        seen |= set(validation.stats.documents_Z.tolist())
    assert seen <= set(held_out.tolist()) and len(seen) >= 0.6 * len(held_out)


def test_max_documents_uses_the_first_documents(corpus):
    for batch in take(iterator(corpus, max_documents=5), 3):
        assert batch["tokens"].max() < 5 * STRIDE


def test_corrupt_token_ids_are_caught_when_read(tmp_path):
    small = write_identity_corpus(tmp_path / "c", [S] * ROWS)
    shard = tmp_path / "c" / "tokens-00000.bin"
    raw = np.fromfile(shard, dtype=small.dtype)
    raw[70] = ROWS * STRIDE  # = the vocab size: one past the largest valid id
    raw.tofile(shard)
    with pytest.raises(DataError, match=re.escape(f"{small.path}: document 1 holds a token id "
                                                  f">= the manifest's vocab")):
        next(iterator(small, balance=False))


@pytest.mark.parametrize("overrides, message", [
    (dict(seq_len=1), "data.seq_len: 1 is below the minimum 2"),
    (dict(global_batch_size=6), "data.global_batch_size: 6 is not a positive multiple of the 4 "
                                "ranks"),
    (dict(process_count=3), "ranks: 4 devices do not split evenly over 3 processes"),
    (dict(process_index=2, process_count=2), "process_index 2 not in [0, process_count=2)"),
    (dict(seed=-1), "data.seed: -1 not in [0, 2**32)"),
    (dict(max_documents=0), "data.max_documents: 0 must be >= 1"),
    (dict(prefetch=-1), "data.prefetch: -1 must be >= 0"),
])
def test_bad_pipeline_arguments(corpus, overrides, message):
    with pytest.raises(DataError, match=re.escape(message)):
        iterator(corpus, **overrides)


# ----------------------------------------------------------------------------- from a config


def prepared_cfg(tiny_cfg, path, **data_overrides):
    return dataclasses.replace(tiny_cfg, data=dataclasses.replace(
        tiny_cfg.data, source="prepared", path=str(path), **data_overrides))


def test_config_iterator_uses_mesh_devices_as_ranks(tiny_cfg, tmp_path):
    lengths = long_tailed_lengths(1, 3 * 64 * 8)
    vocab_ok = write_identity_corpus(tmp_path / "c", lengths)
    cfg = dataclasses.replace(prepared_cfg(tiny_cfg, tmp_path / "c"),
                              model=dataclasses.replace(tiny_cfg.model,
                                                        vocab_size=len(lengths) * STRIDE))
    it = data_sources.batch_iterator_for(cfg, process_index=1, process_count=2)
    batch = next(it)
    assert batch["tokens"].shape == (cfg.data.global_batch_size // 2, cfg.data.seq_len)
    assert it.get_state()["pipeline"]["n_ranks"] == cfg.mesh.n_devices == 8
    assert it.get_state()["pipeline"]["corpus"] == pipeline._corpus_id(vocab_ok)


def test_config_corpus_errors(tiny_cfg, tmp_path):
    lengths = long_tailed_lengths(1, 3 * 64 * 8)
    write_identity_corpus(tmp_path / "c", lengths)
    manifest = tmp_path / "c" / "manifest.json"
    with pytest.raises(DataError, match=re.escape(
            f"{manifest}: tokenizer vocab {len(lengths) * STRIDE} > model.vocab_size 257")):
        data_sources.open_corpus(prepared_cfg(tiny_cfg, tmp_path / "c"))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'nope'}: no such directory")):
        data_sources.open_corpus(prepared_cfg(tiny_cfg, tmp_path / "nope"))


def test_tokenizer_mismatch_is_refused(tiny_cfg, tmp_path):
    from europa_jax.data import prepare, tokenizer
    from test_tokenizer import make_tokenizer_json

    (tmp_path / "a.txt").write_text("hello world")
    prepare.prepare_corpus([tmp_path / "a.txt"], tmp_path / "c", tokenizer.ByteTokenizer(),
                           progress=False)
    ok = prepared_cfg(tiny_cfg, tmp_path / "c", tokenizer="bytes")
    assert len(data_sources.open_corpus(ok)) == 1
    tok_json = make_tokenizer_json(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match=re.escape(
            f"{tmp_path / 'c' / 'manifest.json'}: corpus was prepared with bytes 'bytes' "
            f"(sha256 None) but data.tokenizer is {tok_json}")):
        data_sources.open_corpus(prepared_cfg(tiny_cfg, tmp_path / "c", tokenizer=str(tok_json)))


def test_stdlib_config_prepares_the_cache_through_prepare(tiny_cfg, tmp_path, monkeypatch):
    from europa_jax.data import prepare

    monkeypatch.setenv("EUROPA_JAX_CACHE", str(tmp_path))
    files = prepare.stdlib_sources()[:30]
    monkeypatch.setattr(prepare, "stdlib_sources", lambda: files)
    it = data_sources.batch_iterator_for(tiny_cfg)
    batch = next(it)
    assert batch["tokens"].shape == (tiny_cfg.data.global_batch_size, tiny_cfg.data.seq_len)
    (cache,) = tmp_path.iterdir()
    assert TokenCorpus(cache).manifest.tokenizer["kind"] == "bytes"
    assert batch["tokens"].max() <= 256


@pytest.mark.parametrize("raw, message", [
    ({"source": "prepared"}, "data.path: required when data.source is 'prepared'"),
    ({"path": "x"}, "data.path: 'x' is only used with data.source: prepared"),
    ({"tokenizer": "t.json"}, "data.tokenizer: 't.json' but the stdlib corpus is byte-level"),
    ({"seq_len": 1}, "data.seq_len: 1 is below the minimum 2"),
    ({"seed": 2**32}, "data.seed: 4294967296 must be in [0, 2**32)"),
    ({"prefetch": -1}, "data.prefetch: -1 must be >= 0"),
    ({"balance": "yes"}, "data.balance: expected bool, got 'yes'"),
])
def test_data_config_errors(raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(DataConfig, raw, "data.")


def test_readme_config_defaults_to_balanced_stdlib():
    cfg = load_config(config_path("tiny-cpu.yaml"))
    assert isinstance(cfg, Config)
    assert cfg.data.source == "stdlib" and cfg.data.balance and cfg.data.prefetch >= 1
