"""The GPU program, compiled on this CPU-only machine for 8 GH200s (2 nodes × 4): the
collectives, kernels and memory a GPU run would get (plan/program/gpu_target.py, plan/program/gpu_program.py).

These need the `gpu` extra (the CUDA plugin and ptxas); without it they skip, except in
CI (`EUROPA_JAX_REQUIRE_GPU_COMPILE=1`), where a missing toolchain fails them.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from unittest import mock

import pytest

from europa_jax import cli
from europa_jax.config import ConfigError, MeshConfig
from europa_jax.config_loader import load_config
from europa_jax.parallel import offload, sharding
from europa_jax.plan.program import gpu_program, gpu_target, hbm_traffic, hlo_report, kernel_classes
from europa_jax.train import train
from conftest import REPO, computed_once, config_path, with_settings

MISSING = gpu_target.missing_toolchain()
if MISSING and os.environ.get("EUROPA_JAX_REQUIRE_GPU_COMPILE") == "1":
    raise RuntimeError(f"the GPU compile toolchain is required here; missing: {MISSING}")
needs_toolchain = pytest.mark.skipif(bool(MISSING), reason=f"gpu extra missing: {MISSING}")


def gpu_cfg(cfg, **changes):
    """The recipe's traffic and offload in bf16, as on GH200, with tiny-cpu's widths (the
    test-size ones are below what tokamax's Mosaic GPU kernel tiles: K=16 fails to lower)."""
    widths = load_config(config_path("tiny-cpu.yaml")).model
    # 2 dense layers like europa-952b: XLA:GPU keeps the input of a stack of ONE scanned
    # layer in HBM although the policy offloads it (measured: 3 layers with 1 dense offload
    # 2 layers' inputs; 4 with 2 dense offload all 4)
    # 96 positions: no width of the model is 96 (a [96, 96] buffer can only be attention's),
    # and not a multiple of the 128 the Mosaic attention kernel tiles by (padded)
    return with_settings(dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, seq_len=96),
        model=dataclasses.replace(widths, n_layers=4, n_dense_layers=2),
        execution=dataclasses.replace(cfg.execution, compute_dtype="bfloat16"),
        comm=dataclasses.replace(cfg.comm, weight_gather_dtype="fp8", grad_reduce_dtype="bf16",
                                 expert_exchange_dtype="bf16"),
        offload=dataclasses.replace(cfg.offload, optimizer_state=True,
                                    activations="offload_layer_inputs")), **changes)


def without_offload(cfg):
    return dataclasses.replace(cfg, offload=dataclasses.replace(
        cfg.offload, optimizer_state=False, activations="none"))


def compile_for_gpu(cfg, measured=True):
    """cfg's train step compiled for 8 GH200s, once a session for every file that asks
    (conftest.computed_once: each compile takes minutes on 2 cores): the optimized program's
    text and memory, and with `measured` what the plan reads of it (gpu_program.measure,
    from the same compile)."""
    mesh = gpu_target.mesh(cfg.mesh, gpu_target.TARGETS["gh200"])
    step = computed_once("gh200-step", (cfg, measured), lambda: _compiled(cfg, mesh, measured))
    return {**step, "cfg": cfg, "mesh": mesh,
            "state": train.build_trainer(cfg, mesh).abstract_state}


def _compiled(cfg, mesh, measured: bool) -> dict:
    kept, compile_lowered = [], gpu_target.compile_lowered

    def keep(lowered, mesh_):  # the program measure compiles, kept for its text
        kept.append(compile_lowered(lowered, mesh_))
        return kept[-1]

    if measured:
        with mock.patch.object(gpu_target, "compile_lowered", keep):
            numbers, largest, facts = gpu_program.measure(cfg, mesh)
        (compiled,) = kept
    else:
        numbers = largest = facts = None
        trainer = train.build_trainer(cfg, mesh)
        with gpu_target.lowering(mesh):
            compiled = gpu_target.compile_lowered(train.jit_train_step(trainer).trace(
                trainer.abstract_state, train.abstract_batch(trainer)).lower(), mesh)
    memory = compiled.memory_analysis()
    return {"numbers": numbers, "largest": largest, "facts": facts, "text": compiled.as_text(),
            "memory": {f: getattr(memory, f"{f}_size_in_bytes")
                       for f in gpu_program.MEMORY_FIELDS}}


@pytest.fixture(scope="module")
def gpu_step(tiny_cfg):
    return compile_for_gpu(gpu_cfg(tiny_cfg))


def rows(numbers, mesh=None):
    out = {}
    for key, value in numbers.items():
        if key.startswith("collective/compiled/"):
            op, axes, dtype, field = key.split("/")[2:]
            out.setdefault((op, axes, dtype), {})[field] = value
    return out


@pytest.mark.slow
@needs_toolchain
def test_gpu_mesh_puts_each_expert_group_on_one_node(tiny_cfg):
    mesh = gpu_target.mesh(tiny_cfg.mesh, gpu_target.TARGETS["gh200"])
    assert sharding.mesh_platform(mesh) == "gpu" and sharding.is_compile_only(mesh)
    assert [{d.process_index for d in row} for row in mesh.devices] == [{0}, {1}]
    spec = gpu_target.target_config(gpu_target.TARGETS["gh200"])
    assert "device_memory_size: 96000000000" in spec and "major: 9" in spec


@pytest.mark.slow
@needs_toolchain
def test_the_moe_exchange_is_a_ragged_all_to_all_over_expert_only(gpu_step):
    found = rows(gpu_step["numbers"])
    ragged = {k: v for k, v in found.items() if k[0] == "ragged-all-to-all"}
    assert ragged and {axes for _, axes, _ in ragged} == {"expert"}
    assert ("ragged-all-to-all", "expert", "bf16") in ragged  # the token rows, in bf16
    # no token rows on a dense all-to-all: those left are Muon's re-layout (f32) and counts
    assert not [k for k in found if k[0] == "all-to-all" and k[2] == "bf16"]


@pytest.mark.slow
@needs_toolchain
def test_fp8_weight_gathers_bf16_reductions_and_fp32_only_for_the_router(gpu_step):
    found, cfg = rows(gpu_step["numbers"]), gpu_step["cfg"]
    gathers = {k[2]: v for k, v in found.items() if k[0] == "all-gather"}
    assert gathers["f8e4m3fn"]["bytes"] > 0
    assert set(gathers) <= {"f8e4m3fn", "bf16", "f32"}  # bf16: embedding and LM head
    m = cfg.model  # the router [D, E] of each MoE layer, gathered in forward and recompute
    router = m.n_moe_layers * 2 * m.d_model * m.n_routed_experts * 4 * 7 / 8
    assert gathers.get("f32", {}).get("bytes", 0) <= router
    scatters = {k[2] for k in found if k[0] == "reduce-scatter"}
    assert scatters == {"bf16"}


@pytest.mark.slow
@needs_toolchain
def test_offloaded_optimizer_state_lives_in_host_memory_and_is_moved(gpu_step):
    held = offload.state_bytes(gpu_step["state"])
    host_state = sum(k.get("pinned_host", 0) for k in held.values())
    numbers, facts = gpu_step["numbers"], gpu_step["facts"]
    assert host_state == sum(held["optimizer_state"].values()) - held["optimizer_state"].get(
        "device", 0) > 0
    # exactly the offloaded state comes in and goes out in host memory, donated
    assert numbers["memory/host_argument"] == host_state
    assert numbers["memory/host_output"] == numbers["memory/host_alias"] == host_state
    assert facts["host_copies"] > 0  # the program copies it to and from HBM


@pytest.mark.slow
@needs_toolchain
def test_offloaded_activations_are_host_temporaries_of_their_size(gpu_step):
    numbers = gpu_step["numbers"]
    cfg = gpu_step["cfg"]
    rows_per_device = cfg.data.global_batch_size // cfg.mesh.n_devices
    layer_inputs = cfg.model.n_layers * rows_per_device * cfg.data.seq_len * cfg.model.d_model * 2
    assert numbers["host/activations"] == layer_inputs
    assert numbers["memory/host_temp"] == pytest.approx(layer_inputs, rel=0.05)


@pytest.mark.slow
@needs_toolchain
def test_grouped_matmul_is_a_kernel_without_a_dense_expert_expansion(gpu_step):
    facts, cfg = gpu_step["facts"], gpu_step["cfg"]
    assert set(facts["library_kernels"]["grouped_gemm"]) == {
        "ragged_dot_sm90", "ragged_contracting_dim_dot_sm90"}, facts["custom_calls"]
    assert facts["dense_expert_buffers"] == []
    checks = {c["path"]: c for c in gpu_program.kernel_checks(
        cfg, gpu_step["numbers"], facts, gpu_step["numbers"]["memory/host_argument"],
        [{"op": k[0], "axes": k[1], "dtype": k[2]} for k in rows(gpu_step["numbers"])])}
    assert checks["grouped matmul"]["ok"] and checks["MoE token exchange"]["ok"]
    assert checks["host offload"]["ok"]


@pytest.mark.slow
@needs_toolchain
def test_attention_is_tokamax_flash_attention_without_a_seq_by_seq_buffer(gpu_step):
    facts, cfg = gpu_step["facts"], gpu_step["cfg"]
    # forward and backward kernels (tokamax's Mosaic GPU ones), in every scanned layer body
    # and its recompute
    library = facts["library_kernels"]
    assert set(library["attention_forward"]) == {"flash_attention_sm90"}, facts["custom_calls"]
    assert set(library["attention_backward"]) == {"flash_attention_vjp"}, facts["custom_calls"]
    assert facts["dense_attention_buffers"] == []
    checks = {c["path"]: c for c in gpu_program.kernel_checks(cfg, gpu_step["numbers"], facts, 0, [])}
    assert checks["attention"]["ok"] and checks["attention"]["configured"] == "tokamax"


@pytest.mark.slow
@needs_toolchain
def test_attention_over_the_node_compiles_with_flash_kernels_and_no_seq_by_seq_buffer(node_step):
    """Context parallelism on GH200: the node's rows go through tokamax's flash kernels
    (4 rows × 1 head per GPU here), no [S, S] buffer, the latents gathered in bf16 over
    NVLink."""
    step, cfg = node_step, node_step["cfg"]
    facts = step["facts"]
    library = facts["library_kernels"]
    assert library["attention_forward"] and library["attention_backward"], facts["custom_calls"]
    assert facts["dense_attention_buffers"] == []
    checks = {c["path"]: c for c in gpu_program.kernel_checks(cfg, step["numbers"], facts, 0, [])}
    assert checks["attention"]["ok"]
    assert ("all-gather", "expert", "bf16") in rows(step["numbers"])
    assert ("all-to-all", "expert", "bf16") in rows(step["numbers"])


@pytest.mark.slow
@needs_toolchain
def test_a_two_stage_dispatch_over_two_nodes_compiles_to_ragged_exchanges_per_stage(tiny_cfg):
    """Expert parallelism 8 over 2 GH200 nodes, two-stage: the token rows cross between the
    nodes' GPUs at one place (`expert:2`, all of it InfiniBand) and fan out inside each
    node (`expert:4`, none), both ragged all-to-alls in bf16; each is charged at its
    expected fill, below the buffer bound the report keeps apart."""
    cfg = without_offload(gpu_cfg(tiny_cfg, n_group=2, topk_group=1))
    cfg = dataclasses.replace(
        cfg, mesh=MeshConfig(data=1, expert=8, allow_cross_node_experts=True),
        comm=dataclasses.replace(cfg.comm, expert_dispatch="two_stage"))
    step = compile_for_gpu(cfg)
    found = rows(step["numbers"])
    first, second = found[("ragged-all-to-all", "expert:2", "bf16")], found[
        ("ragged-all-to-all", "expert:4", "bf16")]
    assert first["ib_bytes"] == pytest.approx(first["bytes"]) and second["ib_bytes"] == 0
    checks = {c["path"]: c for c in gpu_program.kernel_checks(
        cfg, step["numbers"], step["facts"], 0,
        [{"op": op, "axes": axes, "dtype": dt} for op, axes, dt in found])}
    assert checks["MoE token exchange"]["ok"], checks["MoE token exchange"]
    charged = sum(v["bytes"] for k, v in found.items() if k[0] == "ragged-all-to-all")
    assert 0 < charged < step["numbers"]["exchange/buffer_bytes"]


def optimized_text(cfg) -> str:
    """The optimized GPU program of cfg's train step (as gpu_program.measure compiles it),
    not measured (a measured one's text is compile_for_gpu(cfg)["text"])."""
    return compile_for_gpu(cfg, measured=False)["text"]


def long_rows(tiny_cfg, **changes):
    """384 positions in 128-position backward chunks: three chunk pairs per key chunk at
    most, so the pairwise loop is in the program."""
    cfg = without_offload(gpu_cfg(tiny_cfg, attention_backward_chunk=128, **changes))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=384))


@pytest.fixture(scope="module")
def long_text(tiny_cfg):
    return optimized_text(long_rows(tiny_cfg))


@pytest.fixture(scope="module")
def node_step(tiny_cfg):
    """Context parallelism over the node's 4 GPUs, with long_rows' chunk pairs."""
    return compile_for_gpu(long_rows(tiny_cfg, attention_context_parallel=True))


def flash_vjp_calls(text: str):
    """(instruction line, is it in a loop with a data trip count) of every tokamax Mosaic
    flash-attention VJP kernel call."""
    comps, _ = hlo_report._computations(text)
    dynamic_bodies = set()
    for lines in comps.values():
        for line in lines:
            loop = re.search(r" while\(.*body=([\w.\-]+)", line)
            if loop and "known_trip_count" not in line:
                dynamic_bodies.add(loop.group(1))
    return [(line, name in dynamic_bodies) for name, lines in comps.items() for line in lines
            if "custom-call(" in line
            and (kernel_classes.library_kernel(line) or ("",))[0] == "attention_backward"]


@pytest.mark.slow
@needs_toolchain
def test_the_attention_backward_runs_chunk_pairs_with_the_document_bounds(long_text):
    """Each pair's backward kernel gets its queries' key starts (the document bounds) as
    an int32 operand the width of a chunk; the off-diagonal pairs run inside a loop whose
    trip count is data (the pairs another document makes invisible never run)."""
    calls = flash_vjp_calls(long_text)
    assert calls and any(dynamic for _, dynamic in calls), [c[0][:200] for c in calls]
    for line, _ in calls:
        operands = line.split("custom-call(", 1)[1]
        shapes = re.findall(r"s32\[([0-9,]*)\]", line.split("=", 1)[1].split("custom-call(")[0]
                            + operands)
        assert any(dims.split(",")[-1] == "128" for dims in shapes), line[:300]


@pytest.mark.slow
@needs_toolchain
def test_over_the_node_each_row_runs_its_own_chunk_pairs(node_step):
    """Context parallelism hands each GPU the node's 4 rows: the backward's pair kernels
    run one row at a time (batch 1, in a loop over the rows), each row's off-diagonal
    pairs in a loop of its own data trip count; no [S, S] buffer."""
    cfg, text = node_step["cfg"], node_step["text"]
    calls = flash_vjp_calls(text)
    assert calls and any(dynamic for _, dynamic in calls), [c[0][:200] for c in calls]
    for line, _ in calls:
        # its results [chunk, heads, width]: one row's (before: [4, chunk, heads, width])
        results = re.findall(r"bf16\[([0-9,]+)\]", line.split("custom-call(", 1)[0])
        assert results and {d.split(",")[0] for d in results} == {"128"}, line[:300]
    assert gpu_program.dense_attention_buffers(text, cfg) == []


@pytest.mark.slow
@needs_toolchain
def test_the_moe_moves_no_worst_case_buffer_and_lays_weights_out_once_per_layer(
        tiny_cfg, long_text):
    """No kernel of the MoE layer touches a [ep · tokens · top_k, D] array (every row
    choosing the same device's experts), and the expert matrices are rewritten (laid out,
    dequantized, gradients cast) a bounded number of times per layer — which the same
    program dispatched in 4 token chunks multiplies (the check can fail)."""
    cfg = long_rows(tiny_cfg)
    m, ep = cfg.model, cfg.mesh.expert
    tokens = cfg.data.global_batch_size * cfg.data.seq_len // cfg.mesh.n_devices
    worst = ep * tokens * m.top_k
    matrix = {(m.d_model, m.expert_ffn_dim), (m.expert_ffn_dim, m.d_model)}
    layer_weights = 3 * (m.n_routed_experts // ep) * m.d_model * m.expert_ffn_dim * 2  # bf16

    def moe_kernels(text):
        """(kernel, the dims of each array it writes) of the MoE layer's kernels."""
        shape = hbm_traffic._Module(text).shape
        return [(k, [[int(d) for d in dims.split(",") if d]
                     for _, dims, _ in hbm_traffic._ARRAY.findall(shape[k.name])])
                for k in hbm_traffic.kernels(text) if "/moe/" in k.op_name]

    def weight_bytes(text):
        return sum(k.bytes_per_step for k, arrays in moe_kernels(text) if not k.conditional
                   and any(tuple(a[-2:]) in matrix for a in arrays if len(a) >= 2))

    for k, arrays in moe_kernels(long_text):
        assert not any(worst in a for a in arrays), k
    once = weight_bytes(long_text) / m.n_moe_layers
    assert once <= 12 * layer_weights, once / layer_weights
    chunked = weight_bytes(optimized_text(long_rows(tiny_cfg, moe_chunk_tokens=96)))
    assert chunked / m.n_moe_layers > 1.5 * once


def mtp_cfg(tiny_cfg):
    """gpu_cfg with one MTP module, and the MoE's dispatch in e4m3: test_fp8_dispatch reads
    the same program (one GH200 compile, two checks, each of its own part)."""
    cfg = gpu_cfg(tiny_cfg, mtp_layers=1)
    return dataclasses.replace(cfg, comm=dataclasses.replace(
        cfg.comm, expert_exchange="ragged", expert_exchange_dtype="fp8"))


@pytest.mark.slow
@needs_toolchain
def test_mtp_modules_run_the_main_blocks_library_kernels_on_the_gpu_target(tiny_cfg, gpu_step):
    """model.mtp_layers=1 compiles for GH200 and passes the kernel checks of the main
    blocks; its module's block calls the same grouped-matmul and flash-attention kernels
    (under its own op names), and the plan prices them: more of each than without MTP.
    One thing it does not get: the module's saved input stays in HBM (XLA:GPU keeps the
    input of a one-layer scanned stack on device although the policy offloads it, as for
    the decoder stacks: gpu_cfg), so the offload check says so, short by exactly that."""
    step = compile_for_gpu(mtp_cfg(tiny_cfg))
    facts, cfg, numbers = step["facts"], step["cfg"], step["numbers"]
    checks = {c["path"]: c for c in gpu_program.kernel_checks(
        cfg, numbers, facts, numbers["memory/host_argument"],
        [{"op": k[0], "axes": k[1], "dtype": k[2]} for k in rows(numbers)])}
    assert {path for path, c in checks.items() if not c["ok"]} == {"host offload"}, checks
    assert checks["multi-token prediction"]["ok"], checks["multi-token prediction"]
    module_input = cfg.data.seq_len * cfg.model.d_model * 2  # one row per device, bf16
    assert numbers["host/activations"] - numbers["memory/host_temp"] == module_input
    assert numbers["memory/host_temp"] == gpu_step["numbers"]["memory/host_temp"]
    assert set(facts["mtp_kernels"]) >= set(gpu_program.MTP_KERNEL_CLASSES), facts["mtp_kernels"]
    assert gpu_step["facts"]["mtp_kernels"] == {}  # the main model alone has none
    for kind in gpu_program.MTP_KERNEL_CLASSES:
        with_mtp = sum(facts["library_kernels"][kind].values())
        without = sum(gpu_step["facts"]["library_kernels"][kind].values())
        assert with_mtp > without, (kind, with_mtp, without)
        # what the plan prices: the classes' runs (kernel_classes.summary)
        runs = facts["kernel_classes"][kind]["runs"]
        assert runs > gpu_step["facts"]["kernel_classes"][kind]["runs"], (kind, runs)
    assert (facts["kernel_classes"]["grouped_gemm"]["flops"]
            > gpu_step["facts"]["kernel_classes"]["grouped_gemm"]["flops"])
    assert facts["dense_expert_buffers"] == [] and facts["dense_attention_buffers"] == []


@pytest.fixture(scope="module")
def faulty_step(tiny_cfg):
    """Both kernels the checks exist to catch, in one program: tokamax's XLA attention
    (it builds the [S, S] document mask) and jax.lax.ragged_dot (every row times every
    expert). Each check reads its own part of the model."""
    return compile_for_gpu(without_offload(gpu_cfg(tiny_cfg, attention="tokamax_xla",
                                                   grouped_matmul="ragged_dot")))


def faulty_checks(step) -> dict:
    return {c["path"]: c for c in gpu_program.kernel_checks(
        step["cfg"], step["numbers"], step["facts"], 0, [])}


@pytest.mark.slow
@needs_toolchain
def test_an_attention_with_a_dense_mask_is_caught(faulty_step):
    """The check can fail: tokamax's XLA path builds the [S, S] document mask."""
    s = faulty_step["cfg"].data.seq_len
    assert faulty_step["facts"]["dense_attention_buffers"][0]["shape"][-2:] == [s, s]
    assert not faulty_checks(faulty_step)["attention"]["ok"]


@pytest.mark.slow
@needs_toolchain
def test_jax_ragged_dot_is_caught_as_a_dense_expansion(faulty_step):
    """The check can fail: jax.lax.ragged_dot compiles to every row times every expert."""
    cfg, facts = faulty_step["cfg"], faulty_step["facts"]
    assert "grouped_gemm" not in facts["library_kernels"]
    assert not faulty_checks(faulty_step)["grouped matmul"]["ok"]
    e_local = cfg.model.n_routed_experts // cfg.mesh.expert
    assert facts["dense_expert_buffers"][0]["shape"].count(e_local) >= 1


@needs_toolchain
@pytest.mark.slow
def test_plan_command_reports_the_gpu_program_as_json():
    """`europa-jax plan … --target gh200 --json`: the documented keys, from the GPU program."""
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-m", "europa_jax.cli", "plan",
                             config_path("tiny-cpu.yaml"), "--devices", "8", "--target",
                             "gh200", "--json"], cwd=REPO, capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout)
    assert r["target"] == "gh200" and r["devices"] == 8 and r["compiled"]["error"] is None
    assert r["compiled"]["program"].startswith("XLA:GPU")
    mem = r["memory"]["step"]["xla_gpu"]
    assert r["per_device"]["hbm_peak_bytes"] == (mem["argument"] + mem["output"] - mem["alias"]
                                                 + mem["temp"])
    assert r["per_device"]["host_peak_bytes"] == 0  # tiny-cpu offloads nothing
    assert r["budget"] == {"hbm_bytes": 0.92 * 96e9, "host_bytes": 96e9,
                           "host_bytes_strict": 30e9}
    assert r["fits_strict_host"] is True
    assert r["fits"] is True and r["estimate"]["tokens_per_s_per_gpu"] > 0
    ops = {(c["op"], c["axes"]) for c in r["collectives"]}
    assert ("ragged-all-to-all", "expert") in ops
    assert all(c["source"] == "compiled" for c in r["collectives"])
    kernels = {k["path"]: k["ok"] for k in r["kernels"]}
    assert kernels["grouped matmul"] and kernels["MoE token exchange"] and kernels["attention"]
    # the non-matmul kernels' bytes, by part of the model, priced in the estimate
    traffic = r["hbm_traffic"]
    assert traffic["bytes_per_step"] > 0 and traffic["by_region"]["moe"] > 0
    # (tiny-cpu's experts are one group: its windows run in data-dependent loops only)
    assert traffic["moe_loop_bytes_per_step"] <= traffic["by_region"]["moe"]
    # overflow rounds and windows are expected not to run (what is left: tiny branches)
    assert traffic["data_dependent_by_region"]["moe"] < 1e-3 * traffic["by_region"]["moe"]
    memory_s = r["estimate"]["as_compiled"]["memory_s"]
    hw = r["machine"]
    priced = (traffic["bytes_per_step"] + traffic["data_dependent_bytes_per_step"]
              - traffic["by_region"].get("optimizer update", 0)
              - traffic["data_dependent_by_region"].get("optimizer update", 0))
    assert memory_s == pytest.approx(priced / (hw["hbm_bandwidth"]
                                               * hw["memory_bound"]["expected"]))
    # the step by class of kernel (step_time.py): the classes' FLOPs are those the plan
    # counts; the memory-bound kernels and the update cost time; the range is ordered
    e, f = r["estimate"], r["flops"]
    by = e["by_class"]
    assert by["memory_bound"]["bytes"] == pytest.approx(priced)
    assert f["executed"] == pytest.approx(sum(c["flops"] for c in by.values()))
    assert f["by_class"] == {k: c["flops"] for k, c in by.items() if c["flops"]}
    assert set(f["by_class"]) == {"dense_gemm", "grouped_gemm", "attention_forward",
                                  "attention_backward"}
    # the kernels run the analytic count's work and more (masked attention pairs,
    # FlashAttention's backward convention, windows' padding) — not less, not wildly more
    assert f["executed_analytic"] <= f["executed"] < 3 * f["executed_analytic"]
    for kind in ("memory_bound", "optimizer_update", "dense_gemm", "grouped_gemm"):
        assert by[kind]["seconds"]["expected"] > 0, kind
    rng = e["range"]
    assert rng["low"]["step_s"] >= rng["expected"]["step_s"] >= rng["high"]["step_s"] > 0
    assert e["tokens_per_s_per_gpu"] == pytest.approx(rng["expected"]["tokens_per_s_per_gpu"])
    assert e["calibration"].startswith("assumed") and "overlap" in e["overlap_model"]
    # the same step with its links free (step_time.ceilings): what fewer bytes could buy
    for case, row in rng.items():
        assert (e["ceilings"]["links_free"][case]["step_s"]
                <= e["ceilings"]["infiniband_free"][case]["step_s"] <= row["step_s"])
    # what the overlap model leaves out, read off the program: each line priced and sourced
    lines = e["lines"]
    assert lines["kernel_launches"]["count"] > 100 and lines["update_exchange"]["seconds"][
        "expected"] > 0 and lines["in_layer_exchange"]["nvlink_bytes"] > 0
    assert all(row["source"] for row in lines.values())
    assert r["kernel_classes"]["dense_gemm"]["shapes_count"] >= len(
        r["kernel_classes"]["dense_gemm"]["shapes"]) > 0
    assert r["flops"]["attention_kernels"]["one_document_per_row"]["backward"] == 1.0
    # attention priced at the expected slowest rank of sampled batches, the worst case beside
    a, e = r["attention"], r["estimate"]
    assert a["slowest_unit"] == "rank" and a["batches"] == 32
    assert a["documents"].startswith("dolma") and "dolma" in e["basis"]
    pairs = a["pairs_per_gpu"]
    assert pairs["mean_over_gpus"] <= pairs["expected"] <= pairs["p95"] <= pairs["worst_case"]
    assert e["worst_case"]["tokens_per_s_per_gpu_overlapped"] <= e["tokens_per_s_per_gpu"]
    assert "expected slowest rank" in e["basis"]


@pytest.mark.slow
def test_a_missing_toolchain_is_a_one_line_error_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(gpu_target, "_importable", lambda module: False)
    monkeypatch.setattr(gpu_target.shutil, "which", lambda name: None)
    code = cli.main(["plan", config_path("tiny-cpu.yaml"), "--devices", "8"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0
    assert "pip install -e '.[gpu]'" in err and "jax-cuda12-plugin" in err
    assert err.strip().endswith("or plan the step on XLA:CPU with --target cpu")


@pytest.mark.slow
def test_probes_are_refused_for_a_gpu_target(capsys):
    code = cli.main(["plan", config_path("tiny-cpu.yaml"), "--devices", "8",
                     "--probe-moe-layers", "4,6"])
    assert code == 2 and "only for --target cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_a_gpu_topology_needs_whole_nodes():
    with pytest.raises(ConfigError, match="multiple of 4"):
        gpu_target.topology(gpu_target.TARGETS["gh200"], 6)


@pytest.mark.slow
def test_the_plan_compiles_with_exactly_the_launch_env_s_xla_flags():
    """launch/env.sh's XLA_FLAGS and the plan's compiler options are the same options with
    the same values: the plan prices the program a rank runs (the schedule's options
    change it: kernels between an exchange's start and done, HBM, HBM traffic)."""
    text = open(os.path.join(REPO, "launch", "env.sh")).read()
    flags = set(re.findall(r"--xla_\w+=\S+", text))
    assert flags == {gpu_target.xla_flag(option, value)
                     for option, value in gpu_target.RUN_XLA_OPTIONS.items()}


def test_hlo_report_reads_async_starts_per_dtype():
    """Optimized GPU HLO: `-start` tuples hold operands and results; combined collectives
    mix dtypes. (Lines as XLA:GPU prints them.)"""
    mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))
    hlo = """HloModule m

ENTRY main {
  %ag = ((f8e4m3fn[16,64]{1,0}, f32[16,16]{1,0}), (f8e4m3fn[128,64]{1,0}, f32[128,16]{1,0})) all-gather-start(%a, %b), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %rs = ((bf16[4,32,128]{2,1,0}), bf16[4,8,128]{2,1,0}) reduce-scatter-start(%c), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={1}
  %ra = ((bf16[2048,128]{1,0}, bf16[2048,128]{1,0}, s64[4]{0}, s64[4]{0}, s64[4]{0}, /*index=5*/s64[4]{0}), bf16[2048,128]{1,0}) ragged-all-to-all-start(%d, %e, %f, %g, %h, %i), replica_groups={{0,1,2,3},{4,5,6,7}}
  %ar = f32[3]{0} all-reduce-start(%j), replica_groups={{0,1,2,3,4,5,6,7}}
  ROOT %done = f32[3]{0} all-reduce-done(%ar)
}
"""
    found = {(c.op, c.axes, c.dtype): c.bytes_per_device for c in hlo_report.collectives(hlo, mesh)}
    assert found == {("all-gather", ("data", "expert"), "f8e4m3fn"): 128 * 64 * 7 / 8,
                     ("all-gather", ("data", "expert"), "f32"): 128 * 16 * 4 * 7 / 8,
                     ("reduce-scatter", ("data",), "bf16"): 4 * 8 * 128 * 2 * 1,
                     ("ragged-all-to-all", ("expert",), "bf16"): 2048 * 128 * 2 * 3 / 4,
                     ("all-reduce", ("data", "expert"), "f32"): 2 * 3 * 4 * 7 / 8}
