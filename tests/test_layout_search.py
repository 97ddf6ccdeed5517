"""`europa-jax plan --search`: the grid of layouts, what each derives, and the table of a
real search (the CPU target, tiny model: each layout compiled in its own process)."""

import json

import pytest

from europa_jax.config import ConfigError
from europa_jax.plan import layout_search as search
from conftest import config_path
from test_plan import TEST_SIZE, run_plan


def test_the_default_grid_widens_the_expert_axis_over_whole_nodes():
    cfg_path = config_path("europa-952b.yaml")
    from europa_jax.config_loader import load_config

    grid = search.default_grid(load_config(cfg_path), 384)
    assert grid == {"mesh.expert": ["4", "8", "16", "32", "64"],
                    "execution.moe_chunk_tokens": ["0", "16384"]}
    found = {(l.varied["mesh.expert"], l.varied["execution.moe_chunk_tokens"]): l
             for l in search.layouts(cfg_path, [], 384, grid)}
    assert len(found) == 10 and not any(l.error for l in found.values())
    inside = found["4", "0"]
    assert inside.derived == {"mesh.data": "96"}  # the config's own routing (4 groups, 2)
    wide = found["64", "16384"].derived
    assert wide == {"mesh.data": "6", "mesh.allow_cross_node_experts": "true",
                    "model.n_group": "16", "model.topk_group": "4"}  # 4 of 16 nodes
    assert found["8", "0"].derived["model.topk_group"] == "1"  # 1 of 2 nodes


@pytest.mark.slow
def test_routing_named_by_the_user_is_kept_and_a_refused_layout_says_why():
    cfg_path = config_path("europa-952b.yaml")
    [kept] = search.layouts(cfg_path, ["model.n_group=8", "model.topk_group=4"], 384,
                            {"mesh.expert": ["32"]})
    assert "model.n_group" not in kept.derived and kept.error is None
    [odd] = search.layouts(cfg_path, [], 384, {"mesh.expert": ["6"]})
    assert "not a multiple of mesh.devices_per_node=4" in odd.error
    [short] = search.layouts(cfg_path, ["mesh.data=2"], 384, {"mesh.expert": ["64"]})
    assert "not --devices 384" in short.error
    with pytest.raises(ConfigError, match=r"--vary 'mesh.expert': expected KEY=V1,V2"):
        search.parse_vary(["mesh.expert"])
    refused = run_plan(cfg_path, "--devices", "384", "--search", "--jobs", "0")
    assert refused.returncode != 0 and refused.stdout == ""
    assert refused.stderr.strip().splitlines()[-1] == (
        "europa-jax: error: --jobs 0: expected a whole number of layouts ≥ 1")


@pytest.mark.slow
def test_a_search_prints_one_row_per_layout_and_the_fastest_that_fits():
    sets = [a for k, v in TEST_SIZE.items() for a in ("--set", f"{k}={v}")]
    result = run_plan(config_path("tiny-cpu.yaml"), "--devices", "8", "--target", "cpu", "--json",
                      "--search", "--vary", "mesh.expert=4,8,3", "--vary",
                      "execution.moe_chunk_tokens=0", "--jobs", "2", *sets, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    # planned two at a time, listed in the grid's order
    assert [r["varied"]["mesh.expert"] for r in out["layouts"]] == ["4", "8", "3"]
    by_width = {r["varied"]["mesh.expert"]: r for r in out["layouts"]}
    assert "is not divisible by mesh.expert=3" in by_width["3"]["error"]  # never compiled
    inside, across = by_width["4"], by_width["8"]
    assert inside["mesh"] == {"data": 2, "expert": 4} and across["mesh"] == {"data": 1,
                                                                             "expert": 8}
    # across 2 nodes: node-limited (a token's copies on 1 of 2 nodes), InfiniBand charged
    assert across["routing"] == {"n_group": 2, "topk_group": 1, "node_limited": True}
    assert across["infiniband_s"] > 0 and across["destinations"] < inside["destinations"] * 2
    # the token rows' part of it: an exchange across nodes on the CPU target is a dense
    # all-to-all (no ragged one), so none is counted there
    assert inside["exchange_infiniband_s"] == across["exchange_infiniband_s"] == 0
    best = out["fastest_fitting"]
    assert best["fits"] and best["tokens_per_s_per_gpu"] == max(
        r["tokens_per_s_per_gpu"] for r in (inside, across) if r["fits"])
    table = search.format_table(out["layouts"], best)
    assert "fastest that fits: " in table and "not planned: " in table


def test_a_varied_key_that_needs_the_derived_layout_is_checked_with_it():
    """A two-stage dispatch is valid only over an expert axis across nodes: each layout
    is checked with its derived keys, so it is refused at 4 and planned at 8."""
    layouts = search.layouts(config_path("europa-952b.yaml"), [], 384, {
        "mesh.expert": ["4", "8"], "comm.expert_dispatch": ["two_stage"]})
    inside, across = layouts
    assert "two_stage needs an expert axis across nodes" in inside.error
    assert across.error is None and across.derived["model.n_group"] == "2"


def test_layouts_at_different_batches_compare_infiniband_per_row():
    """A row of the table from the europa-952b plan kept in tests/data: one row per
    device as shipped; the same program at twice the rows per device (what one gather
    per layer serves) halves its InfiniBand per row, not per step."""
    from pathlib import Path

    report = json.loads((Path(__file__).parent / "data" / "europa-952b-plan-long-tail.json")
                        .read_text())
    one = search.row(search.Layout({}, {}), report)
    assert one["rows_per_device"] == 1
    assert one["infiniband_s_per_row"] == one["infiniband_s"] > 30
    doubled = {**report, "tokens_per_device": 2 * report["tokens_per_device"]}
    two = search.row(search.Layout({"data.global_batch_size": "768"}, {}), doubled)
    assert two["rows_per_device"] == 2
    assert two["infiniband_s_per_row"] == pytest.approx(one["infiniband_s"] / 2)
    # and what fewer bytes could buy it: the plan's InfiniBand-free ceiling
    assert one["infiniband_free_tokens_per_s_per_gpu"] == report["estimate"]["ceilings"][
        "infiniband_free"]["expected"]["tokens_per_s_per_gpu"] > one["tokens_per_s_per_gpu"]
    table = search.format_table([one, two], search.fastest_fitting([one, two]))
    assert " IB/row " in table.splitlines()[0] and table.splitlines()[0].endswith(" IB free")
    assert table.splitlines()[1].endswith(f"{one['infiniband_free_tokens_per_s_per_gpu']:,.0f}")
