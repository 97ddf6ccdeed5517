"""`europa-jax plan --target cpu` (the XLA:CPU program): exact state bytes, depth
extrapolation, offload accounting, the roofline arithmetic and its error messages. The GPU
target is tests/test_gpu_target.py's."""

import dataclasses
import json
import math
import os

import jax
import pytest

from europa_jax.parallel import offload, sharding
from europa_jax.plan.price import hardware
from europa_jax.plan import plan
from europa_jax.plan.program import step_compile
from europa_jax.train import train
from conftest import REPO, cli, config_path

# conftest's test-size tiny model as command-line overrides (the plan runs in its own process)
TEST_SIZE = {"model.d_model": 32, "model.q_lora_rank": 16, "model.kv_lora_rank": 16,
             "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 8,
             "model.dense_ffn_dim": 64, "model.expert_ffn_dim": 16,
             "execution.attention_block_size": 16, "data.seq_len": 64, "data.global_batch_size": 8}


def run_plan(*args, timeout=900):
    return cli("plan", *args, timeout=timeout, env={**os.environ, "PYTHONPATH": REPO})


def plan_json(config, overrides, *extra):
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    result = run_plan(config_path(config), "--devices", "8", "--json", "--target", "cpu", *sets,
                      *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_plan_state_bytes_equal_the_live_shards(tiny_cfg):
    """The plan's state bytes (from shardings alone) are what a real run holds per device.
    (How the whole step's memory compares with a GPU's is tests/test_gpu_target.py's.)"""
    cfg = dataclasses.replace(tiny_cfg, offload=dataclasses.replace(tiny_cfg.offload,
                                                                    optimizer_state=True))
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    held = offload.state_bytes(trainer.abstract_state)
    state = train.init_state(trainer, seed=0)
    for name, tree in (("params", state.params), ("optimizer_state", state.opt_state),
                       ("other_state", (state.step, state.router_bias_LE))):
        live: dict[str, int] = {}
        for leaf in jax.tree.leaves(tree):
            kind = leaf.sharding.memory_kind or "device"
            live[kind] = live.get(kind, 0) + leaf.addressable_shards[0].data.nbytes
        assert held[name] == live, name
    assert held["optimizer_state"]["pinned_host"] > 0


@pytest.mark.slow
def test_depth_extrapolation_matches_the_full_compile_within_5_percent():
    """4 and 6 MoE layers (plan.PROBE_MOE_LAYERS) extrapolated to 10 against compiling
    all 10, with state and activations offloaded so host bytes are extrapolated too."""
    overrides = {**TEST_SIZE, "model.n_layers": 11, "offload.optimizer_state": "true",
                 "offload.activations": "offload_layer_inputs"}
    full = plan_json("tiny-cpu.yaml", overrides)
    probed = plan_json("tiny-cpu.yaml", overrides, "--probe-moe-layers", "4,6")
    assert probed["compiled"]["probe_moe_layers"] == [4, 6]
    assert full["compiled"]["mode"] == "full depth"

    def numbers(r):
        m, f = r["memory"], r["flops"]
        out = {"step_device": m["step"]["device_total"], "step_temp": m["step"]["xla_cpu"]["temp"],
               "fb_device": m["forward_backward"]["device_total"],
               "update_device": m["update"]["device_total"],
               "host_total": m["host_total"], "activations": m["activations_offloaded"],
               "hlo_matmul": f["hlo_matmul_loss"], "optimizer_flops": f["optimizer"]}
        for key in ("step", "partitioner"):
            out[f"{key}_bytes"] = sum(row["bytes_per_device"] for row in r["collectives"]
                                      if row["source"] == key)
        return out

    want, got = numbers(full), numbers(probed)
    assert want["activations"] > 0 and want["host_total"] > want["activations"]
    errors = {k: abs(got[k] / want[k] - 1) for k in want}
    print("extrapolated vs full compile, relative error:", {k: f"{v:.4f}" for k, v in
                                                             errors.items()})
    assert max(errors.values()) < 0.05, errors
    # Muon's update is a step function of depth (zero-matrix padding: on this mesh a
    # 10-layer attention stack holds 2 matrices per device, 4 and 6 layers 1), so the plan
    # compiles it alone at full depth: exact, not extrapolated.
    for key in ("update_device", "optimizer_flops"):
        assert got[key] == want[key], key


def test_offloaded_activations_are_counted_from_the_step(tiny_cfg):
    """offload_layer_inputs sends one [B_local, S, D] input per layer to the host."""
    cfg = dataclasses.replace(tiny_cfg, offload=dataclasses.replace(
        tiny_cfg.offload, activations="offload_layer_inputs"))
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    state, batch = trainer.abstract_state, train.abstract_batch(trainer)
    with jax.set_mesh(trainer.mesh):
        jaxpr = train.jit_train_step(trainer).trace(state, batch).jaxpr.jaxpr
    rows = cfg.data.global_batch_size // cfg.mesh.n_devices
    per_layer = rows * cfg.data.seq_len * cfg.model.d_model * 4  # float32 compute in tiny
    assert step_compile.offloaded_activation_bytes(jaxpr) == cfg.model.n_layers * per_layer

    plain = train.build_trainer(tiny_cfg, trainer.mesh)
    with jax.set_mesh(plain.mesh):
        jaxpr = train.jit_train_step(plain).trace(plain.abstract_state, batch).jaxpr.jaxpr
    assert step_compile.offloaded_activation_bytes(jaxpr) == 0


def test_state_bytes_follow_shardings_and_memory_kinds(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, offload=dataclasses.replace(tiny_cfg.offload,
                                                                    optimizer_state=True))
    mesh = sharding.make_mesh(cfg.mesh)
    state = train.build_trainer(cfg, mesh).abstract_state
    held = offload.state_bytes(state)
    assert held["optimizer_state"]["pinned_host"] > 0
    assert held["optimizer_state"].get("device", 0) < 64  # only scalars stay on device
    assert set(held["params"]) == {"device"}
    # one device's shard of w_up [L, E, D, F] is E/4 × F/2 of it (expert × data)
    w_up = state.params["moe_layers"]["moe"]["w_up"]
    assert offload.per_device_bytes(w_up) == math.prod(w_up.shape) * 4 // 8
    # norm scales are replicated by the rules ('norm' → no mesh axis); each copy is counted
    copied = {row["name"]: row for row in plan.replicated_params(state, mesh)}
    assert copied["scale"]["over"] == "data+expert" and copied["scale"]["bytes"] > 0
    assert "w_up" not in copied


def test_extrapolate_reads_each_number_off_its_line():
    at_2, at_3 = {"temp": 10.0, "flops": 4.0}, {"temp": 13.0, "flops": 4.0, "new": 1.0}
    assert step_compile.extrapolate(at_2, at_3, 2, 3, 59) == {"temp": 181.0, "flops": 4.0, "new": 57.0}


def test_nvlink_bandwidth_counts_the_peers_of_a_quad():
    gh = hardware.GH200_JUPITER
    assert gh.nvlink_bandwidth(3) == 3 * gh.nvlink_pair_bandwidth  # all peers of a quad
    assert gh.nvlink_bandwidth(7) == 3 * gh.nvlink_pair_bandwidth


def test_compile_only_flags_replace_a_forced_device_count():
    flags = plan.compile_only_xla_flags("--xla_force_host_platform_device_count=8 --xla_foo=1")
    assert "device_count" not in flags and "--xla_foo=1" in flags
    assert "--xla_backend_optimization_level=0" in flags


@pytest.mark.slow
def test_devices_that_do_not_match_the_mesh_are_a_one_line_error():
    result = run_plan(config_path("europa-952b.yaml"), "--devices", "8", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--devices 8 does not match mesh data×expert = 96×4 = 384" in result.stderr


@pytest.mark.slow
def test_bad_probe_depths_are_a_one_line_error():
    result = run_plan(config_path("tiny-cpu.yaml"), "--devices", "8", "--probe-moe-layers", "3",
                      timeout=120)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "--probe-moe-layers '3'" in result.stderr


@pytest.mark.slow
def test_a_corpus_that_is_not_one_is_a_one_line_error(tmp_path):
    result = run_plan(config_path("tiny-cpu.yaml"), "--devices", "8", "--corpus",
                      str(tmp_path), timeout=120)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert f"--corpus {tmp_path}: no manifest.json there" in result.stderr


def test_the_text_report_shows_bytes_in_the_unit_that_shows_them():
    """A 1T model's step in TB, a tiny one's in MB or kB — not 0.00 TB."""
    from europa_jax.plan import report_text

    assert [report_text.scaled(x) for x in (30.28e12, 4.7e9, 51.5e6, 2_400, 0)] == [
        "30.28 TB", "4.70 GB", "51.50 MB", "2.40 kB", "0.00 kB"]
    traffic = {"bytes_per_step": 3.2e6, "data_dependent_bytes_per_step": 0.0,
               "moe_loop_bytes_per_step": 1.1e6, "by_region": {"moe": 2.0e6, "attention": 1.2e6},
               "data_dependent_by_region": {}, "largest": [
                   {"bytes_per_step": 5e5, "bytes_per_run": 2.5e5, "runs": 2,
                    "kind": "fusion:loop", "source": "…/moe/scatter-add"}]}
    text = "\n".join(report_text._hbm_traffic(traffic))
    assert "3.20 MB, + 0.00 kB" in text and "2.00 MB" in text and "0.00 TB" not in text
    assert "500.00 kB = 250.00 kB × 2" in text
    # seconds likewise, and nothing as 0.00 GB
    assert [report_text._s(x) for x in (62.3, 0.0177, 3.2e-5, 0)] == [
        "62.30 s", "17.70 ms", "32.00 µs", "0.00 s"]
    assert report_text.size(0) == "0 B"
    row = {"op": "all-gather", "axes": "data", "dtype": "f32", "count": 4,
           "bytes_per_device": 1.3e6, "infiniband_bytes": 0.0, "link": "infiniband",
           "seconds": 5e-5}
    (line,) = report_text._collectives([row], "collectives")[2:]
    assert "1.30 MB" in line and "50.00 µs" in line and " 0.00 " not in line


def test_the_text_opens_with_five_lines_and_the_whole_report_renders_from_the_stored_plan():
    """`plan` without --verbose: fits, HBM, host, step, tokens/s/GPU, read from the stored
    europa-952b plan (the one the README's headline is checked against)."""
    from pathlib import Path

    from europa_jax.plan import report_text

    r = json.loads((Path(__file__).parent / "data" / "europa-952b-plan-long-tail.json"
                    ).read_text())
    lines = report_text.format_summary(r).splitlines()
    assert len(lines) == 5 and lines[0].endswith("fits yes")
    assert lines[1].split()[:3] == ["HBM", "per", "GPU"] and "88.32 GB" in lines[1]
    assert f"{r['estimate']['range']['expected']['tokens_per_s_per_gpu']:,.0f} expected" \
        in lines[4]
    whole = report_text.format_report(r)
    assert len(whole.splitlines()) > 50 and "InfiniBand" in whole
