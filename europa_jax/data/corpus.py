"""The prepared-corpus format: token shards, document offsets, a manifest.

    DIR/manifest.json        format, tokenizer identity, counts, per-file checksums
    DIR/tokens-00000.bin     token ids (uint16 if the vocab fits, else uint32), documents
                             back to back, each ending in the tokenizer's EOS id
    DIR/offsets-00000.bin    int64 end offset of every document within its shard

Plain little-endian arrays read through `np.memmap`: random access to any document (and
any slice of one) costs one lookup, nothing is decoded, the OS page cache does the
caching, and a document's length is known from 8 bytes of metadata, which is what lets
every process plan the whole global batch while reading only its own rows' tokens.
Shape suffixes (europa_jax/__init__.py): W documents, Z pieces of documents, T tokens.

`CorpusWriter` streams into a hidden temporary directory beside the destination and
renames it into place only after the manifest is written: a crash or a bad input never
leaves a directory that looks like a valid corpus, and an existing one is never touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

FORMAT = "europa-jax-corpus"
VERSION = 1
MANIFEST = "manifest.json"
# 2^30 tokens (2-4 GiB) per shard: few files for the file system, small enough to copy.
DEFAULT_SHARD_TOKENS = 1 << 30


class DataError(ValueError):
    """A problem with an input or a corpus; the message is one line naming file and expectation."""


class CorpusExists(DataError):
    """The destination appeared while we were writing (another process won the race)."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass(frozen=True, kw_only=True)
class Shard:
    tokens_file: str
    offsets_file: str
    documents: int
    tokens: int
    tokens_sha256: str
    offsets_sha256: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    tokenizer: dict        # TokenizerInfo.to_json()
    dtype: str
    documents: int
    tokens: int
    max_document_tokens: int
    shards: tuple[Shard, ...]
    inputs: tuple[str, ...] = ()
    text_field: str | None = None
    skipped_empty: int = 0

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        if not directory.is_dir():
            raise DataError(f"{directory}: no such directory; expected a corpus written by "
                            "`europa-jax prepare`")
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise DataError(f"{path}: not found; expected a corpus written by "
                            "`europa-jax prepare`") from None
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: unreadable or not JSON ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise DataError(f"{path}: not a {FORMAT} manifest")
        if raw.get("version") != VERSION:
            raise DataError(f"{path}: format version {raw.get('version')!r}, expected {VERSION}")
        try:
            known = {f.name for f in fields(cls)}
            body = {k: v for k, v in raw.items() if k in known}
            body["shards"] = tuple(Shard(**s) for s in body["shards"])
            body["inputs"] = tuple(body.get("inputs", ()))
            manifest = cls(**body)
        except (KeyError, TypeError) as e:
            raise DataError(f"{path}: missing or malformed field ({e})") from None
        if manifest.documents != sum(s.documents for s in manifest.shards) or \
                manifest.tokens != sum(s.tokens for s in manifest.shards):
            raise DataError(f"{path}: document/token totals disagree with its shards")
        return manifest


def _sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class CorpusWriter:
    """Append documents; `commit()` publishes the corpus atomically.  Use as a context manager."""

    def __init__(self, out: str | Path, *, vocab_size: int,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS):
        self.out = Path(out)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.shard_tokens = shard_tokens
        self.documents = self.tokens = self.max_document_tokens = 0
        self._shards: list[Shard] = []
        self._tmp: Path | None = None
        self._files = None

    def __enter__(self) -> CorpusWriter:
        if self.out.exists():
            raise CorpusExists(f"{self.out}: already exists; remove it or choose another --out "
                            "(nothing was overwritten)")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.out.with_name(f".{self.out.name}.tmp-{uuid.uuid4().hex[:8]}")
        self._tmp.mkdir()
        return self

    def __exit__(self, *exc) -> None:
        self._close_files()
        if self._tmp is not None and self._tmp.exists():
            shutil.rmtree(self._tmp, ignore_errors=True)

    def add(self, ids_T: np.ndarray) -> None:
        """One document's ids (EOS included)."""
        if len(ids_T) == 0:
            raise ValueError("documents must hold at least their EOS token")
        if self._files is None:
            self._open_shard()
        tokens_f, offsets_f, tokens_sha, offsets_sha, shard = self._files
        data = np.ascontiguousarray(ids_T, dtype=self.dtype).tobytes()
        tokens_f.write(data)
        tokens_sha.update(data)
        shard["tokens"] += len(ids_T)
        shard["documents"] += 1
        end = np.array([shard["tokens"]], dtype="<i8").tobytes()
        offsets_f.write(end)
        offsets_sha.update(end)
        self.documents += 1
        self.tokens += len(ids_T)
        self.max_document_tokens = max(self.max_document_tokens, len(ids_T))
        if shard["tokens"] >= self.shard_tokens:
            self._close_files()

    def commit(self, *, tokenizer: dict, **extra) -> Manifest:
        if self.documents == 0:
            raise ValueError("refusing to commit an empty corpus")
        self._close_files()
        manifest = Manifest(tokenizer=tokenizer, dtype=self.dtype.name, documents=self.documents,
                            tokens=self.tokens, max_document_tokens=self.max_document_tokens,
                            shards=tuple(self._shards), **extra)
        (self._tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
        try:
            # rename() of a directory is atomic; it fails if the target is a non-empty dir.
            os.rename(self._tmp, self.out)
        except OSError:
            raise CorpusExists(f"{self.out}: appeared while writing; nothing was overwritten"
                               ) from None
        self._tmp = None
        return manifest

    def _open_shard(self) -> None:
        index = len(self._shards)
        names = (f"tokens-{index:05d}.bin", f"offsets-{index:05d}.bin")
        self._files = (open(self._tmp / names[0], "wb"), open(self._tmp / names[1], "wb"),
                       hashlib.sha256(), hashlib.sha256(),
                       {"names": names, "tokens": 0, "documents": 0})

    def _close_files(self) -> None:
        if self._files is None:
            return
        tokens_f, offsets_f, tokens_sha, offsets_sha, shard = self._files
        tokens_f.close()
        offsets_f.close()
        self._files = None
        self._shards.append(Shard(tokens_file=shard["names"][0], offsets_file=shard["names"][1],
                                  documents=shard["documents"], tokens=shard["tokens"],
                                  tokens_sha256=tokens_sha.hexdigest(),
                                  offsets_sha256=offsets_sha.hexdigest()))


class TokenCorpus:
    """Random access to a prepared corpus (a Grain `RandomAccessDataSource` of documents).

    Opening checks the manifest and every file's size (a truncated or missing shard is an
    error here, not a short read mid-run); `verify=True` also recomputes the checksums.
    Memory maps are opened lazily and dropped when pickled, so the object is cheap to
    send to Grain worker processes. Every read checks its shards' sizes again (a stat
    each): a shard truncated while a run reads it would otherwise kill the process with
    SIGBUS when the mapped pages past its new end are touched; it is a `DataError` naming
    the file instead. (A truncation landing between that check and the copy, microseconds
    later, can still fault.)
    """

    def __init__(self, path: str | Path, *, verify: bool = False):
        self.path = Path(path)
        self.manifest = Manifest.read(self.path)
        self.dtype = np.dtype(self.manifest.dtype)
        for shard in self.manifest.shards:
            self._check_file(shard.tokens_file, shard.tokens * self.dtype.itemsize,
                             shard.tokens_sha256 if verify else None)
            self._check_file(shard.offsets_file, shard.documents * 8,
                             shard.offsets_sha256 if verify else None)
        # First global document index of each shard, for doc -> (shard, local) lookups.
        self._first_doc = np.cumsum([0] + [s.documents for s in self.manifest.shards])
        self._maps: list[tuple[np.ndarray, np.ndarray]] | None = None

    def _check_file(self, name: str, size: int, sha256: str | None) -> None:
        path = self.path / name
        try:
            actual = path.stat().st_size
            if actual == size:
                with path.open("rb"):
                    pass
        except OSError as e:
            raise DataError(f"{path}: unreadable shard ({e.strerror or e}); "
                            f"expected {size} bytes per {self.path / MANIFEST}") from None
        if actual != size:
            raise DataError(f"{path}: {actual} bytes, expected {size} per "
                            f"{self.path / MANIFEST}; the shard is truncated or corrupt")
        if sha256 is not None and _sha256_file(path) != sha256:
            raise DataError(f"{path}: checksum differs from {self.path / MANIFEST} "
                            f"(sha256 {sha256[:12]}…); the shard is corrupt")

    def _mapped(self) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._maps is None:
            try:
                self._maps = [(np.memmap(self.path / s.tokens_file, dtype=self.dtype, mode="r"),
                               np.memmap(self.path / s.offsets_file, dtype="<i8", mode="r"))
                              for s in self.manifest.shards]
            except OSError as e:  # vanished since the corpus was opened
                raise DataError(f"{e.filename}: unreadable shard ({e.strerror or e}) while the "
                                f"run reads {self.path}") from None
        return self._maps

    def _still_whole(self, shards: list[int]) -> None:
        """The listed shards' files still have their manifest sizes (before their pages are
        touched: past a truncated file's end a mapped page is a SIGBUS, not an error)."""
        for s in shards:
            shard = self.manifest.shards[s]
            for name, size in ((shard.tokens_file, shard.tokens * self.dtype.itemsize),
                               (shard.offsets_file, shard.documents * 8)):
                path = self.path / name
                try:
                    actual = path.stat().st_size
                except OSError as e:
                    raise DataError(f"{path}: unreadable shard ({e.strerror or e}) while the "
                                    "run reads it") from None
                if actual != size:
                    raise DataError(f"{path}: {actual} bytes, expected {size} per "
                                    f"{self.path / MANIFEST}: the shard changed while the run "
                                    "read it (truncated or replaced)")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def __len__(self) -> int:
        return self.manifest.documents

    def __getitem__(self, doc: int) -> np.ndarray:
        return self.read(doc, 0, int(self.lengths(np.array([doc]))[0]))

    def _locate(self, doc_W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        doc_W = np.asarray(doc_W, dtype=np.int64)
        if doc_W.size and (doc_W.min() < 0 or doc_W.max() >= len(self)):
            raise IndexError(f"document index out of range [0, {len(self)})")
        shard_W = np.searchsorted(self._first_doc, doc_W, side="right") - 1
        return shard_W, doc_W - self._first_doc[shard_W]

    def _bounds(self, doc_W: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, start, end) token offsets of each document within its shard."""
        shard_W, local_W = self._locate(doc_W)
        start_W = np.zeros(len(shard_W), dtype=np.int64)
        end_W = np.zeros(len(shard_W), dtype=np.int64)
        maps = self._mapped()
        self._still_whole(np.unique(shard_W).tolist())
        for s in np.unique(shard_W).tolist():
            sel = shard_W == s
            ends = maps[s][1]
            local = local_W[sel]
            end_W[sel] = ends[local]
            start_W[sel] = np.where(local > 0, ends[np.maximum(local - 1, 0)], 0)
        return shard_W, start_W, end_W

    def lengths(self, doc_W: np.ndarray) -> np.ndarray:
        """Tokens (EOS included) of each document; reads metadata only."""
        _, start_W, end_W = self._bounds(doc_W)
        return end_W - start_W

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of one document (a view into the memory map)."""
        return self.read_many(np.array([doc]), np.array([start]), np.array([stop]))[0]

    def read_many(self, doc_Z: np.ndarray, start_Z: np.ndarray, stop_Z: np.ndarray
                  ) -> list[np.ndarray]:
        """Tokens [start, stop) of each listed document, with one metadata lookup."""
        shard_Z, base_Z, end_Z = self._bounds(doc_Z)
        start_Z, stop_Z = np.asarray(start_Z), np.asarray(stop_Z)
        bad = (start_Z < 0) | (start_Z > stop_Z) | (stop_Z > end_Z - base_Z)
        if bad.any():
            i = int(np.argmax(bad))
            raise IndexError(f"tokens [{start_Z[i]}, {stop_Z[i]}) outside document {doc_Z[i]} "
                             f"of {end_Z[i] - base_Z[i]} tokens")
        maps = self._mapped()
        return [maps[s][0][b + lo:b + hi] for s, b, lo, hi in
                zip(shard_Z.tolist(), base_Z.tolist(), start_Z.tolist(), stop_Z.tolist())]
