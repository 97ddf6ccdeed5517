"""Export to / import from the Hugging Face DeepseekV3 layout: logits parity with
transformers, exact round trip, file layout, and refusals that write nothing (a broken
weights directory named tensor by tensor, a run directory in use)."""

import json
import os
import shutil
import stat

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch  # the test extra: an independent DeepseekV3 to compare logits with
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file

from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.interop import hf_import
from europa_jax.interop.export import export
from europa_jax.model.transformer import Transformer
from europa_jax.store import checkpoint
from europa_jax.job import exit_codes
from conftest import (cli, config_path, nested_params, rows_with_documents, saved_state,
                      split_padding, train_in_process)

# tiny-cpu as shipped (YaRN, group-limited routing, shared expert), a few steps.
TRAIN = ["train.steps=3", "train.eval_every=0", "checkpoint.every_steps=0", "data.max_documents=40",
         "execution.remat=none"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return run_dir, train_in_process(run_dir, TRAIN)


@pytest.fixture(scope="module")
def exported_fp32(trained, tmp_path_factory):
    run_dir, _ = trained
    out = tmp_path_factory.mktemp("hf") / "fp32"
    export(run_dir, out, dtype="fp32", max_shard_bytes=400_000)
    return out


def test_every_exported_file_has_the_mode_the_umask_gives(exported_fp32):
    """Weights included (safetensors writes them 0600): a shared cluster's teammates and
    serving jobs read them as they read the config."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in exported_fp32.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert modes == {name: 0o666 & ~umask for name in modes}


def test_exported_model_matches_transformers_logits_per_document(trained, exported_fp32):
    run_dir, cfg = trained
    state = saved_state(run_dir)
    model, loading = transformers.DeepseekV3ForCausalLM.from_pretrained(
        exported_fp32, dtype=torch.float32, output_loading_info=True)
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched keys
    model.eval()
    batch = rows_with_documents(cfg)
    ours_BSV, _ = Transformer(cfg.model, cfg.execution).apply(
        {"params": nested_params(state)}, batch["tokens"], batch["segment_ids"],
        batch["positions"], jnp.asarray(state["router_bias_LE"]))
    ours_BSV = np.asarray(ours_BSV)[..., :cfg.model.vocab_size]
    worst, documents = 0.0, 0
    for b in range(ours_BSV.shape[0]):
        segments = batch["segment_ids"][b]
        for seg in np.unique(segments):
            cols = np.flatnonzero(segments == seg)
            tokens = torch.tensor(batch["tokens"][b, cols][None].astype(np.int64))
            with torch.no_grad():  # HF has no document mask: one document per call
                theirs = model(tokens).logits[0].numpy()
            ours = ours_BSV[b, cols]
            worst = max(worst, float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))))
            documents += 1
    print(f"max relative logits error over {documents} documents: {worst:.2e}")
    assert documents >= 4
    assert worst <= 1e-4


@pytest.mark.slow
def test_import_of_export_is_exact(trained, exported_fp32, tmp_path):
    run_dir, cfg = trained
    imported = tmp_path / "imported"
    result = cli("import", str(exported_fp32), "--config", config_path("tiny-cpu.yaml"),
                 *[a for item in TRAIN for a in ("--set", item)], "--out", str(imported))
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint.committed_steps(imported) == [0]
    original, back = saved_state(run_dir), saved_state(imported)
    assert original.keys() == back.keys()
    v = cfg.model.vocab_size
    for key in original:
        a, b = original[key], back[key]
        if key == "params.embedding":  # padding rows exist only to divide the mesh
            a, b, pad = a[:v], b[:v], back[key][v:]
        elif key == "params.lm_head":
            a, b, pad = a[:, :v], b[:, :v], back[key][:, v:]
        else:
            pad = np.zeros(0)
        np.testing.assert_array_equal(b, a, err_msg=key)
        assert not np.any(pad), key
    # Training resumes from the imported weights by itself.
    sets = [a for item in TRAIN + ["train.steps=1"] for a in ("--set", item)]
    result = cli("train", config_path("tiny-cpu.yaml"), "--run-dir", str(imported), *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint_restored step=0" in result.stderr


@pytest.mark.slow
def test_padded_storage_imports_and_exports_the_same_weights(trained, exported_fp32, tmp_path):
    """execution.param_pad_multiple stores some weights zero-padded (sharding.storage_shape):
    an import pads them, an export drops the padding — the HF files are bitwise the same."""
    run_dir, cfg = trained
    sets = [a for item in TRAIN + ["execution.param_pad_multiple=3"] for a in ("--set", item)]
    imported = tmp_path / "padded"
    result = cli("import", str(exported_fp32), "--config", config_path("tiny-cpu.yaml"), *sets,
                 "--out", str(imported))
    assert result.returncode == 0, result.stderr[-3000:]
    original, padded = saved_state(run_dir), saved_state(imported)
    n_padded = 0
    for key, a in original.items():
        b = padded[key]
        if b.shape != a.shape:
            n_padded += 1
            used, padding = split_padding(b, a.shape)
            np.testing.assert_array_equal(used, a, err_msg=key)
            assert not np.any(padding), key  # the padding is zeros
    assert n_padded >= 5
    again = tmp_path / "again"
    export(imported, again, dtype="fp32", max_shard_bytes=400_000)
    for name in sorted(p.name for p in exported_fp32.glob("*.safetensors")):
        with safe_open(exported_fp32 / name, "np") as first, \
                safe_open(again / name, "np") as second:
            assert set(first.keys()) == set(second.keys())
            for key in first.keys():
                np.testing.assert_array_equal(second.get_tensor(key), first.get_tensor(key))


def test_bf16_export_layout(trained, tmp_path):
    run_dir, cfg = trained
    out = tmp_path / "bf16"
    summary = export(run_dir, out, max_shard_bytes=300_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted({*index["weight_map"].values(), "config.json",
                            "model.safetensors.index.json", "generation_config.json",
                            "tokenizer.json", "tokenizer_config.json",
                            "special_tokens_map.json"})  # safetensors only: no pickle
    assert summary["files"] > 3 and summary["step"] == 3
    names = set(index["weight_map"])
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in names
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names and "lm_head.weight" in names
    total = 0
    for name in set(index["weight_map"].values()):
        assert (out / name).stat().st_size <= 300_000 + 20_000  # data bound + header
        with safe_open(out / name, framework="numpy") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                total += t.nbytes
                want = np.float32 if key.endswith(("gate.weight", "e_score_correction_bias")) \
                    else ml_dtypes.bfloat16
                assert t.dtype == want, key
                if key == "model.embed_tokens.weight":
                    assert t.shape == (cfg.model.vocab_size, cfg.model.d_model)
    assert total == index["metadata"]["total_size"]
    config = json.loads((out / "config.json").read_text())
    assert config["first_k_dense_replace"] == 1 and config["torch_dtype"] == "bfloat16"
    assert config["rope_scaling"]["type"] == "yarn" and config["rope_scaling"]["factor"] == 4.0


@pytest.mark.slow
def test_export_refuses_a_non_empty_target_and_a_corrupted_checkpoint(trained, tmp_path):
    run_dir, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = cli("export", str(run_dir), "--out", str(out))
    assert result.returncode == exit_codes.BAD_INPUT
    assert result.stderr.strip().count("\n") == 0 and "not empty" in result.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir, damaged)
    meta_path = checkpoint.checkpoint_dir(damaged) / "3" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["fingerprint"]["params.lm_head"] ^= 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match="params.lm_head does not match"):
        export(damaged, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert not list(tmp_path.glob(".never.tmp-*"))


def test_import_names_a_config_mismatch_and_writes_nothing(trained, exported_fp32, tmp_path):
    _, cfg = trained
    hf = tmp_path / "hf"
    shutil.copytree(exported_fp32, hf)
    config = json.loads((hf / "config.json").read_text())
    config["moe_intermediate_size"] = 32
    (hf / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"moe_intermediate_size=32 but the config has "
                                          r"model\.expert_ffn_dim=64"):
        hf_import.import_hf(hf, cfg, out)
    assert not out.exists()


def rewrite_shard(hf, name, change):
    """Rewrite the shard file holding tensor `name` with `change(tensors)` applied; its path."""
    index = json.loads((hf / hf_import.INDEX).read_text())
    path = hf / index["weight_map"][name]
    with safe_open(path, framework="numpy") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


KV_NORM = "model.layers.1.self_attn.kv_a_layernorm.weight"
EXTRA = "model.layers.1.self_attn.extra_proj.weight"


def damage(hf, kind):
    """One kind of broken HF directory (config.json intact); the one line import must print."""
    if kind == "missing_from_shard":  # still listed in the index
        path = rewrite_shard(hf, KV_NORM, lambda t: t.pop(KV_NORM))
        return f"{path}: {KV_NORM} is listed in {hf_import.INDEX} but not in the file"
    if kind == "wrong_shape":
        path = rewrite_shard(hf, KV_NORM, lambda t: t.update({KV_NORM: t[KV_NORM][:-1]}))
        n = load_config(config_path("tiny-cpu.yaml")).model.kv_lora_rank
        return f"{path}: {KV_NORM} has shape [{n - 1}], the config implies [{n}]"
    if kind == "wrong_dtype":
        path = rewrite_shard(hf, KV_NORM, lambda t: t.update({KV_NORM: t[KV_NORM].astype(
            np.int32)}))
        return f"{path}: {KV_NORM} is I32, expected a float (F32, BF16, F16, F64)"
    if kind == "narrower_than_declared":  # a float32 export with a tensor converted to f16
        path = rewrite_shard(hf, KV_NORM, lambda t: t.update({KV_NORM: t[KV_NORM].astype(
            np.float16)}))
        return (f"{path}: {KV_NORM} is F16 but config.json declares torch_dtype float32: "
                "converted after the export, it may have lost values; convert the files back "
                "(or correct torch_dtype)")
    assert kind == "unexpected"  # in a shard and in the index
    path = rewrite_shard(hf, KV_NORM, lambda t: t.update({EXTRA: np.ones((4, 4), np.float32)}))
    index = json.loads((hf / hf_import.INDEX).read_text())
    index["weight_map"][EXTRA] = path.name
    (hf / hf_import.INDEX).write_text(json.dumps(index))
    return f"{path}: {EXTRA} is not a tensor of this config"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["missing_from_shard", "wrong_shape", "wrong_dtype",
                                  "narrower_than_declared", "unexpected"])
def test_import_checks_every_tensor_against_its_file_in_one_line_each(exported_fp32, tmp_path,
                                                                       kind):
    hf = tmp_path / "hf"
    shutil.copytree(exported_fp32, hf)
    line = damage(hf, kind)
    out = tmp_path / "run"
    result = cli("import", str(hf), "--config", config_path("tiny-cpu.yaml"),
                 *[a for item in TRAIN for a in ("--set", item)], "--out", str(out))
    assert result.returncode == exit_codes.BAD_INPUT, result.stderr[-3000:]
    errors = [x for x in result.stderr.splitlines() if x.startswith("europa-jax")]
    assert errors == [f"europa-jax: error: {line}"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not out.exists()  # nothing written, not even the run directory's lock


@pytest.mark.slow
def test_import_and_export_refuse_a_run_directory_in_use(trained, exported_fp32, tmp_path):
    from test_run_lock import start_holder

    run_dir, _ = trained
    busy = tmp_path / "busy"
    holder = start_holder(busy)  # a train going on there
    try:
        (busy / "metrics.jsonl").write_text("{}\n")
        sets = [a for item in TRAIN for a in ("--set", item)]
        for args in (["import", str(exported_fp32), "--config", config_path("tiny-cpu.yaml"),
                      *sets, "--out", str(busy), "--overwrite"],
                     ["export", str(run_dir), "--out", str(busy), "--overwrite"]):
            result = cli(*args)
            assert result.returncode == exit_codes.BAD_INPUT, result.stderr[-3000:]
            errors = [x for x in result.stderr.splitlines() if x.startswith("europa-jax")]
            assert len(errors) == 1 and f"{busy}: in use by `europa-jax train`" in errors[0] \
                and f"pid {holder.pid}" in errors[0], result.stderr[-3000:]
            assert sorted(p.name for p in busy.iterdir()) == ["metrics.jsonl", "run.lock"]
    finally:
        holder.kill()
        holder.wait()
