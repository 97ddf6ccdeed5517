"""Every config mistake is a one-line ConfigError naming the key and value."""

import re
from pathlib import Path

import pytest

from europa_jax.config import check_device_count, Config, ConfigError
from europa_jax.config_loader import load_config
from conftest import config_path


def load(tmp_path, *overrides, base="tiny-cpu.yaml"):
    return load_config(config_path(base), list(overrides))


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "small-cpu.yaml", "europa-952b.yaml",
                                  "kimi-k2.yaml", "deepseek-v3.yaml"])
def test_shipped_configs_load(name):
    assert load_config(config_path(name)).model.n_layers > 0


ERRORS = [
    (["model.n_layer=3"], r"model\.n_layer: unknown key; did you mean 'model\.n_layers'\?"),
    (["modle.d_model=3"], r"modle: unknown key; did you mean 'model'\?"),
    (["model.d_model=abc"], r"model\.d_model: expected int, got 'abc'"),
    (["model.d_model=1.5"], r"model\.d_model: expected int, got 1\.5"),
    (["execution.scan_layers=3"], r"execution\.scan_layers: expected bool, got 3"),
    (["execution.compute_dtype=fp8"], r"execution\.compute_dtype: 'fp8' is not one of"),
    (["model.n_routed_experts=18", "model.n_group=1", "model.topk_group=1"],
     r"model\.n_routed_experts: 18 is not divisible by mesh\.expert=4"),
    (["model.top_k=17"], r"model\.top_k: 17 > model\.n_routed_experts=16"),
    (["model.n_group=3"], r"model\.n_group: 3 does not divide model\.n_routed_experts=16"),
    (["model.topk_group=5"], r"model\.topk_group: 5 > model\.n_group=4"),
    (["model.topk_group=1", "model.top_k=5"], r"model\.top_k: 5 > topk_group × experts per group"),
    (["data.seq_len=200"], r"data\.seq_len: 200 is not divisible by "
                           r"execution\.attention_block_size"),
    (["data.global_batch_size=12"], r"data\.global_batch_size: 12 is not divisible by the "
                                    r"mesh's 8 devices"),
    (["model.d_model=0"], r"model\.d_model: 0 must be positive"),
    (["model.n_dense_layers=5"], r"model\.n_dense_layers: 5 must be in \[0, model\.n_layers=3\]"),
    (["model.qk_rope_head_dim=7"], r"model\.qk_rope_head_dim: 7 must be even"),
    (["model.vocab_size=200"], r"model\.vocab_size: 200 < 257 needed by the byte-level"),
    (["data.seq_len=8192"], r"data\.seq_len: 8192 > model\.max_position_embeddings=4096"),
    (["optim.adam_b2=1.5"], r"optim\.adam_b2: 1\.5 must be in \[0, 1\]"),
    (["checkpoint.keep=0"], r"checkpoint\.keep: 0 must be positive"),
    (["checkpoint.every_steps=-1"], r"checkpoint\.every_steps: -1 must be >= 0"),
    (["checkpoint.nan_policy=ignore"], r"checkpoint\.nan_policy: 'ignore' is not one of: skip, stop"),
    (["optim.muon_ns_dtype=fp16"], r"optim\.muon_ns_dtype: 'fp16' is not one of: float32, bfloat16"),
    (["model.rope_scaling.type=ntk"], r"model\.rope_scaling\.type: 'ntk' is not one of"),
    (["mesh.data=0"], r"mesh\.data: 0 must be positive"),
    (["train.steps"], r"--set 'train\.steps': expected KEY=VALUE"),
    (["data.source=web"], r"data\.source: 'web' is not one of: stdlib"),
    (["execution.layer_input_format=e4m3"], r"execution\.layer_input_format: e4m3 makes the "
     r"kept layer inputs smaller, but offload\.activations=none keeps none"),
    (["execution.layer_input_format=fp8"], r"execution\.layer_input_format: 'fp8' is not one "
     r"of: compute_dtype, e4m3"),
    (["execution.moe_buffer_factor=0"], r"execution\.moe_buffer_factor: 0\.0 must be positive"),
]


@pytest.mark.parametrize("overrides,message", ERRORS)
def test_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load(tmp_path, *overrides)
    assert "\n" not in str(info.value)
    assert "tiny-cpu.yaml" in str(info.value) or overrides == ["train.steps"]
    # the --set that set the key the error names, not the file, is blamed
    assert any(str(info.value).startswith(f"--set {item} (on ") for item in overrides) or \
        overrides == ["train.steps"], str(info.value)


def test_a_key_the_file_sets_is_blamed_on_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(config_path("tiny-cpu.yaml")).read_text()
                   .replace("\n  steps:", "\n  stepz:", 1))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: train\.stepz: unknown "
                                          r"key; did you mean 'train\.steps'\?$"):
        load_config(bad, ["optim.learning_rate=1e-3"])


def test_mesh_must_match_device_count():
    cfg = load_config(config_path("tiny-cpu.yaml"))
    check_device_count(cfg.mesh, 8)
    with pytest.raises(ConfigError, match=r"mesh: data×expert = 2×4 = 8 but the job has 4"):
        check_device_count(cfg.mesh, 4)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    missing = tmp_path / "missing.yaml"
    missing.write_text("model: {d_model: 8}\n")
    with pytest.raises(ConfigError, match=r"model\.vocab_size: required key is missing"):
        load_config(missing)


def test_overrides_apply_and_parse_numbers():
    cfg = load_config(config_path("tiny-cpu.yaml"), ["optim.learning_rate=1e-4",
                                                     "model.rope_scaling.factor=8"])
    assert cfg.optim.learning_rate == 1e-4 and cfg.model.rope_scaling.factor == 8.0


def old_layout(raw: dict) -> dict:
    """A config dict as a run saved it before `execution:` existed: its keys under `model`."""
    return {**{k: v for k, v in raw.items() if k != "execution"},
            "model": {**raw["model"], **raw["execution"]}}


def test_a_key_that_moved_is_refused_naming_its_new_key(tmp_path):
    from europa_jax.config_loader import MOVED

    assert MOVED["model.remat"] == "execution.remat" and len(MOVED) == 17
    old = tmp_path / "old.yaml"
    old.write_text(Path(config_path("tiny-cpu.yaml")).read_text()
                   .replace("\nexecution:\n", "\n", 1))  # its keys left under model:
    with pytest.raises(ConfigError) as info:
        load_config(old)
    assert re.fullmatch(rf"{re.escape(str(old))}: model\.\w+ moved to execution\.\w+",
                        str(info.value)), str(info.value)
    with pytest.raises(ConfigError, match=r"^--set model\.remat=none \(on .*tiny-cpu\.yaml\): "
                                          r"model\.remat moved to execution\.remat$"):
        load_config(config_path("tiny-cpu.yaml"), ["model.remat=none"])
    cfg = load_config(config_path("tiny-cpu.yaml"), ["execution.remat=none"])
    assert cfg.execution.remat == "none"


@pytest.mark.slow
def test_the_cli_refuses_a_moved_key_and_writes_nothing(tmp_path):
    import subprocess
    import sys

    from conftest import REPO
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "europa_jax.cli", "train",
                           config_path("tiny-cpu.yaml"), "--run-dir", str(run_dir),
                           "--set", "model.scan_layers=false"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "model.scan_layers moved to execution.scan_layers" in done.stderr
    assert len([line for line in done.stderr.splitlines() if "moved to" in line]) == 1
    assert not run_dir.exists()


def test_a_saved_config_of_the_old_layout_moves_its_keys():
    """A checkpoint saved before the move reads in this layout; a user's file does not."""
    from europa_jax.config_loader import from_dict, saved_config, to_dict

    cfg = load_config(config_path("tiny-cpu.yaml"), ["execution.remat=none",
                                                     "execution.moe_chunk_tokens=64"])
    now = to_dict(cfg)
    before = old_layout(now)
    assert "remat" in before["model"] and "execution" not in before
    assert saved_config(before) == now
    assert from_dict(Config, saved_config(before)) == cfg
    assert "remat" in before["model"]  # the saved dict itself is left as it was
    assert saved_config(now) == now  # this version's layout passes unchanged
    with pytest.raises(ConfigError, match=r"model\.\w+ moved to execution\.\w+"):
        from_dict(Config, before)


def test_a_checkpoints_metadata_reads_in_this_layout(tmp_path):
    import json

    from europa_jax.config_loader import to_dict
    from europa_jax.store import resume_changes, saved_checkpoints

    cfg = load_config(config_path("tiny-cpu.yaml"))
    step_dir = tmp_path / "checkpoints" / "3"
    (step_dir / "meta").mkdir(parents=True)
    (step_dir / "meta" / "metadata").write_text(json.dumps(
        {"step": 3, "config": old_layout(to_dict(cfg)), "fingerprint": {}}))
    meta = saved_checkpoints.read_meta(step_dir)
    assert meta["config"] == json.loads(json.dumps(to_dict(cfg))) and meta["step"] == 3
    assert resume_changes.describe(meta["config"], cfg, 3) == []  # nothing changed
