"""`plan --compare recipe` (plan/compare.py): the recipe's layout priced by our model on the
same documents, both document models, and our ratio to it."""

import dataclasses

import numpy as np
import pytest

from europa_jax.config import MeshConfig
from europa_jax.plan.price import attention_cost, documents
from europa_jax.plan import compare
from europa_jax.plan.program import gpu_program


def test_the_recipe_layout_is_fsdp_with_experts_in_a_node_and_no_context_parallelism(tiny_cfg):
    cfg = dataclasses.replace(
        tiny_cfg, mesh=MeshConfig(data=1, expert=8, allow_cross_node_experts=True),
        execution=dataclasses.replace(tiny_cfg.execution, attention_context_parallel=True),
        comm=dataclasses.replace(tiny_cfg.comm, weight_gather_dtype="bf16"))
    recipe = compare.recipe_layout(cfg)
    assert (recipe.mesh.data, recipe.mesh.expert) == (2, 4)  # 4 = a node
    assert not recipe.execution.attention_context_parallel
    assert recipe.comm.weight_gather_dtype == "fp8" and recipe.comm.grad_reduce_dtype == "bf16"
    assert recipe.model.n_routed_experts == cfg.model.n_routed_experts  # the model unchanged


def report(tokens: float, error=None) -> dict:
    rng = {c: {"tokens_per_s_per_gpu": tokens * f, "step_s": 1.0}
           for c, f in (("low", 0.7), ("expected", 1.0), ("high", 1.2))}
    return {"estimate": {"range": rng, "by_class": {"attention_backward": {
        "seconds": {"expected": 2.0}}}}, "compiled": {"error": error}, "fits": True,
        "per_device": {"hbm_peak_bytes": 8e10, "host_peak_bytes": 6e10},
        "attention": {"documents": "described"}}


def test_both_layouts_are_planned_on_both_document_models_and_the_ratio_printed(tiny_cfg):
    calls = []

    def plan_one(cfg, *, documents_model, corpus, block_skipping):
        calls.append((cfg.execution.attention_context_parallel, documents_model, corpus,
                      block_skipping))
        return report(1000.0 if not block_skipping else 800.0)

    cfg = dataclasses.replace(tiny_cfg, execution=dataclasses.replace(
        tiny_cfg.execution, attention_context_parallel=True))
    result = compare.compare(cfg, plan_one)
    assert calls == [(True, "dolma", None, False), (True, "long-tail", None, False),
                     (False, "dolma", None, True), (False, "long-tail", None, True)]
    assert result["ours_over_recipe"] == {"dolma": pytest.approx(1.25),
                                          "long-tail": pytest.approx(1.25)}
    text = compare.format_compare(result, "tiny")
    assert "ours / recipe on dolma: 1.25" in text and "1,000 / 1,200" in text
    # a prepared corpus takes the default model's place
    calls.clear()
    compare.compare(cfg, plan_one, corpus="corpus_dir")
    assert [c[1:3] for c in calls[:2]] == [("dolma", "corpus_dir"), ("long-tail", None)]


@pytest.mark.slow
def test_block_skipping_runs_the_backward_at_the_forwards_tile_pairs(tiny_cfg):
    """The recipe's attention skips masked blocks in both passes: its backward pairs are
    the forward's, below our chunk pairs, and its backward runs no pair loop."""
    cfg = dataclasses.replace(
        tiny_cfg, mesh=MeshConfig(data=4, expert=4),
        execution=dataclasses.replace(tiny_cfg.execution, attention_backward_chunk=128),
        data=dataclasses.replace(tiny_cfg.data, global_batch_size=32, seq_len=1024))
    lengths = documents.long_tail_lengths(20000, seed=3) // 2 + 1
    ours = attention_cost.slowest_pairs(cfg, lengths, batches=4, context_parallel=False)
    flex = attention_cost.slowest_pairs(cfg, lengths, batches=4, context_parallel=False,
                                        block_skipping=True)
    run, flex_run = ours["kernel_pairs_per_gpu"], flex["kernel_pairs_per_gpu"]
    assert flex_run["backward"] == flex_run["forward"] == run["forward"]
    assert flex_run["backward"]["expected"] <= run["backward"]["expected"]
    assert flex["block_skipping"] and not ours["block_skipping"]
    assert gpu_program.expected_trips(cfg, flex)("jit(f)/attention/while") == 0.0
    assert gpu_program.expected_trips(cfg, ours)("jit(f)/attention/while") > 0.0


def test_the_default_documents_are_dolmas_and_every_estimate_names_them(tiny_cfg):
    r = attention_cost.slowest_pairs(tiny_cfg, batches=2)
    assert r["documents"].startswith("dolma: Dolma v1")
    r = attention_cost.slowest_pairs(tiny_cfg, batches=2, documents_model="long-tail")
    assert r["documents"].startswith("long-tail:")
    r = attention_cost.slowest_pairs(tiny_cfg, np.full(40, 16), batches=2)
    assert r["documents"] == "40 given document lengths"
