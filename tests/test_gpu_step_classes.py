"""The tiny step compiled for 8 GH200s, read as the plan's estimate reads it: every kernel
in exactly one class (plan/program/kernel_classes.py), the GEMMs' FLOPs those the program was
written with, and the plan's per-class table and range (plan/price/step_time.py)."""

import re

import pytest

from europa_jax.parallel import offload
from europa_jax.plan.price import critical_path
from europa_jax.plan.program import (gpu_program, gpu_target, hlo_program, hlo_report, kernel_classes, step_compile)
from europa_jax.train import train
from test_gpu_target import compile_for_gpu, gpu_cfg, needs_toolchain


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return gpu_cfg(tiny_cfg)


@pytest.fixture(scope="module")
def step_text(cfg):
    return compile_for_gpu(cfg)["text"]  # test_gpu_target's gpu_step: one compile a session


def launching_instructions(text: str) -> dict[str, str]:
    """name → opcode of every fusion and custom call outside the computations fused into
    a kernel, found by a plain reading of the text (not the plan's walker)."""
    text = text.replace("%", "")
    fused = set(re.findall(r" fusion(?:-start)?\(.*?calls=([\w.\-]+)", text))
    found, comp = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            comp = header.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT\s+)?([\w.\-]+)\s*=.*?\s(fusion|fusion-start|custom-call)\(",
                     line)
        if m and comp not in fused and 'custom_call_target="AllocateBuffer"' not in line:
            found[m.group(1)] = m.group(2)
    return found


@pytest.mark.slow
@needs_toolchain
def test_every_fusion_and_library_call_is_in_exactly_one_class(step_text):
    found = kernel_classes.kernels(step_text)
    kinds: dict[str, set] = {}
    for k in found:
        kinds.setdefault(k.launch.name, set()).add(k.kind)
    assert all(len(v) == 1 for v in kinds.values()), {n: v for n, v in kinds.items() if len(v) > 1}
    expected = launching_instructions(step_text)
    classified = {k.launch.name for k in found
                  if k.launch.opcode in ("fusion", "fusion-start", "custom-call")}
    assert set(expected) == classified, set(expected) ^ classified
    by_kind = {kind: sum(1 for v in kinds.values() if kind in v)
               for kind in kernel_classes.CLASSES}
    # the recipe's program has every class: GEMMs, the grouped matmul, flash attention both
    # ways, XLA's fusions, offload copies, NCCL
    assert all(by_kind.values()), by_kind


@pytest.mark.slow
@needs_toolchain
def test_host_copies_move_the_offloaded_state_and_activations_each_way(cfg, step_text):
    """What the offload moves over C2C per step: the optimizer state in and out, each
    layer's input out in the forward and back in the backward."""
    mesh = gpu_target.mesh(cfg.mesh, gpu_target.TARGETS["gh200"])
    held = offload.state_bytes(train.build_trainer(cfg, mesh).abstract_state)
    state = sum(k.get("pinned_host", 0) for k in held.values())
    rows = cfg.data.global_batch_size // cfg.mesh.n_devices
    layer_inputs = cfg.model.n_layers * rows * cfg.data.seq_len * cfg.model.d_model * 2  # bf16
    host = kernel_classes.summary(kernel_classes.kernels(
        step_text, gpu_program.expected_trips(cfg)))["host_copy"]
    assert state > 0
    assert host["to_host_bytes"] == pytest.approx(state + layer_inputs, rel=0.05)
    assert host["to_device_bytes"] == pytest.approx(state + layer_inputs, rel=0.05)


def vector_products(line: str) -> bool:
    """A dot whose result is only its batch (a row-wise dot product): XLA makes it a
    reduction fusion, no GEMM."""
    batch = re.search(r"lhs_batch_dims=\{([0-9,]*)\}", line)
    result = re.search(r"=\s*\w+\[([0-9,]*)\]", line)
    n_batch = len([d for d in batch.group(1).split(",") if d]) if batch else 0
    rank = len([d for d in result.group(1).split(",") if d]) if result else 0
    return n_batch > 0 and rank == n_batch


@pytest.mark.slow
@needs_toolchain
def test_the_programs_gemm_flops_are_the_dots_it_was_written_with(cfg):
    """Forward+backward alone (no conditionals): the cuBLAS calls of the optimized GPU
    program, × their loops' trips, carry exactly the FLOPs of the lowered program's
    matrix products — XLA may merge, split or re-lay them, not drop or add any."""
    mesh = gpu_target.mesh(cfg.mesh, gpu_target.TARGETS["gh200"])
    trainer = train.build_trainer(cfg, mesh)
    with gpu_target.lowering(mesh):
        lowered = step_compile.lower_loss(trainer, trainer.abstract_state,
                                          train.abstract_batch(trainer))
        text = gpu_target.compile_lowered(lowered, mesh).as_text()
    written = hlo_report.dot_flops(step_compile.lowered_hlo(lowered),
                                   keep=lambda line: not vector_products(line))
    summary = kernel_classes.summary(kernel_classes.kernels(text))
    assert written > 0 and summary["dense_gemm"]["flops"] == pytest.approx(written, rel=1e-9)
    shapes = summary["dense_gemm"]["shapes"]
    assert sum(s["flops"] for s in shapes) == pytest.approx(written, rel=1e-9)
    # the routed experts' windows: 2·W·K·N per call, three matrices, forward (twice under
    # remat) and two backward products (input and weight gradients)
    m = cfg.model
    windows = summary["grouped_gemm"]["windows"]
    assert {(w["k"], w["n"]) for w in windows} <= {(m.d_model, m.expert_ffn_dim),
                                                    (m.expert_ffn_dim, m.d_model)}
    assert sum(w["runs"] for w in windows) % m.n_moe_layers == 0


@pytest.mark.slow
@needs_toolchain
def test_the_programs_collectives_fall_in_the_phases_the_estimate_charges(cfg, step_text):
    """The tiny step on 2 nodes × 4: the MoE's and context parallelism's exchanges stay in
    the node and wait on the compute stream; Muon's re-layout crosses nodes after the
    backward; the step's first gathers and last reduce-scatters are there; every phase is
    part of the program's collectives, and the layers' weight traffic is left to overlap."""
    mesh = gpu_target.mesh(cfg.mesh, gpu_target.TARGETS["gh200"])
    per_node = cfg.mesh.devices_per_node
    found = hlo_report.collectives(step_text, mesh, devices_per_node=per_node)
    phases = critical_path.phase_bytes(found, "dense_layers")
    total = sum(c.bytes_per_device for c in found)
    exchange = phases["in_layer_exchange"]
    assert exchange["nvlink_bytes"] > 0 and exchange["infiniband_bytes"] == 0
    assert phases["update_exchange"]["infiniband_bytes"] > 0
    assert all(sum(phases[p].values()) > 0 for p in ("fill", "drain"))
    charged = sum(sum(row.values()) for row in phases.values())
    weights = sum(c.bytes_per_device for c in found
                  if c.op in ("all-gather", "reduce-scatter") and "data" in c.axes)
    assert charged < total and weights > sum(phases["fill"].values()) + sum(
        phases["drain"].values())


@pytest.mark.slow
@needs_toolchain
def test_kernels_the_scheduler_puts_beside_an_exchange_cover_part_of_it(cfg, step_text):
    """Compiled with the run's latency-hiding scheduler, the tiny step has kernels between
    some in-layer exchange's start and its done: they cover a share of the in-layer bytes,
    never more than all of them."""
    mesh = gpu_target.mesh(cfg.mesh, gpu_target.TARGETS["gh200"])
    found = hlo_report.collectives(step_text, mesh, devices_per_node=cfg.mesh.devices_per_node)
    mod = hlo_program.Module(step_text)
    numbers = gpu_program.critical_numbers(cfg, found, mod, kernel_classes.kernels(mod), None,
                                           mesh)
    covered = numbers["critical/in_layer_covered/nvlink_bytes"]
    assert 0 < covered <= numbers["critical/in_layer_exchange/nvlink_bytes"] * (1 + 1e-9)
