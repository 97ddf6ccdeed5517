"""Tests for europa_jax.data: embedded stdlib corpus + Grain packing pipeline."""

import json
import re

import numpy as np
import pytest

from europa_jax import data

N_DOCS = 5
SEQ_LEN = 64
BATCH = 4
SEED = 0


def _iterator(**overrides):
    kwargs = dict(
        source="stdlib",
        seq_len=SEQ_LEN,
        global_batch_size=BATCH,
        seed=SEED,
        max_documents=N_DOCS,
    )
    kwargs.update(overrides)
    return data.make_batch_iterator(**kwargs)


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.fixture(scope="module")
def docs():
    # Note: the stdlib has byte-identical files (__phello__/__init__.py and
    # spam.py are among the first 5), so comparisons below use multisets.
    return [data.encode_bytes(p.read_bytes()) for p in data.stdlib_sources(N_DOCS)]


@pytest.fixture(scope="module")
def two_epochs(docs):
    """Enough batches to cover two full epochs of the N_DOCS corpus."""
    total = sum(len(d) for d in docs)
    n_batches = -(-2 * total // (BATCH * SEQ_LEN)) + 1
    return _take(_iterator(), n_batches)


def _split_documents(tokens_T):
    ends = np.flatnonzero(tokens_T == data.EOS_ID)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens_T[s : e + 1] for s, e in zip(starts, ends)]


def test_stdlib_sources_sorted_filtered_and_limited():
    all_paths = data.stdlib_sources()
    assert len(all_paths) > 100
    assert all(p.suffix == ".py" for p in all_paths)
    for p in all_paths:
        assert not {"site-packages", "dist-packages", "test", "tests"} & set(p.parts)
    assert all_paths == sorted(all_paths, key=lambda p: p.as_posix())
    assert data.stdlib_sources(3) == all_paths[:3]


def test_stdlib_sources_missing_dir_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        data.stdlib_sources()


def test_encode_bytes_appends_eos():
    np.testing.assert_array_equal(data.encode_bytes("aé"), [97, 195, 169, data.EOS_ID])
    np.testing.assert_array_equal(data.encode_bytes(b""), [data.EOS_ID])
    assert data.encode_bytes(b"xyz").dtype == np.int32
    assert data.BYTE_VOCAB_SIZE == data.EOS_ID + 1


def test_batch_shapes_dtypes_and_vocab(two_epochs):
    for batch in two_epochs[:5]:
        assert set(batch) == {"tokens", "segment_ids", "positions"}
        for value in batch.values():
            assert value.shape == (BATCH, SEQ_LEN)
            assert value.dtype == np.int32
        assert batch["tokens"].min() >= 0
        assert batch["tokens"].max() < data.BYTE_VOCAB_SIZE


def test_packing_conserves_tokens_and_reshuffles_each_epoch(docs, two_epochs):
    stream_T = np.concatenate([b["tokens"].reshape(-1) for b in two_epochs])
    pieces = _split_documents(stream_T)
    assert len(pieces) >= 2 * N_DOCS
    epoch1, epoch2 = pieces[:N_DOCS], pieces[N_DOCS : 2 * N_DOCS]
    want = sorted(d.tobytes() for d in docs)
    # Each epoch is exactly the corpus: nothing lost, duplicated or truncated,
    # even for documents split across rows/batches.
    assert sorted(p.tobytes() for p in epoch1) == want
    assert sorted(p.tobytes() for p in epoch2) == want
    # The stream is exactly the concatenation of the epoch-1 documents.
    epoch1_len = sum(len(d) for d in docs)
    np.testing.assert_array_equal(stream_T[:epoch1_len], np.concatenate(epoch1))
    # Epoch 2 is a different permutation (per-epoch reshuffle).
    assert [p.tobytes() for p in epoch1] != [p.tobytes() for p in epoch2]


def test_segments_break_exactly_at_eos(two_epochs):
    for batch in two_epochs:
        for tokens_S, seg_S in zip(batch["tokens"], batch["segment_ids"]):
            assert seg_S[0] == 1
            assert (seg_S > 0).all()  # infinite stream: rows are never padded
            step_S = np.diff(seg_S)
            assert set(np.unique(step_S)) <= {0, 1}
            is_eos_S = tokens_S[:-1] == data.EOS_ID
            # EOS ends its segment, and a segment ends only at an EOS (or at
            # the row end), so a segment never spans two documents.
            np.testing.assert_array_equal(step_S == 1, is_eos_S)
            for seg_id in np.unique(seg_S):
                seg_tokens = tokens_S[seg_S == seg_id]
                n_eos = int((seg_tokens == data.EOS_ID).sum())
                assert n_eos <= 1
                if n_eos:
                    assert seg_tokens[-1] == data.EOS_ID


def test_positions_restart_per_segment(two_epochs):
    for batch in two_epochs:
        for seg_S, pos_S in zip(batch["segment_ids"], batch["positions"]):
            assert pos_S[0] == 0
            new_segment = seg_S[1:] != seg_S[:-1]
            expected = np.where(new_segment, 0, pos_S[:-1] + 1)
            np.testing.assert_array_equal(pos_S[1:], expected)


def test_same_seed_same_batches_different_seed_differs(two_epochs):
    again = _take(_iterator(), 8)
    for a, b in zip(two_epochs[:8], again):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    other = _take(_iterator(seed=SEED + 1), 8)
    assert not all(
        np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(two_epochs[:8], other)
    )


def test_two_processes_partition_the_global_batch(two_epochs):
    proc0 = _take(_iterator(process_index=0, process_count=2), 10)
    proc1 = _take(_iterator(process_index=1, process_count=2), 10)
    for full, p0, p1 in zip(two_epochs[:10], proc0, proc1):
        for key in full:
            assert p0[key].shape == (BATCH // 2, SEQ_LEN)
            np.testing.assert_array_equal(np.concatenate([p0[key], p1[key]]), full[key])


@pytest.mark.parametrize("consumed", [0, 7])
def test_state_json_round_trip_resumes_exactly(two_epochs, consumed):
    it = _iterator()
    _take(it, consumed)
    # JSON is what DatasetIterator.save / Orbax write; consumed=0 restores a
    # state without a remainder, which plain Grain 0.2.18 gets wrong.
    state = json.loads(json.dumps(it.get_state()))
    restored = _iterator()
    restored.set_state(state)
    for want, got in zip(two_epochs[consumed : consumed + 5], _take(restored, 5)):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_documents_are_read_lazily(monkeypatch):
    reads = []
    real_read = data._read_document

    def counting_read(path):
        reads.append(path)
        return real_read(path)

    monkeypatch.setattr(data, "_read_document", counting_read)
    it = _iterator(max_documents=None, seq_len=16, global_batch_size=1)
    assert reads == []
    next(it)
    assert 1 <= len(reads) <= 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(source="c4"), "data.source: unknown source 'c4'; expected one of: stdlib"),
        (dict(seq_len=1), "data.seq_len must be >= 2, got 1"),
        (
            dict(global_batch_size=3, process_count=2),
            "data.global_batch_size must be a positive multiple of process_count (2), got 3",
        ),
        (dict(global_batch_size=0), "data.global_batch_size"),
        (dict(seed=-1), "data.seed"),
        (dict(process_index=2, process_count=2), "process_index"),
        (dict(max_documents=0), "data.max_documents"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _iterator(**overrides)
