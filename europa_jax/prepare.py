"""`europa-jax prepare`: text files, directories and JSONL → a tokenized corpus on disk.

Documents stream through in small batches (read → tokenize → append to a shard), so
memory stays flat however large the corpus (one document at a time must fit).  Inputs are checked before anything is
written, and the corpus appears at `--out` only once complete (see `corpus.CorpusWriter`).

Input kinds, by name: `*.jsonl` / `*.ndjson` hold one JSON object per line whose
`text_field` is a document; anything else is one document per file (bytes as-is for the
byte tokenizer, UTF-8 for a tokenizer.json).  A trailing `.gz` is decompressed.
Directories are walked in sorted order, skipping hidden entries.  Empty documents are
skipped (and counted): they would be a lone EOS.

The default corpus, this interpreter's standard library sources, goes through the same
function (`stdlib_corpus`), cached once per stdlib version.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from europa_jax.corpus import (DEFAULT_SHARD_TOKENS, MANIFEST, VERSION, CorpusExists,
                               CorpusWriter, DataError, Manifest)
from europa_jax.tokenizer import ByteTokenizer, Tokenizer

JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Tokenize this many documents (or bytes) per call: amortizes the Rust call, bounds memory.
_BATCH_DOCS = 512
_BATCH_BYTES = 16 << 20

# Pruned from the stdlib walk: third-party packages are not the stdlib, and the test
# suites are huge and noisy (binary-ish fixtures, intentionally malformed code).
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests",
                                   "__pycache__"})


def resolve_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Every input file in order (directories expanded, sorted); a missing path is an error."""
    if not inputs:
        raise DataError("--input: no inputs given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
            files += sorted(found, key=lambda p: p.relative_to(path).as_posix())
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"--input {item}: no such file or directory")
    return files


def _is_jsonl(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name.endswith(JSONL_SUFFIXES)


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")


def iter_documents(files: Sequence[Path], text_field: str = "text"
                   ) -> Iterator[str | bytes]:
    """Documents of every file in order; bad lines, fields and files are one-line errors."""
    for path in files:
        try:
            if not _is_jsonl(path):
                with _open(path) as f:
                    yield f.read()
                continue
            with _open(path) as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        yield _jsonl_text(path, line_no, line, text_field)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise DataError(f"{path}: truncated or corrupt gzip ({e})") from None
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _jsonl_text(path: Path, line_no: int, line: bytes, text_field: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}:{line_no}: not valid JSON ({e}); expected one object per line"
                        ) from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{line_no}: expected a JSON object, got "
                        f"{type(record).__name__}")
    if text_field not in record:
        have = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise DataError(f"{path}:{line_no}: no field '{text_field}' (fields: {have}); "
                        "choose one with --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{path}:{line_no}: field '{text_field}' is "
                        f"{type(text).__name__}, expected a string")
    return text


class _Progress:
    """Documents and tokens so far: one rewritten line on a terminal, a line per 10 s in logs."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = self.last = time.perf_counter()

    def __call__(self, documents: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not final and now - self.last < (0.5 if self.tty else 10.0)):
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        line = f"prepare: {documents:,} documents, {tokens:,} tokens ({rate:,.0f} tokens/s)"
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


def prepare_corpus(inputs: Sequence[str | Path], out: str | Path, tokenizer: Tokenizer, *,
                   text_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS,
                   progress: bool = True, input_labels: Sequence[str] | None = None
                   ) -> Manifest:
    """Tokenize `inputs` (EOS after each document) into a new corpus directory `out`."""
    files = resolve_inputs(inputs)
    labels = tuple(input_labels or map(str, inputs))
    report = _Progress(progress)
    skipped = 0
    with CorpusWriter(out, vocab_size=tokenizer.info.vocab_size,
                      shard_tokens=shard_tokens) as writer:
        pending: list[str | bytes] = []
        pending_bytes = 0

        def flush():
            for ids_T in tokenizer.encode_batch(pending):
                writer.add(ids_T)
            pending.clear()
            report(writer.documents, writer.tokens)

        for doc in iter_documents(files, text_field):
            if not doc:
                skipped += 1
                continue
            pending.append(doc)
            pending_bytes += len(doc)
            if len(pending) >= _BATCH_DOCS or pending_bytes >= _BATCH_BYTES:
                flush()
                pending_bytes = 0
        if pending:
            flush()
        if writer.documents == 0:
            raise DataError(f"--input {' '.join(labels)}: no documents found "
                            f"({len(files)} files, {skipped} empty documents)")
        manifest = writer.commit(tokenizer=tokenizer.info.to_json(), inputs=labels,
                                 text_field=text_field, skipped_empty=skipped)
    report(manifest.documents, manifest.tokens, final=True)
    return manifest


# ----------------------------------------------------------------------------- stdlib


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(max_documents: int | None = None) -> list[Path]:
    """Sorted `.py` files of this interpreter's stdlib (first `max_documents`)."""
    root = stdlib_root()
    found: list[Path] = []
    # os.walk (not rglob) so excluded trees are pruned instead of traversed.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    if not found:
        raise DataError(f"{root}: no stdlib .py files found")
    # Walk order is file-system dependent; sorting makes the corpus (hence the shuffled
    # order for a seed) identical on every host of a job.
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return found if max_documents is None else found[:max_documents]


def default_cache_root() -> Path:
    if os.environ.get("EUROPA_JAX_CACHE"):
        return Path(os.environ["EUROPA_JAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "europa-jax"


def stdlib_corpus(cache_root: str | Path | None = None, *, progress: bool = True) -> Path:
    """The byte-level stdlib corpus, prepared on first use; returns its directory.

    The cache key covers every file's name, size and mtime, so a changed stdlib gets a
    fresh corpus.  Processes that race here each write a private temporary directory;
    the first rename wins and the others use its result.
    """
    root = stdlib_root()
    files = stdlib_sources()
    key = hashlib.sha256(f"v{VERSION}\n".encode())
    for path in files:
        st = path.stat()
        key.update(f"{path.relative_to(root).as_posix()}\t{st.st_size}\t{st.st_mtime_ns}\n"
                   .encode())
    out = Path(cache_root or default_cache_root()) / (
        f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}-{key.hexdigest()[:16]}")
    if not (out / MANIFEST).exists():
        try:
            prepare_corpus(files, out, ByteTokenizer(), progress=progress,
                           input_labels=[f"stdlib:{root}"])
        except CorpusExists:
            if not (out / MANIFEST).exists():
                raise
    return out
