"""`europa-jax plan`: what one training step costs per device, before an allocation is spent.

The real step (`train.build_trainer` → `jit_train_step(...).lower(...)`) is compiled for a
fake mesh of XLA:CPU devices with the config's device count and read four ways:
- state bytes per memory kind, from the train state's shardings: exact, these are the
  shards every GPU holds (`pinned_host` leaves live in Grace memory);
- `compiled.memory_analysis()`: arguments, outputs and XLA's temporaries (activations,
  gradients, workspaces) of the *XLA:CPU* program — of the whole step, and of its two
  phases compiled alone (forward+backward; the optimizer update), so that the report
  says which one does not fit. The GPU program differs: XLA:CPU
  widens bf16 buffers to f32, runs the blocked expert matmul instead of ragged_dot, and
  ignores memory kinds — so host-resident state and offloaded activations (read from
  the step's jaxpr) are taken out of its device numbers here;
- FLOPs: analytic (flops.py; attention at the pairs of the expected slowest rank or
  node of sampled global batches, attention_cost.py) × the recompute the activation
  policy adds (measured from the HLO's matmuls with and without remat), plus the
  optimizer's matmuls as the SPMD partitioner laid them out (read from the update
  compiled alone);
- collectives: every one of the lowered step with its wire dtype (hlo_report), plus the
  ones the SPMD partitioner adds outside the shard_map (the optimizer update).

Depth: layers are scanned, so a full-depth compile costs about what a 3-layer one does
(europa-952b on 384 devices: 3–4 min, 4.6 GB of RAM) and is the default. With unrolled
layers, or when asked (`probe_moe_layers`), two shallower stacks are compiled and every
compiled number is extrapolated linearly per MoE layer; the report says which was done.
A step's temporaries peak in one phase, and which phase can change with depth (on
europa-952b, forward+backward up to 4 MoE layers, the update from 6 on), so an extrapolated
step needs at least the larger of its extrapolated phases. Nothing else about the config
is ever reduced. The optimizer update is not linear in depth (Muon pads each stacked
leaf's matrices to a multiple of the devices, muon_sharded.py), so with probes it is
also compiled alone at full depth: its memory, FLOPs and collectives are exact.

Step time (step_time.py): each class of kernel at its own efficiency (hardware.py) —
dense GEMMs by shape, grouped GEMMs by rows per expert, flash attention forward and
backward at the pairs the kernels run, memory-bound kernels and the update by HBM bytes,
host copies over NVLink-C2C, collectives by link (each collective's replica groups say
which of its bytes cross nodes: links.py; the MoE's ragged exchanges at the rows routing
is expected to put in them, their buffers' size apart: `exchange`) — each at the low,
expected and high end of its range, so the step is a range. The GEMM shapes, windows,
memory-bound bytes and host copies are the GPU program's (step_work.py); with an XLA:CPU
program they are analytic. Overlap: compute (GEMMs, attention, memory-bound kernels, the
update) is one stream; collectives overlap it on the SMs NCCL leaves; host copies on the
copy engines; `serial` adds everything, the bound if nothing overlapped.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax

from europa_jax import param_table
from europa_jax.config import Config
from europa_jax.model import attention, flash_backward, flops
from europa_jax.parallel import offload, sharding
from europa_jax.parallel.offload import state_bytes
from europa_jax.plan.price import (attention_cost, documents, exchange, hardware, step_time, step_work)
from europa_jax.plan.program import gpu_program, gpu_target, kernel_classes
from europa_jax.plan.program.step_compile import (extrapolate, measure, measure_update, with_exact_update,
                                          with_moe_layers)
from europa_jax.train import qk_clip, train

# Shallow stacks can sit off the line: on europa-952b forward+backward temporaries at 3
# MoE layers were 6 % above the line through 2, 4, 6, 12 and 59; 4 and 6 predict 59 within
# 0.1 %. (With scanned layers compile time does not grow with depth.)
PROBE_MOE_LAYERS = (4, 6)
# The plan never runs what it compiles: skipping LLVM's optimizations halves XLA:CPU's
# compile time and leaves buffer assignment (memory_analysis) unchanged (measured).
COMPILE_ONLY_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true")


def compile_only_xla_flags(xla_flags: str) -> str:
    """XLA_FLAGS for a planning process: no forced device count (jax_num_cpu_devices
    sets it), fast compiles. Must be in the environment before jax's backends start."""
    kept = [f for f in xla_flags.split() if not f.startswith(
        "--xla_force_host_platform_device_count")]
    return " ".join(kept + [f for f in COMPILE_ONLY_FLAGS if f not in kept])


def replicated_params(state: train.TrainState, mesh) -> list[dict]:
    """Parameters copied over a mesh axis (no dimension divides it), largest first.

    Their optimizer state is copied the same way; the rules cannot shard them further.
    """
    mesh_shape = sharding.mesh_shape_of(mesh)
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        axes = sharding.replicated_over(leaf.sharding.spec, mesh_shape)
        if axes:
            name = param_table.key_names(path)[-1]  # e.g. every norm's `scale` together
            row = found.setdefault((name, axes), {"name": name, "over": "+".join(axes),
                                                  "bytes": 0})
            row["bytes"] += offload.per_device_bytes(leaf)
    return sorted(found.values(), key=lambda r: -r["bytes"])


def plan(cfg: Config, *, name: str = "config", probe_moe_layers: tuple[int, int] | None = None,
         machine: hardware.Hardware = hardware.GH200_JUPITER, target: str = "cpu",
         corpus: str | None = None, attention_batches: int = attention_cost.DEFAULT_BATCHES,
         documents_model: str = documents.DEFAULT, block_skipping: bool = False
         ) -> dict[str, Any]:
    """The plan report (a JSON-able dict) for `cfg` compiled for `target`: "cpu" (as many
    fake CPU devices as its mesh) or a GPU of gpu_target.TARGETS (a topology of as many
    compile-only GPUs, 4 per host). Attention is priced from `attention_batches` global
    batches of `corpus`'s document lengths (a prepared corpus), else of `documents_model`
    (documents.py: Dolma's measured mix by default); `block_skipping`: price the backward
    at the forward's tile pairs, as the recipe's attention runs (compare.py)."""
    if corpus is None:
        attention = attention_cost.slowest_pairs(cfg, batches=attention_batches,
                                                 documents_model=documents_model,
                                                 block_skipping=block_skipping)
    else:
        attention = attention_cost.slowest_pairs(
            cfg, attention_cost.corpus_lengths(corpus), source=f"corpus {corpus}",
            batches=attention_batches, block_skipping=block_skipping)
    n_moe = cfg.model.n_moe_layers
    gpu = target != "cpu"
    if (probe_moe_layers is None and not gpu and not cfg.execution.scan_layers
            and n_moe > max(PROBE_MOE_LAYERS)):
        probe_moe_layers = PROBE_MOE_LAYERS  # unrolled: compile time grows with depth
    mesh = gpu_program.plan_mesh(cfg, target) if gpu else sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)  # shapes only: cheap at full depth
    state = trainer.abstract_state
    compiled = {"moe_layers": n_moe, "mode": "full depth", "error": None,
                "program": f"XLA:GPU for {gpu_target.TARGETS[target].name}" if gpu
                else "XLA:CPU"}
    facts = None
    start = time.perf_counter()
    try:
        if gpu:
            numbers, largest, facts = gpu_program.measure(cfg, mesh, attention, machine)
        elif probe_moe_layers:
            a, b = sorted(probe_moe_layers)
            at_a, _ = measure(with_moe_layers(cfg, a), mesh)
            at_b, largest = measure(with_moe_layers(cfg, b), mesh)
            numbers = with_exact_update(extrapolate(at_a, at_b, a, b, n_moe),
                                        measure_update(cfg, mesh))
            compiled.update(mode=f"extrapolated per MoE layer from {a} and {b} MoE layers",
                            probe_moe_layers=[a, b])
        else:
            numbers, largest = measure(cfg, mesh)
    except Exception as e:  # a compile that cannot finish is a result the user must see
        numbers, largest = {}, {"step": [], "forward_backward": []}
        compiled["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    compiled["seconds"] = time.perf_counter() - start
    out = report(cfg, name, state, replicated_params(state, mesh), numbers, largest, compiled,
                 machine, target=target, attention=attention,
                 classes=facts.get("kernel_classes") if facts else None)
    if facts is not None:
        host_state = sum(k.get("pinned_host", 0) for k in state_bytes(state).values())
        out["kernels"] = gpu_program.kernel_checks(cfg, numbers, facts, host_state,
                                                out["collectives"])
        out["hbm_traffic"] = facts["hbm_traffic"]
        # the GPU program's kernels by class: the largest GEMM shapes and windows
        out["kernel_classes"] = kernel_classes.trimmed(facts["kernel_classes"])
    return out


def _rows(numbers: dict[str, float], prefix: str, machine, cfg: Config) -> list[dict]:
    """The collectives of one program with their seconds on each link they cross: the
    part between nodes (from their replica groups, links.py) over InfiniBand, the rest
    over the node's NVLink."""
    fields = {"bytes": "bytes_per_device", "count": "count", "ib_bytes": "infiniband_bytes"}
    rows = {}
    for key, value in numbers.items():
        if key.startswith(prefix + "/"):
            op, axes, dtype, field = key[len(prefix) + 1:].split("/")
            rows.setdefault((op, axes, dtype), {"op": op, "axes": axes, "dtype": dtype})[
                fields[field]] = value
    # at the expected link efficiencies (the estimate prices every end of the range)
    nvlink = machine.nvlink_bandwidth(cfg.mesh.node_group - 1) * machine.nvlink.expected
    network = machine.network_bandwidth * machine.infiniband.expected
    out = []
    for row in rows.values():
        row["count"] = int(round(row.get("count", 0)))
        total = row.setdefault("bytes_per_device", 0.0)
        between = min(total, row.setdefault("infiniband_bytes", 0.0))
        row["nvlink_bytes"] = total - between
        row["link"] = ("infiniband" if between >= total and total else
                       "nvlink+infiniband" if between else "nvlink")
        row["nvlink_s"] = row["nvlink_bytes"] / nvlink
        row["infiniband_s"] = between / network
        row["seconds"] = row["nvlink_s"] + row["infiniband_s"]
        out.append(row)
    return sorted(out, key=lambda r: -r.get("bytes_per_device", 0.0))


def _xla(numbers: dict[str, float], prefix: str) -> dict[str, float]:
    return {k.split("/")[1]: v for k, v in numbers.items() if k.startswith(prefix + "/")}


def report(cfg: Config, name: str, state, replicated: list[dict], numbers: dict[str, float],
           largest: dict[str, list[dict]], compiled: dict, machine: hardware.Hardware,
           target: str = "cpu", attention: dict[str, Any] | None = None,
           classes: dict | None = None) -> dict[str, Any]:
    """The plan report from a compile's numbers; `classes`: the GPU program's kernels by
    class (kernel_classes.summary), which the estimate prices shape by shape."""
    n_dev = cfg.mesh.n_devices
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    held = state_bytes(state)
    host_state = sum(k.get("pinned_host", 0) for k in held.values())
    all_state = sum(sum(k.values()) for k in held.values())
    grads = sum(held["params"].values())  # gradients have the parameters' shapes and dtypes
    act_host = numbers.get("host/activations", 0.0)
    host_total = host_state + act_host
    # XLA:CPU counts host-kind arguments and offloaded saves as its own memory: take them out.
    step, fb, upd = (_xla(numbers, p) for p in ("memory", "memory_fb", "memory_update"))
    step_device = fb_device = update_device = None
    if step and target == "cpu":
        step_device = (step["argument"] - host_state + max(0.0, step["output"] - step["alias"])
                       + step["temp"] - act_host + step["generated_code"])
        # forward+backward as its own program: all parameters on device for the pass, the
        # gradients it returns, and the optimizer state that stays on device meanwhile
        fb_device = (fb["argument"] + fb["output"] + fb["temp"] - act_host + fb["generated_code"]
                     + held["optimizer_state"].get("device", 0)
                     + held["other_state"].get("device", 0))
        # the update alone: parameters, gradients and optimizer state all on device
        update_device = (upd["argument"] + upd["output"] - upd["alias"] + upd["temp"]
                         + upd["generated_code"])
        if compiled.get("probe_moe_layers"):
            # Temporaries are a peak over the program's phases, and the phase at the peak
            # can change with depth: a step needs at least what each of its phases needs.
            step_device = max(step_device, fb_device, update_device)

    # Analytic FLOPs of the GPU the step waits for: every GPU's matmuls, and the attention
    # pairs of the slowest rank or node (attention_cost.py) — expected over sampled
    # batches; p95 and the worst case (one document per row) beside it.
    if attention is None:
        attention = attention_cost.slowest_pairs(cfg)
    gpu_pairs = attention["pairs_per_gpu"]

    def model_flops_at(pairs_per_gpu: float) -> float:
        return flops.train_flops(cfg.model, tokens, pairs_per_gpu * n_dev) / n_dev

    model_flops = model_flops_at(gpu_pairs["expected"])
    attention_flops = {k: model_flops_at(v) - model_flops_at(0.0) for k, v in gpu_pairs.items()}
    recompute = (numbers["flops/hlo_loss"] / numbers["flops/hlo_loss_no_remat"]
                 if numbers.get("flops/hlo_loss_no_remat") else 1.0)
    optimizer_flops = numbers.get("flops/optimizer", 0.0)
    step_rows = _rows(numbers, "collective/step", machine, cfg)
    partitioner_rows = _rows(numbers, "collective/partitioner", machine, cfg)
    gpu_rows = _rows(numbers, "collective/compiled", machine, cfg)
    gpu = target != "cpu"
    if gpu:
        hbm_peak, host_peak, memory = _gpu_memory(numbers, largest)
        host_total = host_peak if numbers else host_total
        memory.update(state=held, replicated_params=replicated, gradients=grads,
                      activations_offloaded=act_host)
        budget = {"hbm_bytes": gpu_target.TARGETS[target].hbm_budget_bytes,
                  "host_bytes": machine.host_bytes}
        charged = gpu_rows  # the whole program, as the GPU compiler emits it
    else:
        hbm_peak, host_peak = step_device, host_total
        budget = {"hbm_bytes": gpu_target.TARGETS["gh200"].hbm_budget_bytes,
                  "host_bytes": machine.host_bytes}
        charged = step_rows + partitioner_rows
    update_bytes = 2 * all_state + grads  # the update reads state and gradients, writes state

    def work(pairs: str, rows: list[dict], optimizer: float = optimizer_flops):
        if classes:
            return step_work.from_program(
                cfg, classes, attention, rows, update_bytes=update_bytes, pairs=pairs,
                memory_bytes=numbers.get("hbm/non_gemm_priced", 0.0), critical=numbers)
        return step_work.from_config(cfg, attention, rows, tokens_per_device=tokens / n_dev,
                                     optimizer_flops=optimizer, host_bytes=host_total,
                                     update_bytes=update_bytes, pairs=pairs)

    def estimate(pairs: str, rows: list[dict], flops_of_model: float, **kw):
        done = step_time.estimate(work(pairs, rows, **kw), machine,
                                  tokens_per_device=tokens / n_dev, model_flops=flops_of_model)
        return {k: v for k, v in done.items()
                if k not in ("by_class", "range", "gemms", "lines", "ceilings")}, done

    as_compiled, priced = estimate("expected", charged, model_flops)
    worst_case, worst_priced = estimate("worst_case", charged,
                                        model_flops_at(gpu_pairs["worst_case"]))
    by_class = priced["by_class"]
    executed = sum(c["flops"] for c in by_class.values())
    fits = (hbm_peak is not None and hbm_peak <= budget["hbm_bytes"]
            and host_peak is not None and host_peak <= budget["host_bytes"])
    budget["host_bytes_strict"] = hardware.HOST_BYTES_STRICT  # 120 GB per node, 30 per GPU
    for row, source in [(r, "step") for r in step_rows] + [
            (r, "partitioner") for r in partitioner_rows] + [(r, "compiled") for r in gpu_rows]:
        row["source"] = source
    if not gpu:
        memory = _cpu_memory(held, replicated, grads, act_host, host_total, step, fb, upd,
                             step_device, fb_device, update_device, largest, machine)
    return {
        "config": name, "target": target, "devices": n_dev,
        "budget": budget, "fits": fits,
        "fits_strict_host": fits and host_peak <= hardware.HOST_BYTES_STRICT,
        "per_device": {"hbm_peak_bytes": hbm_peak, "host_peak_bytes": host_peak},
        "mesh": {"data": cfg.mesh.data, "expert": cfg.mesh.expert},
        "tokens_per_device": tokens / n_dev, "seq_len": cfg.data.seq_len,
        "layers": cfg.model.n_layers, "compiled": compiled, "machine": dataclasses.asdict(machine),
        "memory": memory,
        "flops": {"model": model_flops, "recompute_factor": recompute,
                  "optimizer": optimizer_flops,
                  # the matmul FLOPs the estimate prices: the classes' (step_work.py)
                  "executed": executed,
                  "by_class": {k: c["flops"] for k, c in by_class.items() if c["flops"]},
                  "executed_worst_case": sum(c["flops"] for c in
                                             worst_priced["by_class"].values()),
                  # the model's FLOPs × the measured recompute, + the optimizer's
                  "executed_analytic": model_flops * recompute + optimizer_flops,
                  # of the model FLOPs: the slowest GPU's attention pairs × 6 per layer/head
                  "attention_per_gpu": attention_flops,
                  "attention_kernels": attention_kernels(cfg),
                  "hlo_matmul_loss": numbers.get("flops/hlo_loss"),
                  "xla_cost_analysis": numbers.get("flops/xla_cost_analysis")},
        "collectives": charged,
        "exchange": exchange.summary(cfg, numbers, machine),
        "kernels": [],
        # the GPU program's non-matmul kernels, bytes per step (hbm_traffic.py); GPU only
        "hbm_traffic": None,
        # the GPU program's kernels by class (kernel_classes.py); GPU only
        "kernel_classes": None,
        # analytic (the compiled numbers above include it): MuonClip's measurement and clip
        "qk_clip": qk_clip.cost(cfg.model, cfg.optim.qk_clip_threshold, n_dev, tokens / n_dev,
                                pad_multiple=cfg.execution.param_pad_multiple),
        "attention": attention,
        "estimate": {
            # at the expected slowest GPU's attention (attention_cost.py)
            "tokens_per_s_per_gpu": as_compiled["tokens_per_s_per_gpu_overlapped"],
            "basis": f"attention of the expected slowest {attention['slowest_unit']} over "
                     f"{attention['batches']} sampled batches ({attention['documents']})",
            "as_compiled": as_compiled,
            # the step per class of kernel at each end of the efficiency ranges
            "by_class": by_class,
            # what the overlap model leaves out, each with its source (step_time.py)
            "lines": priced["lines"],
            "range": priced["range"],
            # the same step with InfiniBand, or both links, free: what fewer bytes can buy
            "ceilings": priced["ceilings"],
            # the GEMM shapes and windows that take longest, each with its efficiency
            "gemms": priced["gemms"],
            "overlap_model": step_time.OVERLAP_MODEL,
            "calibration": machine.calibration,
            "efficiencies": machine.efficiencies(),
            # every row one document: the bound no batch can exceed
            "worst_case": worst_case,
            # what the same step would take if the optimizer update stayed on each shard
            "update_kept_local": None if gpu else estimate(
                "expected", step_rows, model_flops, optimizer=0.0)[0],
        },
    }


def attention_kernels(cfg: Config) -> dict[str, Any]:
    """The share of a causal row's query-key pairs the attention kernels run, forward
    (tokamax skips key tiles before each 128-query tile's document start) and backward
    (chunk pairs, flash_backward.py), for the row the estimate assumes (one document) and
    for 64 documents of equal length: what skipping other documents is worth."""
    s = cfg.data.seq_len
    chunk = attention.backward_chunk_for(s, cfg.execution.attention_backward_chunk)
    padded = -(-s // (chunk or 1)) * (chunk or 1) if chunk else s
    fractions = functools.partial(flash_backward.kernel_pair_fraction, seq_len=padded,
                                  chunk=chunk or padded, tile=attention.LIBRARY_SEQ_MULTIPLE)
    return {"backward_chunk": chunk, "one_document_per_row": fractions([s]),
            "64_documents_per_row": fractions([s // 64] * 64 + [s % 64] * bool(s % 64))}


def _cpu_memory(held, replicated, grads, act_host, host_total, step, fb, upd, step_device,
                fb_device, update_device, largest, machine) -> dict[str, Any]:
    """The XLA:CPU program's memory, corrected for what XLA:CPU ignores (report())."""
    return {
        "state": held, "replicated_params": replicated, "gradients": grads,
        "activations_offloaded": act_host, "host_total": host_total,
        "fits_host": host_total <= machine.host_bytes,
        "step": {"xla_cpu": step, "device_total": step_device,
                 "fits_device": step_device is not None and step_device <= machine.hbm_bytes,
                 "largest_buffers": largest["step"]},
        "forward_backward": {"xla_cpu": fb, "device_total": fb_device,
                             "fits_device": fb_device is not None
                             and fb_device <= machine.hbm_bytes,
                             "largest_buffers": largest["forward_backward"]},
        "update": {"xla_cpu": upd, "device_total": update_device,
                   "fits_device": update_device is not None
                   and update_device <= machine.hbm_bytes},
    }


def _gpu_memory(numbers: dict[str, float], largest) -> tuple[float | None, float | None, dict]:
    """(HBM peak, host peak, detail) of the GPU program: XLA:GPU's own accounting, memory
    kinds apart. Peak = arguments + outputs not aliased to them + temporaries."""
    mem = _xla(numbers, "memory")
    if not mem:
        return None, None, {"step": {"xla_gpu": {}, "largest_buffers": []}}
    hbm = (mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
           + mem["generated_code"])
    host = (mem["host_argument"] + mem["host_output"] - mem["host_alias"] + mem["host_temp"])
    return hbm, host, {"step": {"xla_gpu": mem, "largest_buffers": largest["step"]}}
