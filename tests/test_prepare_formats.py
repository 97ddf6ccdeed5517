"""Tests for prepare's input formats (europa_jax.data.readers): real .zst, .gz and .parquet files
written with the real libraries, read back through the prepared corpus."""

import gzip
import json
import sys
import tracemalloc

import pytest

from europa_jax.data import prepare, readers, tokenizer
from europa_jax.data.corpus import DataError, Manifest, TokenCorpus
from conftest import cli
from test_prepare import check_bad_input, documents, nothing_left
from test_tokenizer import make_tokenizer_json

zstd = pytest.importorskip("zstandard")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

BYTES = tokenizer.ByteTokenizer()


def lines(*records):
    """JSON lines bytes: dicts are dumped, str/bytes written as the raw line."""
    raw = [r if isinstance(r, bytes) else r.encode() if isinstance(r, str)
           else json.dumps(r).encode() for r in records]
    return b"".join(r + b"\n" for r in raw)


def write_zst(path, data, frames=1):
    """`data` zstd-compressed in `frames` frames (as multi-part writers produce)."""
    cut = [len(data) * i // frames for i in range(frames + 1)]
    ctx = zstd.ZstdCompressor()
    path.write_bytes(b"".join(ctx.compress(data[a:b]) for a, b in zip(cut, cut[1:])))
    return path


def write_parquet(path, texts, *, column="text", type=None, row_group_size=2):
    table = pa.table({"id": pa.array(range(len(texts)), pa.int64()),
                      column: pa.array(texts, type=type or pa.string()),
                      "url": pa.array([f"https://x/{i}" for i in range(len(texts))])})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def hf_tokenizer(tmp_path):
    return tokenizer.load_tokenizer(str(make_tokenizer_json(tmp_path / "tokenizer.json")))


def test_every_format_in_one_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "_PARQUET_BATCH_ROWS", 2)  # batches across row groups
    src = tmp_path / "src"
    src.mkdir()
    write_zst(src / "a.jsonl.zst", lines({"text": "z1", "id": 1}, "", {"text": "z2é"},
                                         {"text": "z3"}), frames=2)
    write_parquet(src / "b.parquet", ["p0", "p1", "", "p3", "p4"])
    (src / "c.ndjson").write_bytes(lines({"text": "n1"}, {"text": "n2", "meta": {"x": 1}}))
    (src / "d.txt").write_bytes(b"plain\ntext\xff")  # not UTF-8: the byte tokenizer keeps it
    (src / "README").write_text("no suffix")
    (src / "e.md").write_text("# md")
    with gzip.open(src / "f.txt.gz", "wb") as f:
        f.write(b"gz text")
    write_zst(src / "g.TXT.ZST", b"zst text")
    assert pq.ParquetFile(src / "b.parquet").num_row_groups == 3
    manifest = prepare.prepare_corpus([src], tmp_path / "out", BYTES, progress=False)
    docs, _ = documents(tmp_path / "out")
    assert docs == [b"no suffix", b"z1", "z2é".encode(), b"z3",
                    b"p0", b"p1", b"p3", b"p4", b"n1", b"n2", b"plain\ntext\xff", b"# md",
                    b"gz text", b"zst text"]
    assert manifest.documents == 14 and manifest.skipped_empty == 1  # the empty parquet row
    assert isinstance(manifest, Manifest)
    assert manifest.skipped_bad == {"total": 0, "reasons": {}, "examples": []}


def test_dolma_json_gz_with_another_text_field(tmp_path):
    path = tmp_path / "dolma-0000.json.gz"
    with gzip.open(path, "wb") as f:
        f.write(lines({"id": "a", "content": "first doc", "source": "web"},
                      {"id": "b", "content": "second doc", "source": "web"}))
    manifest = prepare.prepare_corpus([path], tmp_path / "out", BYTES, text_field="content",
                                      progress=False)
    assert documents(tmp_path / "out")[0] == [b"first doc", b"second doc"]
    assert manifest.text_field == "content" and manifest.documents == 2


@pytest.mark.parametrize("type", [pa.string(), pa.large_string(), pa.binary()])
def test_parquet_with_a_tokenizer_json(tmp_path, type):
    tok = hf_tokenizer(tmp_path)
    texts = ["hello world", "the cat", "cat cat hello"]
    write_parquet(tmp_path / "x.parquet", [t.encode() if type == pa.binary() else t
                                           for t in texts], column="body", type=type)
    prepare.prepare_corpus([tmp_path / "x.parquet"], tmp_path / "out", tok, text_field="body",
                           progress=False)
    corpus = TokenCorpus(tmp_path / "out")
    assert [corpus[i].tolist() for i in range(len(corpus))] == [[1, 2, 5], [3, 4, 5],
                                                                [4, 4, 1, 5]]


def test_zst_streams_with_flat_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "_BATCH_BYTES", 1 << 20)
    line = json.dumps({"text": "x" * 20_000}) + "\n"
    path = write_zst(tmp_path / "big.jsonl.zst", (line * 600).encode(), frames=3)
    assert path.stat().st_size < 100_000  # 12 MB of text: a whole-file read would show
    tracemalloc.start()
    manifest = prepare.prepare_corpus([path], tmp_path / "out", BYTES, progress=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert manifest.tokens == 600 * 20_001
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB: the file is being decompressed whole"


def setup_file(name, content):
    """Setup: write one input file (bytes, or a callable writing the path) → input list."""
    def setup(d):
        path = d / name
        if callable(content):
            content(path)
        else:
            path.write_bytes(content)
        return [path]
    return setup


ACCEPTED = "accepted: .jsonl .ndjson .json (JSON lines), .parquet, plain text"
BAD_INPUTS = [
    (setup_file("x.csv", b"a,b\n"), "{d}/x.csv: unsupported file type '.csv'; " + ACCEPTED),
    (setup_file("x.json.bz2", b"BZh"), "{d}/x.json.bz2: unsupported file type '.bz2'; "),
    (setup_file("x.parquet.gz", b""), "{d}/x.parquet.gz: unsupported file type '.parquet.gz'"),
    (setup_file("x.jsonl.zst", lambda p: write_zst(p, lines({"text": "a"}, {"text": "b"},
                                                            {"body": "c"}))),
     "{d}/x.jsonl.zst:3: no field 'text' (fields: body); choose one with --text-field"),
    (setup_file("x.json.gz", gzip.compress(lines({"text": "a"}, "{oops"))),
     "{d}/x.json.gz:2: not valid JSON (Expecting property name"),
    (setup_file("x.ndjson", lines("[1, 2]")),
     "{d}/x.ndjson:1: expected a JSON object, got list"),
    (setup_file("x.jsonl", lines({"text": None})),
     "{d}/x.jsonl:1: field 'text' is null, expected a string"),
    (setup_file("x.jsonl", lines({"text": "ok"}, b'{"text": "b\xffd"}')),
     "{d}/x.jsonl:2: not valid UTF-8 (invalid start byte at byte 11); JSON must be UTF-8"),
    (setup_file("x.jsonl", lines('{"text": "lone \\ud800"}')),
     "{d}/x.jsonl:1: field 'text' is not valid Unicode (surrogates not allowed"),
    (setup_file("t.jsonl.zst", lambda p: p.write_bytes(zstd.ZstdCompressor().compress(
        lines({"text": "abc"}) * 1000)[:-20])),
     "{d}/t.jsonl.zst: truncated or corrupt zstd (the input ends inside a zstd frame)"),
    (setup_file("t.txt.zst", b"not zstd at all"), "{d}/t.txt.zst: truncated or corrupt zstd"),
    (setup_file("x.parquet", lambda p: write_parquet(p, ["a"], column="body")),
     "{d}/x.parquet: no column 'text' (columns: id, body, url); choose one with --text-field"),
    (setup_file("x.parquet", lambda p: pq.write_table(pa.table({"text": [1, 2]}), p)),
     "{d}/x.parquet: column 'text' is int64, expected strings"),
    (setup_file("x.parquet", lambda p: write_parquet(p, ["a", "b", "c", None, "e"])),
     "{d}/x.parquet: row 3: column 'text' is null"),
    (setup_file("x.parquet", b"PAR1 not really"), "{d}/x.parquet: not a readable Parquet file"),
]


@pytest.mark.parametrize("setup, message", BAD_INPUTS)
def test_bad_input_is_one_line_error_naming_the_place(tmp_path, setup, message):
    check_bad_input(tmp_path, setup, message)


def test_text_must_be_utf8_for_a_tokenizer_json(tmp_path):
    tok = hf_tokenizer(tmp_path)
    (tmp_path / "ok.txt").write_text("hello")
    (tmp_path / "b.txt").write_bytes(b"the cat\nhello \xffworld\n")
    write_parquet(tmp_path / "p.parquet", [b"hello", b"c\xc3t"], type=pa.binary())
    for path, where in [(tmp_path / "b.txt", f"{tmp_path}/b.txt:2"),
                        (tmp_path / "p.parquet", f"{tmp_path}/p.parquet: row 1")]:
        with pytest.raises(DataError) as err:
            prepare.prepare_corpus([tmp_path / "ok.txt", path], tmp_path / "out", tok,
                                   progress=False)
        assert str(err.value).startswith(f"{where}: not valid UTF-8 (invalid ")
        assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    # The byte tokenizer takes the same bytes as-is.
    prepare.prepare_corpus([tmp_path / "b.txt"], tmp_path / "bytes", BYTES, progress=False)
    assert documents(tmp_path / "bytes")[0] == [b"the cat\nhello \xffworld\n"]


def test_unknown_format_in_a_directory_fails_before_anything_is_read(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(lines({"text": "a"}))
    (src / "z.csv").write_text("x")
    read = []
    monkeypatch.setitem(readers.READERS, ".jsonl", lambda *a, **k: read.append(a) or iter(()))
    with pytest.raises(DataError, match=r"z\.csv: unsupported file type '\.csv'"):
        prepare.prepare_corpus([src], tmp_path / "out", BYTES, progress=False, skip_bad=True)
    assert read == [] and nothing_left(tmp_path, "src")
    (src / "z.csv").unlink()
    with pytest.raises(DataError, match="no documents found"):  # the spy reads nothing
        prepare.prepare_corpus([src], tmp_path / "out", BYTES, progress=False)
    assert len(read) == 1


@pytest.mark.parametrize("module, name, message", [
    ("pyarrow.parquet", "x.parquet", "reading Parquet needs pyarrow"),
    ("zstandard", "x.jsonl.zst", "reading zstandard (.zst) needs zstandard"),
])
def test_missing_library_is_one_line(tmp_path, monkeypatch, module, name, message):
    (tmp_path / name).write_bytes(b"")
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(DataError) as err:
        prepare.prepare_corpus([tmp_path / name], tmp_path / "out", BYTES, progress=False)
    assert str(err.value) == f"{tmp_path / name}: {message}: pip install 'europa-jax[formats]'"
    assert not (tmp_path / "out").exists()


def test_skip_bad_skips_and_counts_exactly_the_bad_records(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(lines(
        {"text": "good1"}, "{oops", "[1]", {"body": "x"}, {"text": 7}, {"text": None},
        b'{"text": "\xff"}', '{"text": "\\udc00"}', {"text": "good2"}, {"text": ""}))
    write_zst(src / "b.jsonl.zst", lines({"text": "good3"}, "nope"))
    write_parquet(src / "c.parquet", ["good4", None, "good5"])
    (src / "d.txt").write_bytes(b"good6")
    manifest = prepare.prepare_corpus([src], tmp_path / "out", BYTES, skip_bad=True)
    assert documents(tmp_path / "out")[0] == [b"good1", b"good2", b"good3", b"good4",
                                              b"good5", b"good6"]
    assert manifest.skipped_empty == 1
    bad = manifest.skipped_bad
    assert bad["total"] == 9
    assert bad["reasons"] == {"invalid_json": 2, "invalid_utf8": 2, "missing_field": 1,
                              "not_a_string": 1, "not_an_object": 1, "null": 2}
    a = src / "a.jsonl"
    assert [m.split(": ")[0] for m in bad["examples"]] == [f"{a}:{n}" for n in (2, 3, 4, 5, 6)]
    assert bad["examples"][2].startswith(f"{a}:4: no field 'text' (fields: body)")
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("prepare: skipped 9 bad records (2 invalid_json, 2 invalid_utf8, "
                       "1 missing_field, 1 not_a_string, 1 not_an_object, 2 null); first: "
                       f"{a}:2, {a}:3, {a}:4, {a}:5, {a}:6")
    assert err[-2].startswith("prepare: 6 documents, 36 tokens")
    # manifest.json stays in the format older readers know.
    assert TokenCorpus(tmp_path / "out").manifest.documents == 6


def test_skip_bad_with_a_tokenizer_json_skips_text_that_is_not_utf8(tmp_path):
    tok = hf_tokenizer(tmp_path)
    (tmp_path / "a.txt").write_bytes(b"hello \xff")
    (tmp_path / "b.txt").write_text("the cat")
    manifest = prepare.prepare_corpus([tmp_path / "a.txt", tmp_path / "b.txt"],
                                      tmp_path / "out", tok, skip_bad=True, progress=False)
    assert TokenCorpus(tmp_path / "out")[0].tolist() == [3, 4, 5]
    assert manifest.skipped_bad["reasons"] == {"invalid_utf8": 1}
    (example,) = manifest.skipped_bad["examples"]
    assert example.startswith(f"{tmp_path}/a.txt:1: not valid UTF-8")


def test_skip_bad_with_nothing_good_left_is_an_error(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(lines("{", {"id": 1}))
    with pytest.raises(DataError, match=r"no documents found \(1 files, 0 empty documents, "
                                        r"2 bad records skipped\)"):
        prepare.prepare_corpus([tmp_path / "a.jsonl"], tmp_path / "out", BYTES,
                               skip_bad=True, progress=False)
    assert nothing_left(tmp_path, "a.jsonl")


def test_file_errors_stay_errors_with_skip_bad(tmp_path):
    write_parquet(tmp_path / "x.parquet", ["a"], column="body")
    with pytest.raises(DataError, match="no column 'text'"):
        prepare.prepare_corpus([tmp_path / "x.parquet"], tmp_path / "out", BYTES,
                               skip_bad=True, progress=False)
    assert nothing_left(tmp_path, "x.parquet")


def test_utf8_bom_and_crlf_lines(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "bom"}\r\n{"text": "crlf"}\r\n')
    prepare.prepare_corpus([tmp_path / "a.jsonl"], tmp_path / "out", BYTES, progress=False)
    assert documents(tmp_path / "out")[0] == [b"bom", b"crlf"]


@pytest.mark.slow
def test_cli_reads_the_formats_and_names_a_bad_file(tmp_path):
    write_parquet(tmp_path / "x.parquet", ["p0", "p1", "p2"])
    write_zst(tmp_path / "y.jsonl.zst", lines({"text": "z"}))
    result = cli("prepare", "--input", str(tmp_path / "x.parquet"),
                     str(tmp_path / "y.jsonl.zst"), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["documents"] == 4
    (tmp_path / "z.csv").write_text("a,b\n")
    bad = cli("prepare", "--input", str(tmp_path / "z.csv"), "--out", str(tmp_path / "o2"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith(f"europa-jax: error: {tmp_path}/z.csv: unsupported file type")
    assert not (tmp_path / "o2").exists()
