"""Tests for europa_jax.data.prepare and `europa-jax prepare`: inputs, streaming, bad input."""

import gzip
import json
import re
import tracemalloc

import numpy as np
import pytest

from europa_jax.data import prepare, tokenizer
from europa_jax.data.corpus import DataError, TokenCorpus
from conftest import cli
from test_tokenizer import make_tokenizer_json

BYTES = tokenizer.ByteTokenizer()


def documents(path):
    corpus = TokenCorpus(path, verify=True)
    return [bytes(corpus[i][:-1].astype(np.uint8)) for i in range(len(corpus))], corpus


@pytest.fixture
def inputs(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"bee\xff")  # not UTF-8: kept as bytes
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "c.md").write_text("gamma")
    (src / "empty.txt").write_text("")
    (src / ".hidden").write_text("skipped")
    (src / "docs.jsonl").write_text('{"text": "j1", "id": 1}\n\n{"text": "", "id": 2}\n'
                                    '{"text": "j3"}\n')
    with gzip.open(tmp_path / "more.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "zipped"}) + "\n")
    return src, tmp_path / "more.jsonl.gz"


def test_text_directories_and_jsonl(tmp_path, inputs):
    src, gz = inputs
    manifest = prepare.prepare_corpus([src], tmp_path / "out", BYTES, progress=False)
    docs, corpus = documents(tmp_path / "out")
    # Sorted walk, hidden entries skipped, empty documents skipped and counted.
    assert docs == [b"alpha", b"bee\xff", b"j1", b"j3", b"gamma"]
    assert manifest.skipped_empty == 2 and manifest.documents == 5
    assert corpus[0][-1] == tokenizer.BYTE_EOS_ID
    assert manifest.tokenizer == BYTES.info.to_json() and manifest.dtype == "uint16"
    # The gzipped file keeps its text under another field.
    prepare.prepare_corpus([gz], tmp_path / "gz", BYTES, text_field="body", progress=False)
    assert documents(tmp_path / "gz")[0] == [b"zipped"]


def test_huggingface_tokenizer_corpus(tmp_path):
    tok = tokenizer.load_tokenizer(str(make_tokenizer_json(tmp_path / "tokenizer.json")))
    (tmp_path / "in.jsonl").write_text('{"text": "hello world"}\n{"text": "the cat"}\n')
    manifest = prepare.prepare_corpus([tmp_path / "in.jsonl"], tmp_path / "out", tok,
                                      progress=False)
    corpus = TokenCorpus(tmp_path / "out")
    np.testing.assert_array_equal(corpus[0], [1, 2, 5])
    np.testing.assert_array_equal(corpus[1], [3, 4, 5])
    assert manifest.tokenizer["sha256"] == tok.info.sha256 and manifest.tokenizer["eos_id"] == 5


def test_streams_with_flat_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "_BATCH_BYTES", 1 << 20)
    line = json.dumps({"text": "x" * 20_000}) + "\n"
    (tmp_path / "big.jsonl").write_text(line * 600)  # 12 MB of text, 12M tokens
    tracemalloc.start()
    manifest = prepare.prepare_corpus([tmp_path / "big.jsonl"], tmp_path / "out", BYTES,
                                      progress=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert manifest.tokens == 600 * 20_001
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB: documents are being accumulated"


def test_progress_goes_to_stderr(tmp_path, inputs, capsys):
    prepare.prepare_corpus([inputs[0]], tmp_path / "out", BYTES)
    assert "prepare: 5 documents, 23 tokens" in capsys.readouterr().err


def nothing_left(parent, *keep):
    return sorted(p.name for p in parent.iterdir()) == sorted(keep)


def write(name, content):
    """Setup: write one input file (str or bytes) and return it as the input list."""
    def setup(d):
        path = d / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return [path]
    return setup


@pytest.mark.parametrize("setup, message", [
    (lambda d: [d / "missing.txt"], "--input {d}/missing.txt: no such file or directory"),
    (write("e.txt", ""), "--input {d}/e.txt: no documents found (1 files, 1 empty documents)"),
    (write("x.jsonl", '{"text": "a"}\n{"body": "b", "id": 3}\n'),
     "{d}/x.jsonl:2: no field 'text' (fields: body, id); choose one with --text-field"),
    (write("x.jsonl", '{"text": 5}\n'), "{d}/x.jsonl:1: field 'text' is int, expected a string"),
    (write("x.jsonl", '{"text": "a"}\n{oops\n'), "{d}/x.jsonl:2: not valid JSON"),
    (write("x.jsonl", '["text"]\n'), "{d}/x.jsonl:1: expected a JSON object, got list"),
    (write("t.jsonl.gz", gzip.compress(b'{"text": "abc"}\n' * 1000)[:40]),
     "{d}/t.jsonl.gz: truncated or corrupt gzip"),
])
def test_bad_input_is_one_line_error_and_leaves_nothing(tmp_path, setup, message):
    check_bad_input(tmp_path, setup, message)


def test_a_bad_record_names_the_way_past_it(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "x.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: not valid JSON .*\(or pass --skip-bad "
                                        r"to skip and count such records\)$"):
        prepare.prepare_corpus([src / "x.jsonl"], tmp_path / "out", BYTES, progress=False)


def check_bad_input(tmp_path, setup, message):
    """`prepare` on what `setup` writes fails with one line starting with `message` (its
    {d}: the input directory) and leaves no output, not even a temporary directory."""
    src = tmp_path / "in"
    src.mkdir()
    paths = setup(src)
    before = sorted(p.name for p in src.iterdir())
    with pytest.raises(DataError) as err:
        prepare.prepare_corpus(paths, tmp_path / "out", BYTES, progress=False)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(message.format(d=src)), str(err.value)
    assert nothing_left(tmp_path, "in")  # no output, no temporary directory
    assert sorted(p.name for p in src.iterdir()) == before


@pytest.mark.slow
def test_cli_prepare_and_its_errors(tmp_path, inputs):
    out = tmp_path / "out"
    result = cli("prepare", "--input", str(inputs[0]), "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["documents"] == 5 and summary["tokens"] == 23
    assert summary["tokenizer"]["kind"] == "bytes"
    before = (out / "manifest.json").read_bytes()
    again = cli("prepare", "--input", str(inputs[0]), "--out", str(out))
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert f"{out}: already exists" in again.stderr
    assert (out / "manifest.json").read_bytes() == before
    bad = cli("prepare", "--input", str(tmp_path / "nope"), "--out", str(tmp_path / "o2"))
    assert bad.returncode == 2
    assert bad.stderr == f"europa-jax: error: --input {tmp_path}/nope: no such file or directory\n"


def test_stdlib_sources_sorted_filtered_and_limited():
    paths = prepare.stdlib_sources()
    assert len(paths) > 100 and all(p.suffix == ".py" for p in paths)
    for p in paths:
        assert not {"site-packages", "dist-packages", "test", "tests"} & set(p.parts)
    root = prepare.stdlib_root()
    assert paths == sorted(paths, key=lambda p: p.relative_to(root).as_posix())
    assert prepare.stdlib_sources(3) == paths[:3]


def test_stdlib_corpus_is_prepared_once_through_prepare_corpus(tmp_path, monkeypatch):
    files = prepare.stdlib_sources()[:4]
    monkeypatch.setattr(prepare, "stdlib_sources", lambda: files)
    path = prepare.stdlib_corpus(tmp_path, progress=False)
    assert path.parent == tmp_path and path.name.startswith("stdlib-py")
    docs, corpus = documents(path)
    assert docs == [f.read_bytes() for f in files if f.read_bytes()]
    assert corpus.manifest.inputs == (f"stdlib:{prepare.stdlib_root()}",)
    stamp = (path / "manifest.json").stat().st_mtime_ns
    assert prepare.stdlib_corpus(tmp_path, progress=False) == path
    assert (path / "manifest.json").stat().st_mtime_ns == stamp  # cached, not rewritten


def test_stdlib_missing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}: no stdlib .py files found")):
        prepare.stdlib_sources()
