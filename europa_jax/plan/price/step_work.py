"""What one GPU does in a step (step_time.StepWork): from the GPU program, or from the
config when the program compiled is XLA:CPU's.

From the GPU program (`from_program`): every dense GEMM shape and grouped-GEMM window the
optimized program runs, at its runs per step (kernel_classes.py); the memory-bound
kernels' bytes (hbm_traffic.py); the host copies each way; the collectives by link.
Attention's pairs are data: the kernels' pairs on the GPU whose kernels cost the most
(attention_cost.py) × FLOPs per pair, for as many forward passes as the program runs the
forward kernel per layer (remat recomputes it) and one backward.

From the config (`from_config`, the XLA:CPU plan): the same classes, counted
analytically — the routed experts' GEMMs at the rows per expert routing is expected to
give, every other matmul as one dense GEMM class at the efficiency of a GEMM whose
smallest dimension is the model width, no memory-bound kernels (XLA:CPU's are not a
GPU's), the offloaded state and activations each way over C2C.
"""

from __future__ import annotations

from typing import Any

from europa_jax.config import Config
from europa_jax.model import flops as model_flops
from europa_jax.model.experts import moe
from europa_jax.plan.price.step_time import StepWork, attention_flops, backward_per_forward


def _links(rows: list[dict]) -> dict[str, float]:
    return {"nvlink_bytes": sum(r["nvlink_bytes"] for r in rows),
            "infiniband_bytes": sum(r["infiniband_bytes"] for r in rows)}


def attention_layers(m) -> int:
    """Layers with attention: the decoder's and the MTP modules' blocks."""
    return m.n_layers + m.mtp_layers


def _attention(cfg: Config, attention: dict[str, Any], passes: float, pairs: str
               ) -> dict[str, float]:
    """Forward and backward FLOPs of the kernels' pairs (`pairs`: expected, p95 or
    worst_case) per GPU."""
    m = cfg.model
    run = attention["kernel_pairs_per_gpu"]
    one = lambda p: attention_flops(p, heads=m.n_heads, d_qk=m.qk_head_dim, d_v=m.v_head_dim,
                                    layers=attention_layers(m))
    ratio = backward_per_forward(m.qk_head_dim, m.v_head_dim)
    return {"attention_forward_flops": passes * one(run["forward"][pairs]),
            "attention_backward_flops": ratio * one(run["backward"][pairs]),
            "attention_backward_ratio": ratio}


def forward_passes(cfg: Config, classes: dict | None) -> float:
    """How many times a layer's attention forward runs per step over a device's rows: the
    program's forward kernel calls per layer (per row under `execution.row_loop`, whose
    kernels take one row each), or 2 under full remat (the backward recomputes it)."""
    if classes and classes["attention_forward"]["runs"]:
        rows = cfg.data.global_batch_size // cfg.mesh.n_devices // cfg.train.microbatches
        calls_per_pass = max(1, rows) if cfg.execution.row_loop else 1
        return max(1.0, round(classes["attention_forward"]["runs"]
                              / attention_layers(cfg.model) / calls_per_pass))
    return 2.0 if cfg.execution.remat == "full" else 1.0


def from_program(cfg: Config, classes: dict, attention: dict[str, Any], rows: list[dict], *,
                 memory_bytes: float, update_bytes: float, pairs: str = "expected",
                 critical: dict[str, float] | None = None) -> StepWork:
    """The GPU program's work (module docstring); `classes`: kernel_classes.summary;
    `critical`: the program's launches, loop trips and phase bytes (gpu_program.measure's
    `critical/…` numbers, critical_path.py)."""
    dense = tuple((gemm_label(s), float(min(s["m"], s["n"], s["k"])), s["flops"], s["bytes"],
                   s.get("math", "bf16")) for s in classes["dense_gemm"]["shapes"])
    grouped = tuple((f"{w['rows']:,} rows × {w['experts']} experts, {w['k']:,}→{w['n']:,}",
                     w["rows_per_expert"], w["flops"], w["bytes"])
                    for w in classes["grouped_gemm"]["windows"])
    host = classes["host_copy"]
    return StepWork(dense_gemms=dense, grouped_gemms=grouped,
                    **_attention(cfg, attention, forward_passes(cfg, classes), pairs),
                    memory_bytes=memory_bytes, update_bytes=update_bytes,
                    to_host_bytes=host["to_host_bytes"], to_device_bytes=host["to_device_bytes"],
                    nvlink_peers=cfg.mesh.node_group - 1, **_links(rows),
                    **critical_fields(critical or {}))


def critical_fields(numbers: dict[str, float]) -> dict[str, Any]:
    """StepWork's chain and serial fields from gpu_program.measure's `critical/…` numbers."""
    pair = lambda phase: (numbers.get(f"critical/{phase}/nvlink_bytes", 0.0),
                          numbers.get(f"critical/{phase}/infiniband_bytes", 0.0))
    fill, drain = pair("fill"), pair("drain")
    # what kernels scheduled beside an exchange cover of it is no wait (critical_path.py)
    in_layer, covered = pair("in_layer_exchange"), pair("in_layer_covered")
    return {"launches": numbers.get("critical/launches", 0.0),
            "loop_trips": numbers.get("critical/loop_trips", 0.0),
            "in_layer_exchange_bytes": (in_layer[0] - covered[0], in_layer[1] - covered[1]),
            "in_layer_covered_bytes": covered,
            "update_exchange_bytes": pair("update_exchange"),
            "fill_drain_bytes": (fill[0] + drain[0], fill[1] + drain[1])}


def gemm_label(s: dict) -> str:
    """`[batch ×] M × K → N [math]`, as a GEMM shape row of kernel_classes.summary (the
    math named when it is not BF16)."""
    math = s.get("math", "bf16")
    return ((f"{s['batch']} × " if s["batch"] > 1 else "") + f"{s['m']:,}×{s['k']:,}→{s['n']:,}"
            + ("" if math == "bf16" else f" {math.upper()}"))


def routed_rows_per_expert(cfg: Config) -> float:
    """Copies per local expert a device receives in one dispatch under uniform routing:
    t·k copies (t tokens dispatched at once) over its E / ep experts."""
    m = cfg.model
    return moe.dispatch_tokens(cfg) * m.top_k * cfg.mesh.expert / max(1, m.n_routed_experts)


def from_config(cfg: Config, attention: dict[str, Any], rows: list[dict], *,
                tokens_per_device: float, optimizer_flops: float, host_bytes: float,
                update_bytes: float, pairs: str = "expected") -> StepWork:
    """The config's work, analytically (module docstring)."""
    m = cfg.model
    passes = forward_passes(cfg, None)
    matmul_passes = passes + 2  # forward (again under remat), input and weight gradients
    routed = 3 * m.top_k * m.d_model * m.expert_ffn_dim * (m.n_moe_layers + m.mtp_layers)
    dense = model_flops.matmul_params_per_token(m) - routed
    grouped = ("routed experts (analytic)", routed_rows_per_expert(cfg),
               2.0 * routed * tokens_per_device * matmul_passes, 0.0)
    return StepWork(
        dense_gemms=(("every other matmul (analytic)", float(m.d_model),
                      2.0 * dense * tokens_per_device * matmul_passes + optimizer_flops, 0.0),),
        grouped_gemms=(grouped,) if routed else (),
        **_attention(cfg, attention, passes, pairs),
        memory_bytes=0.0, update_bytes=update_bytes, to_host_bytes=host_bytes,
        to_device_bytes=host_bytes, nvlink_peers=cfg.mesh.node_group - 1, **_links(rows))
