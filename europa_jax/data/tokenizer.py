"""Tokenizers for `prepare`: byte level (built in) or a Hugging Face `tokenizer.json`.

Every document gets the end-of-document id appended, so documents stay separable after
they are concatenated on disk and packed into rows.  A tokenizer's identity (kind, file
checksum, vocabulary size, EOS id) is written to the corpus manifest so training can
refuse a corpus made with a different tokenizer than the one it was told to expect.
The `tokenizers` package is a dependency of europa-jax (imported only for a tokenizer.json).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from europa_jax.config import BYTE_VOCAB_SIZE
from europa_jax.data.corpus import DataError

BYTE_EOS_ID = 256  # bytes are ids 0..255; BYTE_VOCAB_SIZE = 257
# End-of-document tokens of common tokenizer families, tried in order when neither
# --eos-token nor a tokenizer_config.json next to the file names one.
KNOWN_EOS_TOKENS = ("<｜end▁of▁sentence｜>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>",
                    "[EOS]")


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    kind: str            # "bytes" | "huggingface"
    name: str            # "bytes" or the tokenizer file's name
    sha256: str | None   # of tokenizer.json; None for bytes
    vocab_size: int      # max id + 1: the model's vocab must be at least this
    eos_id: int

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        digest = f" sha256 {self.sha256[:12]}" if self.sha256 else ""
        return f"{self.kind} '{self.name}'{digest} (vocab {self.vocab_size}, eos {self.eos_id})"

    def same_as(self, other: TokenizerInfo) -> bool:
        return (self.kind, self.sha256, self.vocab_size, self.eos_id) == (
            other.kind, other.sha256, other.vocab_size, other.eos_id)


class Tokenizer(Protocol):
    info: TokenizerInfo

    def encode_batch(self, docs: list[str | bytes]) -> list[np.ndarray]:
        """Token ids (int32) of each document, EOS appended."""


class ByteTokenizer:
    """Ids 0..255 are raw bytes; text files are taken as bytes, never decoded."""

    info = TokenizerInfo(kind="bytes", name="bytes", sha256=None, vocab_size=BYTE_VOCAB_SIZE,
                         eos_id=BYTE_EOS_ID)

    def encode_batch(self, docs: list[str | bytes]) -> list[np.ndarray]:
        return [encode_bytes(d) for d in docs]

    def encode(self, text: str | bytes) -> list[int]:
        """The ids of one text, no EOS appended (a prompt)."""
        return list(text.encode("utf-8") if isinstance(text, str) else text)

    def decode(self, ids) -> str:
        """Bytes back to text (invalid UTF-8 replaced); ids that are no byte (EOS) dropped."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def encode_bytes(doc: str | bytes) -> np.ndarray:
    """Byte-level tokens with `BYTE_EOS_ID` appended."""
    raw = doc.encode("utf-8") if isinstance(doc, str) else doc
    ids_T = np.empty(len(raw) + 1, dtype=np.int32)
    ids_T[:-1] = np.frombuffer(raw, dtype=np.uint8)
    ids_T[-1] = BYTE_EOS_ID
    return ids_T


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer.json; special tokens are not added (we add EOS ourselves)."""

    def __init__(self, path: str | Path, eos_token: str | None = None):
        path = Path(path)
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise DataError(f"{path}: reading a tokenizer.json needs the 'tokenizers' package "
                            "(a dependency of europa-jax: pip install 'tokenizers>=0.20')"
                            ) from None
        try:
            raw = path.read_bytes()
            self._tok = _HFTokenizer.from_str(raw.decode("utf-8"))
        except OSError as e:
            raise DataError(f"{path}: cannot read tokenizer ({e.strerror or e})") from None
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise DataError(f"{path}: not a Hugging Face tokenizer.json "
                            f"({str(e).splitlines()[0][:200]})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos_token = eos_token or _configured_eos(path) or next(
            (t for t in KNOWN_EOS_TOKENS if t in vocab), None)
        if eos_token is None or eos_token not in vocab:
            wanted = repr(eos_token) if eos_token else f"one of {', '.join(KNOWN_EOS_TOKENS)}"
            raise DataError(f"{path}: end-of-document token {wanted} is not in the vocabulary; "
                            "pass --eos-token")
        self.info = TokenizerInfo(kind="huggingface", name=path.name,
                                  sha256=hashlib.sha256(raw).hexdigest(),
                                  vocab_size=max(vocab.values()) + 1, eos_id=vocab[eos_token])
        # encode_batch_fast skips offsets (tokenizers >= 0.21); both run in Rust threads.
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def encode_batch(self, docs: list[str | bytes]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        return [np.asarray(e.ids + [self.info.eos_id], dtype=np.int32)
                for e in self._encode(texts, add_special_tokens=False)]

    def encode(self, text: str | bytes) -> list[int]:
        """The ids of one text as `encode_batch` makes them, no EOS appended (a prompt)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        """Ids back to text (special tokens kept)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _configured_eos(path: Path) -> str | None:
    """`eos_token` from a tokenizer_config.json beside the tokenizer, as HF repos ship it."""
    config = path.with_name("tokenizer_config.json")
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(spec: str, eos_token: str | None = None, *, key: str = "--tokenizer"
                   ) -> Tokenizer:
    """`"bytes"` or the path of a tokenizer.json; `key` names the setting in errors."""
    if spec == "bytes":
        if eos_token is not None:
            raise DataError(f"--eos-token: the byte tokenizer's EOS is fixed (id {BYTE_EOS_ID})")
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise DataError(f"{key}: {spec}: no such file; expected 'bytes' or a tokenizer.json")
    return HuggingFaceTokenizer(spec, eos_token)
