"""`europa-jax prepare`: text, JSON lines and Parquet files → a tokenized corpus on disk.

Documents stream through in small batches (read → tokenize → append to a shard), so
memory stays flat however large the corpus (one document at a time must fit).  Inputs are
checked before anything is written (they exist, their formats are known, the libraries
they need are installed), and the corpus appears at `--out` only once complete (see
`corpus.CorpusWriter`): an error leaves nothing there.

Input formats, by file name (`readers.py` has one reader per format):

    .jsonl .ndjson .json     JSON lines: one object per line, its `text_field` a document
                             (`.json` as Dolma ships it)
    .parquet                 the `text_field` column, one document per row
    .txt .text .md .markdown .rst .py, or no suffix
                             plain text, one document per file
    + .gz / .zst             JSON lines and plain text may be gzip or zstandard compressed

Any other suffix is an error listing these.  `.zst` and `.parquet` need the `formats`
extra (`pip install 'europa-jax[formats]'`).  Plain text is bytes as-is for the byte
tokenizer; a tokenizer.json gets UTF-8 text, and text that is not UTF-8 is a bad record.
Directories are walked in sorted order, skipping hidden entries.  Empty documents are
skipped (and counted): they would be a lone EOS.  A bad record (invalid JSON, not an
object, missing/null/non-string field, text that is not UTF-8) is a one-line error
naming the file and line (or Parquet row), or with `skip_bad` is skipped and counted:
`PreparedManifest.skipped_bad` has the counts per reason and the first few messages.

The default corpus, this interpreter's standard library sources, goes through the same
function (`stdlib_corpus`), cached once per stdlib version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from europa_jax.data import readers
from europa_jax.data.corpus import (DEFAULT_SHARD_TOKENS, MANIFEST, VERSION, CorpusExists,
                                    CorpusWriter, DataError, Manifest)
from europa_jax.data.readers import BadRecord
from europa_jax.data.tokenizer import ByteTokenizer, Tokenizer

# Tokenize this many documents (or bytes) per call: amortizes the Rust call, bounds memory.
_BATCH_DOCS = 512
_BATCH_BYTES = 16 << 20

# Pruned from the stdlib walk: third-party packages are not the stdlib, and the test
# suites are huge and noisy (binary-ish fixtures, intentionally malformed code).
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests",
                                   "__pycache__"})
# Bad records whose message is kept as an example (skip_bad).
_BAD_EXAMPLES = 5


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


def iter_documents(files: Sequence[Path], text_field: str = "text", *,
                   decode: bool = False, bad: BadRecords | None = None
                   ) -> Iterator[str | bytes]:
    """Documents of every file in order (`decode`: as UTF-8 text, for a tokenizer.json).

    A bad record is a one-line DataError naming file and line, or, given `bad`, is
    counted there and skipped.  Problems with a whole file are always errors.
    """
    for path in files:
        for item in readers.read(path, text_field=text_field, decode=decode):
            if isinstance(item, BadRecord):
                if bad is None:
                    raise DataError(f"{item.message} (or pass --skip-bad to skip and count "
                                    "such records)")
                bad.add(item)
            else:
                yield item


class BadRecords:
    """Skipped bad records: how many, per reason, and the first few messages."""

    def __init__(self):
        self.reasons: Counter[str] = Counter()
        self.first: list[BadRecord] = []

    @property
    def total(self) -> int:
        return sum(self.reasons.values())

    def add(self, record: BadRecord) -> None:
        self.reasons[record.reason] += 1
        if len(self.first) < _BAD_EXAMPLES:
            self.first.append(record)

    def to_json(self) -> dict:
        return {"total": self.total, "reasons": dict(sorted(self.reasons.items())),
                "examples": [r.message for r in self.first]}

    def summary(self) -> str:
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.reasons.items()))
        first = ", ".join(r.location for r in self.first)
        return f"prepare: skipped {self.total:,} bad records ({reasons}); first: {first}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedManifest(Manifest):
    """The committed corpus's `Manifest`, plus the bad records `prepare_corpus` skipped:
    `BadRecords.to_json()`, total 0 unless `skip_bad`.  `skipped_bad` is not written to
    manifest.json (the corpus format has no field for it); older readers are unaffected."""
    skipped_bad: dict = dataclasses.field(default_factory=dict)


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

    def skipped(self, bad: BadRecords) -> None:
        if self.enabled and bad.total:
            print(bad.summary(), file=sys.stderr, flush=True)


def prepare_corpus(inputs: Sequence[str | Path], out: str | Path, tokenizer: Tokenizer, *,
                   text_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS,
                   progress: bool = True, input_labels: Sequence[str] | None = None,
                   skip_bad: bool = False) -> PreparedManifest:
    """Tokenize `inputs` (EOS after each document) into a new corpus directory `out`.

    `skip_bad`: skip and count bad records (`.skipped_bad` of the result, and one line on
    stderr with `progress`) instead of stopping at the first.
    """
    files = resolve_inputs(inputs)
    for path in files:  # unknown formats and missing libraries fail before any work
        readers.reader_for(path)
    labels = tuple(input_labels or map(str, inputs))
    report = _Progress(progress)
    bad = BadRecords() if skip_bad else None
    decode = tokenizer.info.kind != ByteTokenizer.info.kind
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

        for doc in iter_documents(files, text_field, decode=decode, bad=bad):
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
            also = f", {bad.total} bad records skipped" if bad and bad.total else ""
            raise DataError(f"--input {' '.join(labels)}: no documents found "
                            f"({len(files)} files, {skipped} empty documents{also})")
        manifest = writer.commit(tokenizer=tokenizer.info.to_json(), inputs=labels,
                                 text_field=text_field, skipped_empty=skipped)
    report(manifest.documents, manifest.tokens, final=True)
    if bad is not None:
        report.skipped(bad)
    return PreparedManifest(**{f.name: getattr(manifest, f.name)
                               for f in dataclasses.fields(manifest)},
                            skipped_bad=(bad or BadRecords()).to_json())


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
