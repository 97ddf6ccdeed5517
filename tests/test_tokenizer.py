"""Tests for europa_jax.data.tokenizer: byte level and Hugging Face tokenizer.json."""

import json
import re

import numpy as np
import pytest

from europa_jax.data import tokenizer
from europa_jax.data.corpus import DataError

WORDS = ["hello", "world", "the", "cat"]


def make_tokenizer_json(path, specials=("</s>",)):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return path


def test_encode_bytes_appends_eos():
    np.testing.assert_array_equal(tokenizer.encode_bytes("aé"), [97, 195, 169, 256])
    np.testing.assert_array_equal(tokenizer.encode_bytes(b""), [256])
    batch = tokenizer.ByteTokenizer().encode_batch([b"\xff", "z"])
    np.testing.assert_array_equal(batch[0], [255, 256])  # bytes are never decoded
    assert tokenizer.ByteTokenizer.info.vocab_size == tokenizer.BYTE_EOS_ID + 1


def test_huggingface_tokenizer_ids_identity_and_eos(tmp_path):
    path = make_tokenizer_json(tmp_path / "tokenizer.json")
    tok = tokenizer.load_tokenizer(str(path))
    eos = len(WORDS) + 1  # the added special token
    assert tok.info.eos_id == eos and tok.info.vocab_size == eos + 1
    assert tok.info.kind == "huggingface" and len(tok.info.sha256) == 64
    ids = tok.encode_batch(["hello cat", b"the dog"])
    np.testing.assert_array_equal(ids[0], [1, 4, eos])
    np.testing.assert_array_equal(ids[1], [3, 0, eos])  # unknown word → [UNK]


def test_eos_from_tokenizer_config_and_flag(tmp_path):
    path = make_tokenizer_json(tmp_path / "tokenizer.json", specials=("<end>", "<other>"))
    with pytest.raises(DataError, match="end-of-document token one of .* is not in the "
                                        "vocabulary; pass --eos-token"):
        tokenizer.load_tokenizer(str(path))
    assert tokenizer.load_tokenizer(str(path), "<other>").info.eos_id == 6
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<end>"}}))
    assert tokenizer.load_tokenizer(str(path)).info.eos_id == 5
    with pytest.raises(DataError, match=re.escape("token '<nope>' is not in the vocabulary")):
        tokenizer.load_tokenizer(str(path), "<nope>")


def test_bad_tokenizer_specs(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"--tokenizer: {tmp_path}/x.json: no such "
                                                  "file; expected 'bytes' or a tokenizer.json")):
        tokenizer.load_tokenizer(str(tmp_path / "x.json"))
    pytest.importorskip("tokenizers")
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="bad.json: not a Hugging Face tokenizer.json"):
        tokenizer.load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(DataError, match="--eos-token: the byte tokenizer's EOS is fixed"):
        tokenizer.load_tokenizer("bytes", "</s>")
