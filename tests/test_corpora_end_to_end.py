"""A fresh clone's data path end to end: prepare a .jsonl.zst and a .parquet file, train on a
70/30 mixture of them, export, load with transformers' Auto classes, sample from the run."""

import json

import pytest

import conftest
from conftest import config_path

WEB = ["The quick brown fox jumps over the lazy dog. " * (3 + i % 5) for i in range(60)]
CODE = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 4 for i in range(60)]


def cli(*args):
    done = conftest.cli(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_prepare_mix_train_export_load_and_sample(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    jsonl = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(WEB))
    (tmp_path / "web.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl.encode()))
    pq.write_table(pa.table({"content": CODE, "lang": ["py"] * len(CODE)}),
                   tmp_path / "code.parquet", row_group_size=16)
    web = json.loads(cli("prepare", "--input", str(tmp_path / "web.jsonl.zst"),
                         "--out", str(tmp_path / "web")).stdout)
    code = json.loads(cli("prepare", "--input", str(tmp_path / "code.parquet"),
                          "--text-field", "content", "--out", str(tmp_path / "code")).stdout)
    assert web["documents"] == len(WEB) and code["documents"] == len(CODE)

    run = tmp_path / "run"
    sources = (f"[{{path: {tmp_path / 'web'}, weight: 0.7}}, "
               f"{{path: {tmp_path / 'code'}, weight: 0.3}}]")
    sets = ["data.source=prepared", f"data.sources={sources}", "data.validation_fraction=0",
            "train.eval_every=0", "train.steps=3", "train.log_every=1",
            "checkpoint.every_steps=0", "execution.remat=none"]
    cli("train", config_path("tiny-cpu.yaml"), "--run-dir", str(run),
        *[a for s in sets for a in ("--set", s)])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # every batch holds 70/30 of the two sources' tokens
        assert r["source_token_fraction"] == pytest.approx([0.7, 0.3], abs=1e-3)
        assert len(r["source_epochs"]) == 2

    out = tmp_path / "hf"
    cli("export", str(run), "--out", str(out), "--dtype", "fp32")
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tok("def f", return_tensors="pt").input_ids
    assert ids.tolist() == [list(b"def f")]
    assert model(ids).logits.shape[-1] >= 257

    sampled = json.loads(cli("sample", str(run), "--prompt", "def f", "--max-new-tokens", "8",
                             "--json").stdout.splitlines()[-1])
    assert sampled["prompt_ids"] == list(b"def f") and 1 <= len(sampled["ids"]) <= 8
