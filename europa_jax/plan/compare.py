"""`europa-jax plan CONFIG --compare recipe`: our layout and the recipe's, priced by the same
model on the same documents, and our speed relative to it.

The recipe (the EUROPA consortium's, PyTorch + TorchTitan on JUPITER) measured ~1,300
tokens/s/GPU on its own data, which is not public. The plan cannot price its program, but
it can price its layout with ours: the config's mesh (FSDP over every GPU, expert
parallelism inside a node), no context parallelism (each GPU its own row, all heads),
FP8 weight gathers and BF16 gradient reductions, and attention that skips masked blocks in
both passes (FlexAttention's block mask: the backward at the forward's tile pairs,
attention_cost.py `block_skipping`, no pair loop). Everything else — the GEMMs, the
memory-bound kernels, the collectives — is our compiled program's for that layout, so the
ratio says what our attention layout and backward cost or save against the recipe's on the
same data, not what PyTorch's kernels would reach.

Both layouts are planned on both document models (documents.py): the corpus-derived
default and the long-tailed stress case (or a prepared corpus, `--corpus`, instead of the
first). Four compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from europa_jax.config import Config
from europa_jax.plan.price import documents

RECIPE_MEASURED = 1300.0  # tokens/s/GPU, the recipe's own report on its own data
LAYOUTS = ("ours", "recipe")


def recipe_layout(cfg: Config) -> Config:
    """`cfg` laid out as the recipe lays out its run (module docstring)."""
    mesh = cfg.mesh
    if mesh.expert != mesh.devices_per_node:
        mesh = dataclasses.replace(mesh, expert=mesh.devices_per_node,
                                   data=mesh.n_devices // mesh.devices_per_node)
    return dataclasses.replace(
        cfg, mesh=mesh,
        execution=dataclasses.replace(cfg.execution, attention_context_parallel=False),
        comm=dataclasses.replace(cfg.comm, weight_gather_dtype="fp8",
                                 grad_reduce_dtype="bf16"))


def compare(cfg: Config, plan_one: Callable[..., dict], corpus: str | None = None
            ) -> dict[str, Any]:
    """Plan both layouts on both document models: `plan_one(cfg, documents_model=…,
    corpus=…, block_skipping=…)` is plan.plan with the command's other arguments."""
    # (name in the table, documents model, corpus): a corpus takes the default's place
    models = [("corpus", documents.DEFAULT, corpus) if corpus else
              (documents.DEFAULT, documents.DEFAULT, None), ("long-tail", "long-tail", None)]
    rows = []
    for layout in LAYOUTS:
        layout_cfg = cfg if layout == "ours" else recipe_layout(cfg)
        for name, model, path in models:
            report = plan_one(layout_cfg, documents_model=model, corpus=path,
                              block_skipping=layout == "recipe")
            rows.append(row(layout, name, report))
    ratio = {}
    for name, _, _ in models:
        ours, recipe = (next(r for r in rows if r["layout"] == layout and r["documents"] == name)
                        for layout in LAYOUTS)
        if ours["tokens_per_s_per_gpu"] and recipe["tokens_per_s_per_gpu"]:
            ratio[name] = (ours["tokens_per_s_per_gpu"]["expected"]
                           / recipe["tokens_per_s_per_gpu"]["expected"])
    return {"rows": rows, "ours_over_recipe": ratio, "recipe_measured": RECIPE_MEASURED}


def row(layout: str, documents_model: str, report: dict) -> dict[str, Any]:
    """One plan's line of the comparison."""
    e = report["estimate"]
    error = report["compiled"]["error"]
    return {"layout": layout, "documents": documents_model,
            "described": report["attention"]["documents"], "error": error,
            "fits": report["fits"],
            "hbm_peak_bytes": report["per_device"]["hbm_peak_bytes"],
            "host_peak_bytes": report["per_device"]["host_peak_bytes"],
            "step_s": None if error else e["range"]["expected"]["step_s"],
            "attention_backward_s": None if error else
            e["by_class"]["attention_backward"]["seconds"]["expected"],
            "tokens_per_s_per_gpu": None if error else {
                c: e["range"][c]["tokens_per_s_per_gpu"] for c in ("low", "expected", "high")}}


def format_compare(result: dict[str, Any], name: str) -> str:
    """The comparison as a table for a terminal."""
    lines = [f"{name}: our layout and the recipe's, the same pricing model and documents "
             "(plan/compare.py)",
             f"  {'layout':<8}{'documents':<11}{'fits':<6}{'HBM GB':>8}{'host GB':>9}"
             f"{'step s':>9}{'attn bwd s':>12}   tokens/s/GPU low / expected / high"]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"  {r['layout']:<8}{r['documents']:<11}{r['error']}")
            continue
        t = r["tokens_per_s_per_gpu"]
        lines.append(f"  {r['layout']:<8}{r['documents']:<11}{'yes' if r['fits'] else 'NO':<6}"
                     f"{(r['hbm_peak_bytes'] or 0) / 1e9:>8.1f}"
                     f"{(r['host_peak_bytes'] or 0) / 1e9:>9.1f}{r['step_s']:>9.1f}"
                     f"{r['attention_backward_s']:>12.1f}   {t['low']:,.0f} / "
                     f"{t['expected']:,.0f} / {t['high']:,.0f}")
    for doc, ratio in result["ours_over_recipe"].items():
        lines.append(f"  ours / recipe on {doc}: {ratio:.2f}")
    lines.append(f"  the recipe measured ~{result['recipe_measured']:,.0f} tokens/s/GPU on its "
                 "own data (not public)")
    described = {r["documents"]: r["described"] for r in result["rows"]}
    lines += [f"  {text}" if text.startswith(doc) else f"  {doc}: {text}"
              for doc, text in described.items()]
    return "\n".join(lines)
