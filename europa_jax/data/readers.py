"""Input formats of `europa-jax prepare`: one reader per format, chosen by file name.

    JSON lines   .jsonl .ndjson .json   one JSON object per line; the document is its
                                        `text_field` (`.json` as Dolma ships it: lines)
    Parquet      .parquet               the `text_field` column (strings or binary), read
                                        in record batches, that column only
    plain text   .txt .text .md .markdown .rst .py, or no suffix: one document per file

JSON lines and plain text may be compressed: a trailing `.gz` (gzip) or `.zst`
(zstandard, any number of frames; a frame cut short is an error).  Suffixes match
case-insensitively; anything else is an error naming the file and these formats.
Everything streams (a line, a record batch or one plain-text document at a time).

A reader yields documents, `str` or `bytes` (plain text and Parquet binary stay bytes for
the byte tokenizer, which takes bytes as-is; with `decode` they must be UTF-8), and a
`BadRecord` for a record that cannot be a document (invalid JSON, not an object, no such
field, a non-string or null value, text that is not UTF-8): the caller raises or skips
it.  A problem with a whole file (unreadable, corrupt, no such Parquet column) is a
`DataError`.  Locations: `FILE:LINE` (1-based) for lines, `FILE: row N` (0-based) for
Parquet.  zstandard and pyarrow are optional (`pip install 'europa-jax[formats]'`),
imported only when a file needs them.
"""

from __future__ import annotations

import codecs
import gzip
import importlib
import io
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath

from europa_jax.data.corpus import DataError

JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet",)
# "" is a file without a suffix (README, LICENSE).  The stdlib corpus needs ".py".
TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".py", "")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
ACCEPTED = ("accepted: .jsonl .ndjson .json (JSON lines), .parquet, plain text (.txt .text "
            ".md .markdown .rst .py or no suffix); JSON lines and text may end in .gz or .zst")
_INSTALL = "pip install 'europa-jax[formats]'"
_PARQUET_BATCH_ROWS = 512
# A zstd step decompresses about this much (the compressed bytes read per step adapt to
# the ratio: zstandard cannot cap one call's output, and repetitive text compresses 1000×).
_ZSTD_STEP_OUT = 1 << 18
_ZSTD_READ_RANGE = (64, 1 << 20)   # compressed bytes read per step, at least and at most
_ZSTD_MAX_WINDOW = 1 << 31         # files written with `zstd --long=31` need this window


@dataclass(frozen=True)
class BadRecord:
    """A record that is no document; `reason` is one of `BAD_REASONS`."""
    reason: str
    location: str    # FILE:LINE or FILE: row N
    message: str     # one line, starting with the location


BAD_REASONS = ("invalid_json", "not_an_object", "missing_field", "not_a_string", "null",
               "invalid_utf8")
Item = str | bytes | BadRecord
Reader = Callable[..., Iterator[Item]]


class CorruptStream(Exception):
    """Compressed data that is malformed or ends mid-frame."""


def reader_for(path: Path) -> Reader:
    """The reader for `path`'s format; an unknown format or missing library is a DataError."""
    suffix, compression = _suffixes(path)
    reader = READERS.get(suffix)
    if reader is None or (compression and reader is read_parquet):
        shown = path.name[len(path.name) - len(suffix + compression):]
        raise DataError(f"{path}: unsupported file type '{shown}'; {ACCEPTED}")
    if compression == ".zst":
        _need("zstandard", path, "zstandard (.zst)")
    if reader is read_parquet:
        _need("pyarrow.parquet", path, "Parquet", package="pyarrow")
    return reader


def read(path: Path, *, text_field: str = "text", decode: bool = False) -> Iterator[Item]:
    """Documents and bad records of one file, in order."""
    reader = reader_for(path)
    try:
        yield from reader(path, text_field=text_field, decode=decode)
    except (EOFError, gzip.BadGzipFile, zlib.error, CorruptStream) as e:
        kind = COMPRESSIONS.get(_suffixes(path)[1], "file")
        raise DataError(f"{path}: truncated or corrupt {kind} ({e})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


# ----------------------------------------------------------------------------- readers


def read_json_lines(path: Path, *, text_field: str, decode: bool) -> Iterator[Item]:
    """One document per non-blank line: the line's JSON object's `text_field`."""
    with _open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.isspace():
                yield _record_text(f"{path}:{line_no}", line, text_field, first=line_no == 1)


def read_text(path: Path, *, text_field: str, decode: bool) -> Iterator[Item]:
    """The whole file, one document: bytes as-is, or (`decode`) UTF-8 text."""
    with _open(path) as f:
        data = f.read()
    yield _decoded(data, str(path), whole_file=True) if decode else data


def read_parquet(path: Path, *, text_field: str, decode: bool) -> Iterator[Item]:
    """One document per row: the `text_field` column, read a record batch at a time."""
    pa = importlib.import_module("pyarrow")
    with _open_parquet(path, text_field, pa) as parquet:
        row = 0
        try:
            for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS,
                                              columns=[text_field]):
                # As bytes, so UTF-8 is checked per row: a bad row is a BadRecord.
                for value in batch.column(0).cast(pa.large_binary()).to_pylist():
                    if value is None:
                        where = f"{path}: row {row}"
                        yield BadRecord("null", where,
                                        f"{where}: column '{text_field}' is null")
                    else:
                        yield _decoded(value, f"{path}: row {row}") if decode else value
                    row += 1
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: corrupt Parquet after row {row} ({_first_line(e)})"
                            ) from None


def _open_parquet(path: Path, text_field: str, pa):
    """The open `ParquetFile`, checked to have a string or binary `text_field` column."""
    pq = importlib.import_module("pyarrow.parquet")
    try:
        # buffer_size > 0: column chunks are read as a buffered stream, not whole.
        parquet = pq.ParquetFile(path, buffer_size=1 << 22)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({_first_line(e)})") from None
    if text_field not in schema.names:
        parquet.close()
        names = ", ".join(schema.names[:12]) + (", ..." if len(schema.names) > 12 else "")
        raise DataError(f"{path}: no column '{text_field}' (columns: {names or 'none'}); "
                        "choose one with --text-field")
    kind = schema.field(text_field).type
    if not any(check(kind) for check in (pa.types.is_string, pa.types.is_large_string,
                                          pa.types.is_string_view, pa.types.is_binary,
                                          pa.types.is_large_binary, pa.types.is_binary_view)):
        parquet.close()
        raise DataError(f"{path}: column '{text_field}' is {kind}, expected strings")
    return parquet


READERS: dict[str, Reader] = {**dict.fromkeys(JSON_LINES_SUFFIXES, read_json_lines),
                              **dict.fromkeys(PARQUET_SUFFIXES, read_parquet),
                              **dict.fromkeys(TEXT_SUFFIXES, read_text)}


# ----------------------------------------------------------------------------- helpers


def _record_text(where: str, line: bytes, text_field: str, first: bool) -> str | BadRecord:
    if first:
        line = line.removeprefix(codecs.BOM_UTF8)
    text = _decoded(line, where, hint="JSON must be UTF-8")
    if isinstance(text, BadRecord):
        return text
    try:
        record = json.loads(text)
    except ValueError as e:
        return BadRecord("invalid_json", where, f"{where}: not valid JSON ({e}); expected one "
                         "object per line")
    if not isinstance(record, dict):
        return BadRecord("not_an_object", where, f"{where}: expected a JSON object, got "
                         f"{type(record).__name__}")
    if text_field not in record:
        have = ", ".join(sorted(map(str, record))[:8]) or "none"
        return BadRecord("missing_field", where, f"{where}: no field '{text_field}' (fields: "
                         f"{have}); choose one with --text-field")
    text = record[text_field]
    if text is None:
        return BadRecord("null", where, f"{where}: field '{text_field}' is null, expected a "
                         "string")
    if not isinstance(text, str):
        return BadRecord("not_a_string", where, f"{where}: field '{text_field}' is "
                         f"{type(text).__name__}, expected a string")
    if not text.isascii():
        try:  # a lone surrogate escape ("\ud800") decodes to a str no tokenizer can take
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return BadRecord("invalid_utf8", where, f"{where}: field '{text_field}' is not "
                             f"valid Unicode ({e.reason} at character {e.start})")
    return text


def _decoded(data: bytes, where: str, whole_file: bool = False,
             hint: str = "a tokenizer.json needs UTF-8 text") -> str | BadRecord:
    """`data` as UTF-8 text; for a whole file the location gets the bad byte's line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if whole_file:
            line = data.count(b"\n", 0, e.start) + 1
            where = f"{where}:{line}"
        return BadRecord("invalid_utf8", where, f"{where}: not valid UTF-8 ({e.reason} at "
                         f"byte {e.start}); {hint}")


def _suffixes(path: Path) -> tuple[str, str]:
    """(format suffix, compression suffix) of `path`, lower case: ".jsonl", ".zst"."""
    name = path.name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    return PurePath(name[:len(name) - len(compression)]).suffix, compression


def _open(path: Path):
    """`path` as a binary stream of lines, decompressed by its suffix."""
    compression = _suffixes(path)[1]
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".zst":
        raw = path.open("rb")
        try:
            return io.BufferedReader(_ZstdReader(raw), buffer_size=1 << 16)
        except BaseException:
            raw.close()
            raise
    return path.open("rb")


class _ZstdReader(io.RawIOBase):
    """A zstandard stream of any number of frames, decompressed a step at a time.

    zstandard's own `stream_reader` returns a truncated file's data without an error; this
    raises `CorruptStream` when the input ends inside a frame (or is not zstd at all).
    """

    def __init__(self, raw):
        zstd = importlib.import_module("zstandard")
        self._raw = raw                    # a buffered file: small reads are cheap
        self._error = zstd.ZstdError
        self._dctx = zstd.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
        self._frame = None                 # the decompressor of the frame in progress
        self._carry = b""                  # read past the end of the last frame
        self._read_size = _ZSTD_READ_RANGE[0]
        self._out, self._pos = b"", 0      # decompressed, returned up to _pos

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data, self._carry = self._carry or self._raw.read(self._read_size), b""
            if not data:
                if self._frame is not None:
                    raise CorruptStream("the input ends inside a zstd frame")
                return 0
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            try:
                self._out, self._pos = self._frame.decompress(data), 0
            except self._error as e:
                raise CorruptStream(str(e)) from None
            if self._frame.eof:  # the rest of `data` starts the next frame
                self._carry, self._frame = self._frame.unused_data, None
            low, high = _ZSTD_READ_RANGE
            self._read_size = max(low, min(high, len(data) * _ZSTD_STEP_OUT
                                           // max(len(self._out), 1)))
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = memoryview(self._out)[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _need(module: str, path: Path, what: str, package: str | None = None):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{path}: reading {what} needs {package or module}: {_INSTALL}"
                        ) from None


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]
