"""Tests for europa_jax.data.corpus: the on-disk format, atomic writes, damaged shards."""

import json
import pickle
import re

import numpy as np
import pytest

from europa_jax.data.corpus import CorpusExists, CorpusWriter, DataError, token_dtype, TokenCorpus

TOKENIZER = {"kind": "bytes", "name": "bytes", "sha256": None, "vocab_size": 257,
             "eos_id": 256}


def write(out, docs, vocab_size=257, shard_tokens=1 << 30):
    with CorpusWriter(out, vocab_size=vocab_size, shard_tokens=shard_tokens) as writer:
        for doc in docs:
            writer.add(np.asarray(doc))
        return writer.commit(tokenizer={**TOKENIZER, "vocab_size": vocab_size})


@pytest.fixture
def docs():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, size=n) for n in (5, 1, 17, 3, 40, 2, 9)]


def test_round_trip_across_shards(tmp_path, docs):
    manifest = write(tmp_path / "c", docs, shard_tokens=20)
    assert len(manifest.shards) > 2  # documents never span shards; a shard closes at 20
    corpus = TokenCorpus(tmp_path / "c", verify=True)
    assert len(corpus) == len(docs) and corpus.manifest.tokens == sum(map(len, docs))
    assert corpus.manifest.max_document_tokens == 40
    np.testing.assert_array_equal(corpus.lengths(np.arange(len(docs))), list(map(len, docs)))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(corpus[i], doc)
    np.testing.assert_array_equal(corpus.read(4, 10, 13), docs[4][10:13])
    got = corpus.read_many(np.array([6, 0]), np.array([1, 0]), np.array([9, 5]))
    np.testing.assert_array_equal(got[0], docs[6][1:9])
    np.testing.assert_array_equal(got[1], docs[0])
    with pytest.raises(IndexError, match="outside document 1 of 1 tokens"):
        corpus.read(1, 0, 2)
    # Pickles without its memory maps (Grain worker processes) and still reads.
    clone = pickle.loads(pickle.dumps(corpus))
    np.testing.assert_array_equal(clone[2], docs[2])


def test_dtype_follows_vocab_size(tmp_path):
    assert token_dtype(257) == np.uint16 and token_dtype(1 << 16) == np.uint16
    assert token_dtype((1 << 16) + 1) == np.uint32
    write(tmp_path / "big", [[70_000, 5]], vocab_size=262_144)
    corpus = TokenCorpus(tmp_path / "big")
    assert corpus.dtype == np.uint32
    np.testing.assert_array_equal(corpus[0], [70_000, 5])


def test_failed_write_leaves_nothing_and_existing_is_never_overwritten(tmp_path, docs):
    with pytest.raises(RuntimeError):
        with CorpusWriter(tmp_path / "c", vocab_size=257) as writer:
            writer.add(np.asarray(docs[0]))
            raise RuntimeError("input went bad half way")
    assert list(tmp_path.iterdir()) == []
    write(tmp_path / "c", docs)
    before = (tmp_path / "c" / "manifest.json").read_bytes()
    with pytest.raises(CorpusExists, match=re.escape(f"{tmp_path / 'c'}: already exists")):
        write(tmp_path / "c", docs[:1])
    assert (tmp_path / "c" / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_truncated_shard_is_one_line_error(tmp_path, docs):
    write(tmp_path / "c", docs)
    shard = tmp_path / "c" / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-6])
    with pytest.raises(DataError) as err:
        TokenCorpus(tmp_path / "c")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{shard}: {2 * 77 - 6} bytes, expected {2 * 77}")
    assert "truncated" in message


def test_unreadable_shard_is_one_line_error(tmp_path, docs):
    write(tmp_path / "c", docs)
    offsets = tmp_path / "c" / "offsets-00000.bin"
    offsets.unlink()
    offsets.mkdir()  # exists but cannot be read as a file (root ignores chmod)
    with pytest.raises(DataError, match=re.escape(f"{offsets}: ")):
        TokenCorpus(tmp_path / "c")
    offsets.rmdir()
    with pytest.raises(DataError, match=re.escape(f"{offsets}: unreadable shard")):
        TokenCorpus(tmp_path / "c")


def test_corrupt_shard_fails_checksum_verification(tmp_path, docs):
    write(tmp_path / "c", docs)
    shard = tmp_path / "c" / "tokens-00000.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    TokenCorpus(tmp_path / "c")  # sizes are fine: opening stays cheap
    with pytest.raises(DataError, match=re.escape(f"{shard}: checksum differs")):
        TokenCorpus(tmp_path / "c", verify=True)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "manifest.json").unlink(), "manifest.json: not found; expected a corpus "
                                               "written by `europa-jax prepare`"),
    (lambda d: (d / "manifest.json").write_text("{"), "manifest.json: unreadable or not JSON"),
    (lambda d: (d / "manifest.json").write_text('{"format": "other"}'),
     "manifest.json: not a europa-jax-corpus manifest"),
    (lambda d: (d / "manifest.json").write_text(json.dumps(
        {**json.loads((d / "manifest.json").read_text()), "version": 99})),
     "manifest.json: format version 99, expected 1"),
    (lambda d: (d / "manifest.json").write_text(json.dumps(
        {**json.loads((d / "manifest.json").read_text()), "documents": 3})),
     "manifest.json: document/token totals disagree with its shards"),
])
def test_bad_manifest_is_one_line_error(tmp_path, docs, damage, message):
    write(tmp_path / "c", docs)
    damage(tmp_path / "c")
    with pytest.raises(DataError, match=re.escape(message)):
        TokenCorpus(tmp_path / "c")


def test_missing_corpus_directory(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'nope'}: no such directory")):
        TokenCorpus(tmp_path / "nope")
