"""The step compiled for a GPU target (gpu_target.py) and read: the program a GPU runs.

Where the XLA:CPU plan (step_compile.py) needs corrections — bf16 widened to f32, memory
kinds ignored, the blocked expert matmul, dense exchange buffers — the GPU compiler's own
answers are used as they are:
- memory: `memory_analysis()` per device, HBM and host (pinned_host) columns apart;
- collectives: every one of the optimized GPU HLO (async starts, combined ops per dtype),
  the links of each from its replica groups, the MoE's ragged exchanges at the rows
  routing is expected to fill and its overflow rounds at their expected trips (none),
  their buffer-size bound apart;
- kernels: what each GPU-only path compiled to (`kernel_checks`);
- FLOPs: matmuls of the *lowered* programs (the optimized text hides GEMMs in cuBLAS
  calls); the update's re-laid Newton–Schulz is spread evenly (muon_sharded.py pads each
  stack to a multiple of the devices), so its global matmuls / devices is per device.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from europa_jax.config import Config
from europa_jax.model import attention, kernels
from europa_jax.model.experts import moe, moe_dispatch
from europa_jax.parallel import sharding
from europa_jax.plan.price import critical_path, exchange, hardware, step_time
from europa_jax.plan.program import gpu_target, hbm_traffic, hlo_program, hlo_report, kernel_classes
from europa_jax.plan.report_text import size
from europa_jax.plan.program.step_compile import (TOP_BUFFERS, collective_numbers, lower_loss, lower_update,
                                          lowered_hlo, offloaded_activation_bytes, without_remat)
from europa_jax.train import train

MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code", "host_argument",
                 "host_output", "host_alias", "host_temp")
HOST_MEMORY_SPACE = ":S(5)}"  # GPU layouts mark pinned host buffers with memory space 5


def measure(cfg: Config, mesh, attention_pairs: dict | None = None,
            machine: hardware.Hardware = hardware.GH200_JUPITER
            ) -> tuple[dict[str, float], dict[str, list[dict]], dict]:
    """Compile the step of `cfg` for the GPU mesh: numbers (flat, as step_compile's),
    the largest buffers, and what the kernel checks read from the program; loops whose
    trip count is data at `expected_trips(cfg, attention_pairs)`; `machine`'s peaks
    say what the kernels beside an in-layer exchange cover of it."""
    trainer = train.build_trainer(cfg, mesh)
    state, batch = trainer.abstract_state, train.abstract_batch(trainer)
    # FLOPs are the lowered matmuls; a library attention kernel is one custom call that
    # shows none, so the counts use the blockwise kernel (the same math, matmuls visible)
    counted = train.build_trainer(visible_attention(cfg), mesh)
    plain = train.build_trainer(visible_attention(without_remat(cfg)), mesh)
    plain_state = plain.abstract_state  # eager key: before a GPU is the default device
    with gpu_target.lowering(mesh):
        traced = train.jit_train_step(trainer).trace(state, batch)
        lowered = traced.lower()
        loss_flops = hlo_report.dot_flops(lowered_hlo(lower_loss(counted, state, batch)))
        plain_flops = hlo_report.dot_flops(lowered_hlo(lower_loss(plain, plain_state, batch)))
        update_flops = hlo_report.dot_flops(lowered_hlo(lower_update(trainer, state)))
        compiled = gpu_target.compile_lowered(lowered, mesh)
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    numbers = {f"memory/{f}": float(getattr(mem, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS}
    numbers.update({
        "flops/hlo_loss": loss_flops, "flops/hlo_loss_no_remat": plain_flops,
        "flops/optimizer": update_flops / mesh.devices.size,
        "host/activations": float(offloaded_activation_bytes(traced.jaxpr.jaxpr)),
    })
    trips = expected_trips(cfg, attention_pairs)
    found = hlo_report.collectives(text, mesh, devices_per_node=cfg.mesh.devices_per_node,
                                   dynamic_trips=trips)
    # a ragged exchange sends the filled rows of its buffers only: at the expected fill
    numbers.update(collective_numbers(hlo_report.summarize(
        [c.scaled(exchange_fill(c, cfg)) if c.op == "ragged-all-to-all" else c
         for c in found]), "collective/compiled"))
    bound = [c for c in hlo_report.collectives(text, mesh,
                                               devices_per_node=cfg.mesh.devices_per_node)
             if c.op == "ragged-all-to-all"]  # every buffer full, each overflow loop once
    numbers["exchange/buffer_bytes"] = sum(c.bytes_per_device for c in bound)
    numbers["exchange/buffer_infiniband_bytes"] = sum(c.infiniband_bytes for c in bound)
    largest = {"step": device_buffers(text, TOP_BUFFERS)}
    facts = program_facts(text, cfg)
    # every launch in one class (kernel_classes.py); the memory-bound ones' bytes
    mod = hlo_program.Module(text)
    classified = kernel_classes.kernels(mod, trips)
    facts["kernel_classes"] = kernel_classes.summary(classified, grouped_fill=window_fill(cfg),
                                                     window_experts=window_experts(cfg))
    memory_bound = [hbm_traffic.kernel_bytes(mod, k.launch)
                    for k in classified if k.kind == "memory_bound"]
    facts["hbm_traffic"] = hbm_traffic.summary(memory_bound)
    numbers["hbm/non_gemm_priced"] = hbm_traffic.priced_bytes(facts["hbm_traffic"])
    numbers.update(critical_numbers(cfg, found, mod, classified, trips, mesh, machine,
                                    memory_bound))
    return numbers, largest, facts


def critical_numbers(cfg: Config, found, mod, classified, trips, mesh,
                     machine: hardware.Hardware = hardware.GH200_JUPITER,
                     memory_bound: list | None = None) -> dict[str, float]:
    """What the step waits for besides its kernels' work (critical_path.py), as the
    flat `critical/…` numbers step_work.critical_fields reads; `found`: the program's
    collectives at the expected trips; `memory_bound`: the memory-bound kernels' bytes
    (hbm_traffic.kernel_bytes of those in `classified`) when already read."""
    first = "dense_layers" if cfg.model.n_dense_layers else "moe_layers"
    fill = lambda c: exchange_fill(c, cfg)
    phases = critical_path.phase_bytes(found, first, fill=fill)
    out = {f"critical/{name}/{link}": value for name, row in phases.items()
           for link, value in row.items()}
    out["critical/launches"] = sum(k.runs for k in classified)
    out["critical/loop_trips"] = critical_path.loop_trips(mod, trips)
    nvlink = machine.nvlink_bandwidth(cfg.mesh.node_group - 1)

    def collectives_of(line: str, times: float) -> list[hlo_report.Collective]:
        return [c.scaled(fill(c)) if c.op == "ragged-all-to-all" else c
                for c in hlo_report.line_collectives(line, mesh, times,
                                                     cfg.mesh.devices_per_node)]

    covered = critical_path.covered_exchange_bytes(
        mod, collectives_of, kernel_peak_seconds(mod, classified, machine, window_fill(cfg),
                                                 memory_bound),
        lambda c: ((c.bytes_per_device - c.infiniband_bytes) / nvlink
                   + c.infiniband_bytes / machine.network_bandwidth),
        first, trips)
    out["critical/in_layer_covered/nvlink_bytes"] = covered[0]
    out["critical/in_layer_covered/infiniband_bytes"] = covered[1]
    return out


def kernel_peak_seconds(mod, classified, machine: hardware.Hardware, grouped_fill: float,
                        memory_bound: list | None = None):
    """instruction name → one run's seconds at the peak of what bounds it (GEMM FLOPs at
    their math's peak, a grouped matmul's at its expected fill, a memory-bound kernel's
    bytes — `memory_bound`'s, else read here — at HBM's peak); 0 for what is priced from
    elsewhere (attention's pairs, copies to the host, collectives)."""
    if memory_bound is None:
        memory_bound = [hbm_traffic.kernel_bytes(mod, k.launch)
                        for k in classified if k.kind == "memory_bound"]
    peak = {kb.name: kb.bytes_per_run / machine.hbm_bandwidth for kb in memory_bound}
    for k in classified:
        if k.kind == "dense_gemm":
            peak[k.launch.name] = k.flops_per_run / (
                machine.bf16_flops * step_time.peak_share(machine, k.math))
        elif k.kind == "grouped_gemm":
            peak[k.launch.name] = k.flops_per_run * grouped_fill / machine.bf16_flops
    return lambda name: peak.get(name, 0.0)


def _windows(cfg: Config):
    """How the GPU program visits a device's experts (moe.local_experts): (its experts,
    the Windows of the library path or None)."""
    e_local = cfg.model.n_routed_experts // cfg.mesh.expert
    how = moe.local_experts(moe.dispatch_tokens(cfg), cfg.model, dataclasses.replace(
        cfg.execution, grouped_matmul=kernels.grouped_matmul_impl(cfg.execution, "gpu")),
        e_local)
    return e_local, how.windows


def window_fill(cfg: Config) -> float:
    """The share of an expert window's rows routing is expected to fill: a device
    receives t·k copies on average (t tokens dispatched at once, top-k), split over its
    expert groups, and a window is `moe_buffer_factor` × that, in whole kernel tiles."""
    _, windows = _windows(cfg)
    if windows is None:
        return 1.0
    return min(1.0, moe.dispatch_tokens(cfg) * cfg.model.top_k / windows.groups
               / windows.window)


def window_experts(cfg: Config) -> int:
    """The experts one window's rows reach: its group's (expert_windows.py)."""
    e_local, windows = _windows(cfg)
    return e_local // windows.groups if windows else e_local


def expected_trips(cfg: Config, attention_pairs: dict | None = None):
    """Trip counts the plan expects of the step's loops whose count is data, under its own
    assumptions: the attention backward's key chunk j pairs with as many later query
    chunks as a row's documents make it on average — from `attention_pairs`
    (attention_cost.slowest_pairs: the backward pairs the costliest unit's GPU runs, as
    the FLOPs are priced), else one document per row ((X − 1)/2 on average over j); MoE
    buffers sized at `moe_buffer_factor` × their expected fill, so no overflow round or
    window runs. Under `block_skipping` (the recipe's attention, priced on our program) the
    backward visits its blocks in one kernel: no pair loop runs."""
    s, chunk = cfg.data.seq_len, attention.backward_chunk_for(
        cfg.data.seq_len, cfg.execution.attention_backward_chunk)
    chunks = -(-s // chunk) if chunk else 1
    off_diagonal = (chunks - 1) / 2
    if attention_pairs and attention_pairs.get("block_skipping"):
        off_diagonal = 0.0
    elif attention_pairs and chunk:
        # a GPU runs its rows' pairs (a node's rows for a quarter of the heads under
        # context parallelism: the same count per GPU as its own rows)
        rows = max(1, cfg.data.global_batch_size // cfg.mesh.n_devices)
        per_row = attention_pairs["kernel_pairs_per_gpu"]["backward"]["expected"] / rows
        diagonal = chunks * chunk * (chunk + 1) / 2
        off_diagonal = max(0.0, per_row - diagonal) / chunk**2 / chunks

    def trips(op_name: str) -> float:
        if "/attention/" in op_name:
            return off_diagonal
        if "/moe/" in op_name:
            return 0.0
        return 1.0

    return trips


def exchange_fill(c: hlo_report.Collective, cfg: Config) -> float:
    """The expected fill of a ragged MoE exchange's buffers: a two-stage dispatch's first
    stage (all of it between nodes) at the nodes a token visits, any other at the rows
    of round 0 (moe_dispatch.py)."""
    ep, per_node = cfg.mesh.expert, exchange.two_stage_nodes(cfg)
    if per_node and c.bytes_per_device and c.infiniband_bytes >= c.bytes_per_device:
        return moe_dispatch.expected_node_fill(cfg.model, ep, per_node)
    return moe_dispatch.expected_fill(moe.dispatch_tokens(cfg), cfg.model, cfg.execution, ep,
                                      per_node)


def visible_attention(cfg: Config) -> Config:
    return dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution,
                                                                  attention="blockwise"))


# the MTP modules' op names (mtp.py: scanned `mtp_layers`, unrolled `mtp_layers_<k>`)
MTP_SCOPE = "/mtp_layers"
# what an MTP module's block runs, as the main model's MoE blocks do
MTP_KERNEL_CLASSES = ("grouped_gemm", "attention_forward", "attention_backward")


def program_facts(text: str, cfg: Config) -> dict:
    """What the kernel checks need from an optimized GPU program's text."""
    calls: dict[str, int] = {}  # custom calls by library kernel name, else by target
    library: dict[str, dict[str, int]] = {}  # kernel class → {kernel name: calls}
    mtp: dict[str, int] = {}  # kernel class → calls inside the MTP modules
    for line in text.splitlines():
        if " custom-call(" not in line:
            continue
        kernel = kernel_classes.library_kernel(line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        name = kernel[1] if kernel else (target.group(1) if target else "?")
        calls[name] = calls.get(name, 0) + 1
        if kernel:
            library.setdefault(kernel[0], {}).setdefault(name, 0)
            library[kernel[0]][name] += 1
            if MTP_SCOPE in line:
                mtp[kernel[0]] = mtp.get(kernel[0], 0) + 1
    host_copies = sum(1 for line in text.splitlines()
                      if re.search(r"= \S.* copy-start\(", line) and HOST_MEMORY_SPACE in line)
    return {"custom_calls": calls, "library_kernels": library, "mtp_kernels": mtp,
            "host_copies": host_copies,
            "dense_expert_buffers": dense_expert_buffers(text, cfg),
            "dense_attention_buffers": dense_attention_buffers(text, cfg)}


def dense_attention_buffers(text: str, cfg: Config) -> list[dict]:
    """Buffers of the attention layers ending in [S, S] (a mask or score matrix), which
    flash attention exists to avoid: 4.3 GB per head at 65,536 tokens in bf16."""
    s = cfg.data.seq_len
    return [b for b in hlo_report.largest_buffers(text, None)
            if b["shape"][-2:] == [s, s] and "/attention/" in b["source"]]


def dense_expert_buffers(text: str, cfg: Config) -> list[dict]:
    """Buffers shaped like a dense grouped matmul's expansion — every row of an expert
    window times every expert of its group, [.., E_group, .., W, ..] with at least
    E_group·W·min(D, F) elements (what jax.lax.ragged_dot makes in jaxlib 0.10.2 and 0.12.0.1) — which
    a grouped-matmul kernel must avoid."""
    e_local = cfg.model.n_routed_experts // cfg.mesh.expert
    tokens = moe.dispatch_tokens(cfg)
    windows = moe.local_experts(tokens, cfg.model, dataclasses.replace(
        cfg.execution, grouped_matmul=kernels.grouped_matmul_impl(cfg.execution, "gpu")),
        e_local).windows
    if windows is None or windows.groups == e_local:
        return []  # a group of one expert is a plain matmul: nothing to expand
    experts, rows = e_local // windows.groups, windows.window
    least = experts * rows * min(cfg.model.d_model, cfg.model.expert_ffn_dim)
    return [b for b in hlo_report.largest_buffers(text, None)
            if experts in b["shape"] and rows in b["shape"] and math.prod(b["shape"]) >= least]


def device_buffers(text: str, n: int) -> list[dict]:
    """The `n` largest buffers in HBM, then the largest in host memory (to tell them apart)."""
    every = hlo_report.largest_buffers(text, None)
    return ([b for b in every if b["memory"] == "device"][:n]
            + [b for b in every if b["memory"] == "host"][:2])


def kernel_checks(cfg: Config, numbers: dict[str, float], facts: dict, host_state: int,
                  exchange_rows: list[dict]) -> list[dict]:
    """Whether each GPU-only path of the step compiled to what it should."""
    impl = kernels.grouped_matmul_impl(cfg.execution, "gpu")
    library = facts["library_kernels"].get("grouped_gemm", {})
    dense = facts["dense_expert_buffers"]
    checks = [{
        "path": "grouped matmul", "configured": impl,
        "expected": "a grouped-matmul kernel, no [experts, rows, width] buffer",
        "found": (", ".join(f"{k} ×{v}" for k, v in library.items()) or "no kernel call")
        + "; " + (", ".join(f"{b['dtype']}{b['shape']}" for b in dense[:2])
                  or "no dense expert expansion"),
        "ok": bool(library) and not dense,
    }]
    ragged = [r for r in exchange_rows if r["op"] == "ragged-all-to-all"]
    checks.append({
        "path": "MoE token exchange", "configured": cfg.comm.expert_exchange,
        "expected": "ragged all-to-all over 'expert' (or parts of it) only",
        "found": ", ".join(sorted({f"{r['op']} over {r['axes']} ({r['dtype']})" for r in ragged}))
        or "no ragged all-to-all",
        "ok": bool(ragged) and all(r["axes"].split(":")[0] == "expert" for r in ragged),
    })
    attention = {**facts["library_kernels"].get("attention_forward", {}),
                 **facts["library_kernels"].get("attention_backward", {})}
    square = facts["dense_attention_buffers"]
    checks.append({
        "path": "attention", "configured": kernels.attention_impl(cfg.execution, "gpu"),
        "expected": "a library flash-attention kernel, no [seq, seq] buffer",
        "found": (", ".join(f"{k} ×{v}" for k, v in attention.items())
                  or "XLA loops of the pure-JAX blockwise kernel") + "; "
        + (", ".join(f"{b['dtype']}{b['shape']}" for b in square[:2])
           or "no [seq, seq] buffer"),
        "ok": bool(attention) and not square,
    })
    if cfg.model.mtp_layers:
        mtp = facts["mtp_kernels"]
        checks.append({
            "path": "multi-token prediction", "configured": f"{cfg.model.mtp_layers} module(s)",
            "expected": "the MTP blocks on the library kernels of the main blocks: "
                        + ", ".join(MTP_KERNEL_CLASSES),
            "found": ", ".join(f"{k} ×{v}" for k, v in sorted(mtp.items()))
            or "no library kernel in the MTP modules",
            "ok": all(mtp.get(k) for k in MTP_KERNEL_CLASSES),
        })
    if host_state or numbers.get("host/activations"):
        host_args = numbers["memory/host_argument"]
        host_temp = numbers["memory/host_temp"]
        act = numbers.get("host/activations", 0.0)
        checks.append({
            "path": "host offload", "configured": f"state {size(host_state)}, "
                                                   f"activations {size(act)}",
            "expected": "state arguments in host memory, moved by copies; offloaded "
                        "activations as host temporaries of their size (±5 %)",
            "found": f"host arguments {size(host_args)}, host temporaries {size(host_temp)}, "
                     f"{facts['host_copies']} host copies",
            "ok": host_args == host_state and facts["host_copies"] > 0
            and (not act or math.isclose(host_temp, act, rel_tol=0.05)),
        })
    return checks


def plan_mesh(cfg: Config, target_name: str) -> jax.sharding.Mesh:
    mesh = gpu_target.mesh(cfg.mesh, gpu_target.TARGETS[target_name])
    assert sharding.mesh_platform(mesh) == "gpu"
    return mesh
