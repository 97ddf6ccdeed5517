"""The plan report (plan.py) as text for a terminal: the five-line summary, and the whole
report — memory, kernels, FLOPs, collectives, traffic, the step (report_step.py)."""

from __future__ import annotations

from typing import Any

from europa_jax.plan.report_step import _estimate, _step_table, CLASS_LABELS
from europa_jax.plan.report_units import _flop, _s, scaled, size  # noqa: F401 (scaled: tests)


def _fits(ok: bool) -> str:
    return "fits" if ok else "DOES NOT FIT"


def _state_rows(m: dict[str, Any], row) -> list[str]:
    """The train state per memory kind, and the largest parameters copied over a mesh axis."""
    held = m["state"]
    lines = [row(label, size(held[key].get("device", 0)), size(held[key].get("pinned_host", 0)))
             for label, key in (("parameters (master copy)", "params"),
                                ("optimizer state", "optimizer_state"),
                                ("other state", "other_state"))]
    return lines + [row(f"  of which {rep['name']} copied over '{rep['over']}'", size(rep["bytes"]))
                    for rep in [p for p in m["replicated_params"] if p["bytes"] >= 1e6][:3]]


def _memory(r: dict[str, Any]) -> list[str]:
    m, hw = r["memory"], r["machine"]
    probed = r["compiled"].get("probe_moe_layers")
    row = lambda label, dev="", host="": f"  {label:<50}{dev:>14}{host:>14}"
    lines = [f"{'memory per device':<52}{'device':>14}{'host':>14}"]
    lines += _state_rows(m, row)
    lines.append(row("saved activations offloaded", "", size(m["activations_offloaded"])))
    for label, key in (("whole step: state + XLA:CPU program", "step"),
                       ("forward+backward alone: its program + state", "forward_backward"),
                       ("optimizer update alone: its program", "update")):
        part = m[key]
        if part["xla_cpu"]:
            offloaded = m["activations_offloaded"] if key != "update" else 0.0
            lines.append(row(label, size(part["device_total"])))
            if not (key == "step" and probed):  # there: the largest of its phases
                lines.append(row("  of which XLA temporaries",
                                 size(part["xla_cpu"]["temp"] - offloaded)))
            lines.append(row("", _fits(part["fits_device"])))
    lines.append(row("host total", "", size(m["host_total"])))
    lines.append(row("budget per GPU", size(hw["hbm_bytes"]), size(hw["host_bytes"])))
    lines.append(row("", "", _fits(m["fits_host"])))
    for key, label in (("step", "the step"), ("forward_backward", "forward+backward")):
        if m[key]["largest_buffers"]:
            depth = f" at {probed[1]} MoE layers" if probed else ""
            lines += [f"largest buffers of {label}{depth} (XLA:CPU program: some bf16 widened "
                      "to f32):"]
            for b in m[key]["largest_buffers"]:
                shape = f"{b['dtype']}[{','.join(map(str, b['shape']))}]"
                lines.append(f"  {size(b['bytes']):>12}  {shape:<26} …{b['source'][-70:]}")
    return lines


def _flops(f: dict[str, Any], attention: dict[str, Any] | None = None) -> list[str]:
    pf = _flop
    lines = ["FLOPs per device per step",
             f"  {'model: 6·N per token + attention of the slowest GPU (expected)':<66}"
             f"{pf(f['model'])}",
             f"  {'× recompute (HLO matmuls, this activation policy ÷ no remat)':<66}"
             f"{f['recompute_factor']:>12.3f}",
             f"  {'+ optimizer matmuls as partitioned (compiled program)':<66}"
             f"{pf(f['optimizer'])}",
             f"  {'= analytic':<66}{pf(f['executed_analytic'])}",
             f"  {'executed by the kernels (the estimate prices these):':<66}"
             f"{pf(f['executed'])}",
             "    " + ", ".join(f"{CLASS_LABELS[k]} {pf(v).strip()}"
                               for k, v in f["by_class"].items())]
    kernels = f.get("attention_kernels")
    if kernels:
        one, many = kernels["one_document_per_row"], kernels["64_documents_per_row"]
        lines.append(f"  attention kernels run, of a causal row's pairs (forward / backward, "
                     f"backward chunk {kernels['backward_chunk'] or 'none'}): one document "
                     f"{one['forward']:.3f} / {one['backward']:.3f}, "
                     f"64 documents {many['forward']:.3f} / {many['backward']:.3f}")
    if attention and f.get("attention_per_gpu"):
        a, at = attention, f["attention_per_gpu"]
        lines += [f"  attention of the slowest {a['slowest_unit']}, per GPU: expected "
                  f"{pf(at['expected']).strip()}, p95 {pf(at['p95']).strip()}, worst case (one "
                  f"document per row) {pf(at['worst_case']).strip()}; mean over GPUs "
                  f"{pf(at['mean_over_gpus']).strip()}",
                  f"    cost max/mean per rank {a['cost_max_over_mean']['per_rank']:.2f}, per "
                  f"node {a['cost_max_over_mean']['per_node']:.2f}; {a['batches']} global "
                  f"batches through the balancer, documents: {a['documents']}"]
    if f["xla_cost_analysis"] is not None:
        lines.append(f"  {'(XLA:CPU cost_analysis counts each loop body once: not a total)':<66}"
                     f"{pf(f['xla_cost_analysis'])}")
    return lines


def _qk_clip(q: dict[str, Any]) -> list[str]:
    """MuonClip's share, analytic (qk_clip.cost): already inside the compiled numbers."""
    state = f"τ = {q['threshold']:g}" if q["threshold"] else "off (max logits still measured)"
    return [f"  QK-clip {state}: clip {_flop(q['clip_flops']).strip()} "
            f"({size(q['clip_hbm_bytes'])} HBM), max logits {_flop(q['measure_flops']).strip()}, "
            f"{size(q['residual_bytes_per_layer'])} softmax residuals per layer (transient), "
            f"{q['all_reduce_bytes']:,} B all-reduce"]


def _collectives(rows: list[dict], title: str) -> list[str]:
    lines = [title, f"  {'op':<18} {'axes':<12} {'dtype':<9} {'count':>7} {'bytes':>12} "
             f"{'of it IB':>12} {'link':<17} {'time':>10}"]
    for row in rows:
        ib = row.get("infiniband_bytes", 0)
        lines.append(f"  {row['op']:<18} {row['axes']:<12} {row['dtype']:<9} {row['count']:>7} "
                     f"{scaled(row.get('bytes_per_device', 0)):>12} "
                     f"{scaled(ib) if ib else '0':>12} {row['link']:<17} "
                     f"{_s(row['seconds']):>10}")
    return lines


def _exchange(x: dict[str, Any]) -> list[str]:
    """The MoE token exchange: routed rows against what its buffers could carry."""
    routing = x["routing"]
    limit = (f"node-limited to {routing['topk_group']} of {x['nodes']} nodes"
             if routing["node_limited"] else
             f"groups {routing['topk_group']} of {routing['n_group']}"
             if routing["n_group"] > 1 else "unlimited")
    lines = [f"MoE token exchange ({x['dispatch'].replace('_', '-')}): expert axis "
             f"{x['expert_axis']} over {x['nodes']} node(s), routing {limit}; "
             f"{x['expected_destinations']:.2f} devices and {x['expected_nodes_per_token']:.2f} "
             "nodes per token expected (uniform routing)",
             f"  {x['tokens_per_dispatch']:,} tokens per dispatch, {x['rows_per_peer_round0']:,} "
             f"rows per peer in round 0 ({'drops past it' if x['drops_past_capacity'] else 'dropless'}"
             f"), expected fill {x['expected_fill']:.0%}"
             + (f"; first stage {x['node_stage_fill']:.0%} of its T rows per node"
                if x.get("node_stage_fill") is not None else ""),
             f"  routed rows: {scaled(x['routed_bytes_per_step'])} per GPU per step, "
             f"{scaled(x['routed_infiniband_bytes_per_step'])} of it to other nodes "
             f"({_s(x['routed_infiniband_s'])} of InfiniBand)"]
    if "buffer_bytes" in x:
        lines.append(f"  bound, every buffer full: {scaled(x['buffer_bytes'])}, "
                     f"{scaled(x['buffer_infiniband_bytes'])} to other nodes "
                     f"({_s(x['buffer_infiniband_s'])}); the estimate charges the expected fill")
    return lines


def _gpu_memory(r: dict[str, Any]) -> list[str]:
    """Memory of the GPU program: XLA:GPU's own accounting, HBM and host apart."""
    m, budget, per = r["memory"], r["budget"], r["per_device"]
    x = m["step"]["xla_gpu"]
    row = lambda label, dev="", host="": f"  {label:<50}{dev:>14}{host:>14}"
    lines = [f"{'memory per GPU (the GPU program)':<52}{'HBM':>14}{'host':>14}"]
    lines += _state_rows(m, row)
    if x:
        lines += [row("arguments (state in, batch)", size(x["argument"]),
                      size(x["host_argument"])),
                  row("outputs not aliased to arguments", size(x["output"] - x["alias"]),
                      size(x["host_output"] - x["host_alias"])),
                  row("temporaries (activations, gradients, buffers)", size(x["temp"]),
                      size(x["host_temp"])),
                  row("  of which saved activations offloaded (jaxpr)", "",
                      size(m["activations_offloaded"]))]
    lines += [row("peak", size(per["hbm_peak_bytes"]), size(per["host_peak_bytes"])),
              row("budget per GPU", size(budget["hbm_bytes"]), size(budget["host_bytes"])),
              row("", _fits(per["hbm_peak_bytes"] is not None
                            and per["hbm_peak_bytes"] <= budget["hbm_bytes"]),
                  _fits(per["host_peak_bytes"] is not None
                        and per["host_peak_bytes"] <= budget["host_bytes"]))]
    if m["step"]["largest_buffers"]:
        lines.append("largest buffers of the step (GPU program; host = pinned_host):")
        for b in m["step"]["largest_buffers"]:
            shape = f"{b['dtype']}[{','.join(map(str, b['shape']))}]"
            lines.append(f"  {size(b['bytes']):>12} {b['memory']:<6} {shape:<26} "
                         f"…{b['source'][-62:]}")
    return lines


def _hbm_traffic(t: dict[str, Any]) -> list[str]:
    """The GPU program's non-matmul kernels: HBM bytes per step by part of the model."""
    tb = scaled
    lines = [f"non-matmul kernels, HBM bytes per GPU per step (optimized GPU program): "
             f"{tb(t['bytes_per_step'])}, + {tb(t['data_dependent_bytes_per_step'])} in "
             f"data-dependent loops and branches at their expected trips; the MoE layer's "
             f"loops {tb(t['moe_loop_bytes_per_step'])}"]
    maybe = t["data_dependent_by_region"]
    for name, value in t["by_region"].items():
        extra = f" (+ {tb(maybe[name])})" if maybe.get(name) else ""
        lines.append(f"  {name:<28} {tb(value):>12}{extra}")
    lines.append("  largest kernels:")
    for k in t["largest"][:5]:
        lines.append(f"    {tb(k['bytes_per_step']):>10} = {tb(k['bytes_per_run'])} × "
                     f"{k['runs']:,.0f}  {k['kind']:<13} …{k['source'][-60:]}")
    return lines


def _kernels(checks: list[dict]) -> list[str]:
    lines = ["GPU-only paths: what each compiled to"]
    for k in checks:
        lines.append(f"  {'ok ' if k['ok'] else 'NO '} {k['path']} ({k['configured']}): "
                     f"{k['found']}")
        if not k["ok"]:
            lines.append(f"      expected {k['expected']}")
    return lines


def format_summary(r: dict[str, Any]) -> str:
    """The plan in five lines (fits, HBM, host, step, tokens/s/GPU): what `plan` prints
    without --verbose."""
    c, per, budget = r["compiled"], r["per_device"], r["budget"]
    target = ("this machine's CPUs (priced for GH200)" if r["target"] == "cpu"
              else f"{r['target']}, compiled without a GPU")
    peak = lambda key: size(per[key]) if per.get(key) is not None else "n/a"
    lines = [f"plan: {r['config']} on {r['devices']} devices ({target}): fits "
             f"{'yes' if r['fits'] else 'NO'}",
             f"  HBM per GPU   {peak('hbm_peak_bytes')} of {size(budget['hbm_bytes'])}",
             f"  host per GPU  {peak('host_peak_bytes')} of {size(budget['host_bytes'])}"]
    if c["error"]:
        return "\n".join(lines + [f"  COMPILE FAILED: {c['error']}"])
    rng = r["estimate"]["range"]
    lines += [f"  step          {_s(rng['expected']['step_s'])} expected "
              f"({_s(rng['high']['step_s']).strip()} – {_s(rng['low']['step_s']).strip()})",
              f"  tokens/s/GPU  {rng['expected']['tokens_per_s_per_gpu']:,.0f} expected "
              f"({rng['low']['tokens_per_s_per_gpu']:,.0f} – "
              f"{rng['high']['tokens_per_s_per_gpu']:,.0f}), MFU "
              f"{rng['expected']['mfu']:.1%}"]
    return "\n".join(lines)


def format_report(r: dict[str, Any]) -> str:
    """The whole plan (`plan --verbose`): memory, kernels, FLOPs, collectives, the step's
    classes and lines."""
    c = r["compiled"]
    gpu = r["target"] != "cpu"
    rows = r["tokens_per_device"] / r["seq_len"]
    lines = [f"plan: {r['config']} on {r['devices']} devices (data {r['mesh']['data']} × expert "
             f"{r['mesh']['expert']}), {r['tokens_per_device']:,.0f} tokens per device per step "
             f"({rows:g} × {r['seq_len']:,})",
             f"compiled for {c['program']}: {c['mode']}, {r['layers']} layers "
             f"({c['moe_layers']} MoE), {c['seconds']:.0f} s",
             f"fits (HBM ≤ {size(r['budget']['hbm_bytes'])}, host ≤ "
             f"{size(r['budget']['host_bytes'])}): {'yes' if r['fits'] else 'NO'}"
             + (f"; within {size(r['budget']['host_bytes_strict'])} of host memory (120 GB "
                f"per node): {'yes' if r['fits_strict_host'] else 'no'}" if r["fits"] else "")]
    if c["error"]:
        lines.append(f"COMPILE FAILED: {c['error']} — state bytes below are exact, nothing "
                     "else could be measured")
    lines += [""] + (_gpu_memory(r) if gpu else _memory(r))
    if c["error"]:
        return "\n".join(lines)
    if gpu:
        lines += [""] + _kernels(r["kernels"])
        if r.get("hbm_traffic"):
            lines += [""] + _hbm_traffic(r["hbm_traffic"])
    lines += [""] + _flops(r["flops"], r.get("attention"))
    if r.get("qk_clip"):
        lines += _qk_clip(r["qk_clip"])
    by_source = lambda source: [row for row in r["collectives"] if row["source"] == source]
    if gpu:
        lines += [""] + _collectives(by_source("compiled"), "collectives per GPU per step "
                                     "(optimized GPU program, wire dtypes; links from the "
                                     "replica groups; ragged all-to-all at its expected fill)")
    else:
        lines += [""] + _collectives(by_source("step"),
                                     "collectives per device per step, the step as written "
                                     "(lowered HLO, wire dtypes)")
        lines += [""] + _collectives(by_source("partitioner"),
                                     "collectives the SPMD partitioner adds outside the "
                                     "shard_map (compiled XLA:CPU program)")
    if r.get("exchange"):
        lines += [""] + _exchange(r["exchange"])
    lines += [""] + _step_table(r)
    lines += _estimate(r["estimate"]["as_compiled"], "expected, at the expected slowest "
                       f"GPU's attention on {r['attention']['documents'].split(':')[0]}")
    if r["estimate"].get("worst_case"):
        lines += _estimate(r["estimate"]["worst_case"], "worst case (every row one document)")
    if r["estimate"]["update_kept_local"]:
        lines += _estimate(r["estimate"]["update_kept_local"],
                           "if the optimizer update stayed on each shard (no partitioner "
                           "traffic or optimizer matmuls)")
    return "\n".join(lines)
