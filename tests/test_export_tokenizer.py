"""Export carries the run's tokenizer: AutoTokenizer and AutoModelForCausalLM load from the
one folder and encode texts to the ids the run trained on (byte level and tokenizer.json);
a tokenizer file that is gone or changed fails the export and leaves nothing."""

import json
import logging
import shutil
import sys

import pytest
import transformers

from europa_jax.data import prepare
from europa_jax.data.corpus import DataError
from europa_jax.data.tokenizer import BYTE_EOS_ID, ByteTokenizer, HuggingFaceTokenizer
from europa_jax.interop.export import export
from europa_jax.store import checkpoint
from europa_jax.job import exit_codes
from conftest import cli, train_in_process

# tiny-cpu (YaRN, group-limited routing, shared expert) at conftest.tiny_cfg's dimensions
TINY = ["model.d_model=32", "model.q_lora_rank=16", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
        "model.dense_ffn_dim=64", "model.expert_ffn_dim=16", "execution.attention_block_size=16",
        "execution.remat=none", "data.seq_len=64", "data.global_batch_size=8",
        "data.max_documents=40", "data.validation_fraction=0", "train.eval_every=0",
        "checkpoint.every_steps=0"]
# enough steps that greedy continuations differ by prompt (at 20 steps every one is spaces)
BYTE_RUN = TINY + ["train.steps=100", "optim.warmup_steps=5", "optim.learning_rate=0.01",
                   "train.log_every=20"]
TEXT = "Grüße aus Köln — 世界, naïve café 🎉\n\tdef f(x): return x ** 2  # <|endoftext|> ok"
SPECIALS = ["<|begin|>", "<|endoftext|>"]  # ids 0 and 1 of the test tokenizer
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


def train_run(run_dir, sets):
    train_in_process(run_dir, sets)


def cached(tmp_path_factory, name, build):
    """A directory built once per test session (test_sample.py shares these runs)."""
    root = tmp_path_factory.getbasetemp() / f"shared-{name}"
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        build(root)
        (root / "done").write_text("")
    return root


def byte_level_run(tmp_path_factory):
    """A tiny byte-level (stdlib corpus) run trained 100 steps: its run directory."""
    return cached(tmp_path_factory, "byte-run", lambda root: train_run(root / "run", BYTE_RUN)
                  ) / "run"


def build_tokenizer(path, texts):
    """A small byte-level BPE tokenizer.json (320 ids) with a tokenizer_config.json beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    path.with_name("tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1]}))


def huggingface_run(tmp_path_factory):
    """A tiny run on a corpus prepared with a tokenizer.json: (run dir, tokenizer path, corpus)."""
    def build(root):
        sources = prepare.stdlib_sources(40)
        tok_path = root / "tok" / "tokenizer.json"
        tok_path.parent.mkdir()
        build_tokenizer(tok_path, [p.read_text(errors="replace") for p in sources])
        prepare.prepare_corpus(sources, root / "corpus", HuggingFaceTokenizer(tok_path),
                               progress=False)
        train_run(root / "run", TINY + [
            "train.steps=2", "data.source=prepared", f"data.path={root / 'corpus'}",
            f"data.tokenizer={tok_path}", "model.vocab_size=320"])

    root = cached(tmp_path_factory, "hf-run", build)
    return root / "run", root / "tok" / "tokenizer.json", root / "corpus"


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    return byte_level_run(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    return huggingface_run(tmp_path_factory)


def test_byte_level_export_loads_with_auto_classes_and_encodes_like_bytetokenizer(
        byte_run, tmp_path):
    out = tmp_path / "hf"
    summary = export(byte_run, out, dtype="fp32")
    assert summary["tokenizer"] == "bytes"
    assert TOKENIZER_FILES | {"generation_config.json"} <= {p.name for p in out.iterdir()}
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = ByteTokenizer()
    for text in (TEXT, "", " leading and trailing  ", "\x00\x01\x7f ÿ", "a" * 1000):
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text) == list(text.encode()), text
        assert tok.decode(ids) == text
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == BYTE_EOS_ID
    assert tok.decode(ours.encode(TEXT) + [BYTE_EOS_ID], skip_special_tokens=True) == TEXT
    assert tok.model_max_length == 4096  # model.max_position_embeddings
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == BYTE_EOS_ID and not generation["do_sample"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.generation_config.eos_token_id == BYTE_EOS_ID
    assert model.config.eos_token_id == BYTE_EOS_ID


def test_byte_level_export_without_tokenizers_writes_the_model_and_warns(
        byte_run, tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` fails
    out = tmp_path / "hf"
    with caplog.at_level(logging.WARNING):
        summary = export(byte_run, out, dtype="fp32")
    names = {p.name for p in out.iterdir()}
    assert summary["tokenizer"] is None and not names & TOKENIZER_FILES
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= names
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "pip install 'tokenizers>=0.20'" in warnings[0]
    assert "export again with --overwrite" in warnings[0]
    assert "\n" not in warnings[0]


def test_tokenizer_json_export_matches_the_run_tokenizer(hf_run, tmp_path):
    run_dir, tok_path, corpus = hf_run
    manifest = json.loads((corpus / "manifest.json").read_text())["tokenizer"]
    out = tmp_path / "hf"
    assert export(run_dir, out, dtype="fp32")["tokenizer"] == "huggingface"
    assert (out / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = HuggingFaceTokenizer(tok_path)
    for text in (TEXT, "import os\nprint(os.getcwd())\n", "ünïcödé"):
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text), text
        assert ids == ours.encode_batch([text])[0][:-1].tolist()  # as prepare made them
        assert tok.decode(ids) == text
    assert max(tok(TEXT)["input_ids"]) < 320 and len(tok(TEXT)["input_ids"]) < len(TEXT.encode())
    eos = manifest["eos_id"]
    assert (tok.eos_token, tok.eos_token_id) == (SPECIALS[1], eos)
    assert (tok.bos_token, tok.bos_token_id) == (SPECIALS[0], 0)
    generation = json.loads((out / "generation_config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == eos == 1
    assert generation["bos_token_id"] == config["bos_token_id"] == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == eos


@pytest.mark.slow
def test_a_missing_or_changed_tokenizer_fails_the_export_and_writes_nothing(hf_run, tmp_path):
    run_dir, tok_path, _ = hf_run
    original = tok_path.read_bytes()
    out = tmp_path / "never"
    try:
        tok_path.unlink()
        with pytest.raises(DataError, match=f"{tok_path}: the run's tokenizer .* is gone"):
            export(run_dir, out)
        assert not out.exists() and not list(tmp_path.glob(".never*"))
        result = cli("export", str(run_dir), "--out", str(out))
        assert result.returncode == exit_codes.BAD_INPUT
        assert result.stderr.strip().count("\n") == 0 and str(tok_path) in result.stderr
        tok_path.write_bytes(original.replace(b"<|begin|>", b"<|start|>"))
        with pytest.raises(DataError, match=f"{tok_path}: sha256 .* differs from the corpus "
                                            "manifest's"):
            export(run_dir, out)
        assert not out.exists() and not list(tmp_path.glob(".never*"))
    finally:
        tok_path.write_bytes(original)
    # the file can also be named explicitly (it moved); it is checked all the same
    moved = tmp_path / "moved" / "tokenizer.json"
    moved.parent.mkdir()
    shutil.copy(tok_path, moved)
    assert export(run_dir, tmp_path / "ok", tokenizer=moved)["tokenizer"] == "huggingface"
    assert checkpoint.committed_steps(run_dir) == [2]
