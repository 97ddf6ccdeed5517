"""Pipeline-parallel layouts priced from a compiled FSDP plan (plan/pipeline.py): the
layout without stages reproduces the plan it was priced from, and the pipeline's bytes,
bubble and memory follow their formulas."""

import json
from pathlib import Path

import pytest

from europa_jax.config_loader import load_config
from europa_jax.plan import pipeline
from conftest import config_path

# `europa-jax plan configs/europa-952b.yaml --devices 384 --documents long-tail --json`
PLAN = json.loads((Path(__file__).parent / "data" / "europa-952b-plan-long-tail.json")
                  .read_text())


@pytest.fixture(scope="module")
def cfg():
    return load_config(config_path("europa-952b.yaml"))


def test_the_layout_without_stages_is_the_plan_it_was_priced_from(cfg):
    """Its step is the plan's, and the weights the pricing counts (a GPU's quarter of
    each MoE layer's experts, every other parameter whole, fp8 gathers forward and
    backward, bf16 reduce-scatters, 95 of 96 nodes remote) are the InfiniBand bytes the
    compiled program moves, within 0.5 %."""
    r = pipeline.price(cfg, PLAN, pipeline.Layout(1, 1, 384, "fsdp"))
    assert r["step_s"] == pytest.approx(PLAN["estimate"]["range"]["expected"]["step_s"],
                                        rel=1e-3)
    assert r["infiniband_bytes"] == pytest.approx(
        PLAN["estimate"]["by_class"]["infiniband"]["bytes"], rel=5e-3)
    assert r["hbm_peak_bytes"] == PLAN["per_device"]["hbm_peak_bytes"] and r["fits"]


def test_twice_the_rows_on_fsdp_double_the_work_and_the_saved_inputs_not_the_gathers(cfg):
    one = pipeline.price(cfg, PLAN, pipeline.Layout(1, 1, 384, "fsdp"))
    two = pipeline.price(cfg, PLAN, pipeline.Layout(1, 1, 768, "fsdp"))
    assert two["infiniband_bytes"] == one["infiniband_bytes"]
    assert two["compute_s"] == pytest.approx(2 * one["compute_s"])
    activations = PLAN["memory"]["activations_offloaded"]
    assert two["host_peak_bytes"] == pytest.approx(one["host_peak_bytes"] + activations)
    assert not two["fits"]  # 124.6 GB of host memory against 96


def test_a_pipeline_prices_its_bubble_boundaries_and_weights(cfg):
    """8 stages of 12 nodes, 7 chunks, 384 rows: 8 microbatches per GPU, bubble 7/56;
    per microbatch the stage's weights cross InfiniBand as FSDP's do per row (so the
    weights' bytes equal FSDP's but for 11/12 remote instead of 95/96), plus each
    microbatch's bf16 activations and gradients at each of its 7 chunks' boundaries."""
    fsdp = pipeline.price(cfg, PLAN, pipeline.Layout(1, 1, 384, "fsdp"))
    r = pipeline.price(cfg, PLAN, pipeline.Layout(8, 7, 384, "per_microbatch"))
    assert r["microbatches"] == 8 and r["bubble"] == pytest.approx(7 / 56)
    assert r["infiniband_by_kind"]["weights"] == pytest.approx(
        fsdp["infiniband_bytes"] * (11 / 12) / (95 / 96))
    assert r["infiniband_by_kind"]["boundaries"] == 8 * 7 * 2 * 65536 * 7168 * 2
    assert r["compute_s"] == pytest.approx(fsdp["compute_s"] * (1 + 7 / 56))
    assert r["hbm_peak_bytes"] == fsdp["hbm_peak_bytes"]


def test_resident_weights_cut_the_gathers_and_cost_hbm(cfg):
    """Gathered once, reduced once: (1 + 2) bytes per parameter of the stage instead of
    (1 + 1 + 2) per microbatch; HBM holds them and the bf16 gradient sums, less the two
    layers' fp8 gather buffers FSDP needed."""
    w = pipeline.weights_of(cfg, PLAN["memory"]["state"]["params"]["device"] / 4 * 384)
    r = pipeline.price(cfg, PLAN, pipeline.Layout(16, 3, 384, "resident"))
    assert r["infiniband_by_kind"]["weights"] == pytest.approx(3 * w.per_pass / 16 * 5 / 6)
    assert r["hbm_peak_bytes"] == pytest.approx(
        PLAN["per_device"]["hbm_peak_bytes"] + 3 * w.per_pass / 16 - 2 * w.routed_per_layer)
    assert not r["fits"]


def test_no_pipeline_fits_and_beats_fsdp_by_15_percent_at_the_recipes_batch(cfg):
    """The answer docs/plan.md gives, as the plan's numbers stand."""
    fsdp = pipeline.price(cfg, PLAN, pipeline.Layout(1, 1, 384, "fsdp"))
    fitting = [pipeline.price(cfg, PLAN, layout)
               for layout in pipeline.layouts(cfg, 384, 384)]
    best = max((r for r in fitting if r["fits"]), key=lambda r: r["tokens_per_s_per_gpu"])
    assert best["tokens_per_s_per_gpu"] < 1.15 * fsdp["tokens_per_s_per_gpu"]


def test_layouts_that_the_machine_cannot_hold_are_errors(cfg):
    with pytest.raises(ValueError, match="5 stages × 1 chunks do not fit 96 nodes"):
        pipeline.price(cfg, PLAN, pipeline.Layout(5, 1, 384, "per_microbatch"))
    with pytest.raises(ValueError, match="8 stages × 8 chunks"):
        pipeline.price(cfg, PLAN, pipeline.Layout(8, 8, 384, "resident"))
    with pytest.raises(ValueError, match="policy 'zero'"):
        pipeline.price(cfg, PLAN, pipeline.Layout(2, 1, 384, "zero"))
    stages = {layout.stages for layout in pipeline.layouts(cfg, 384, 384)}
    assert stages == {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48}

