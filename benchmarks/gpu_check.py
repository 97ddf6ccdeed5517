"""One GPU, under five minutes: are europa-952b's kernels fast here, and is offload cheap?

    python benchmarks/gpu_check.py [--json gpu_check.json] [--tokens N] [--cpu-smoke]
                                   [--aot-target gh200|h100|h200] [--aot-only]

On a GPU (H100/H200/GH200) it runs at europa-952b's per-GPU shapes — expert parallelism
4, so 96 local experts, and 65,536 tokens whose 8 routed copies (524,288 rows) land on
this GPU's experts under even routing:
1. one MoE decoder layer (MLA attention + MoE, the model's own code; weights in bf16 as
   the FSDP gather delivers them), forward+backward: achieved TFLOP/s against the chip's
   bf16 peak, and peak HBM;
2. the grouped matmul alone (`jax.lax.ragged_dot`, and `tokamax.ragged_dot` if installed)
   against one dense matmul of the same shape and FLOPs: well below 1 means a slow path;
3. attention alone, forward+backward, one causal document, q/k 192 and v 128 wide: the
   model's kernel (tokamax's Mosaic GPU flash attention) against the pure-JAX blockwise
   kernel the CPU runs;
4. copies to and from `pinned_host` memory: the offload path (NVLink-C2C on a GH200);
5. the regime the shipped step runs in (gpu_regimes.py): the routed experts on the rows
   an expert-parallel-4 device receives, forward+backward, with matmul and other kernel
   time apart (jax.profiler); the grouped matmul's forward, dgrad and wgrad on a
   131,072-row buffer with 32,768 rows filled over 96 groups, and on one expert window;
   attention on one 65,536-token document against 64 of 1,024; a 65,536 × 7,168 × 1,536
   `dot_general` in fp8 against bf16; GPU clocks and power while they ran.
6. the calibration (gpu_calibration.py): each class of kernel the plan prices, measured
   at europa-952b's shapes and written under "calibration" in the JSON, so that
   `europa-jax plan CONFIG --devices N --hardware gpu_check.json` replaces the assumed
   efficiencies of plan/price/hardware.py by these.
Each part reports its own error instead of stopping the others (e.g. out of memory).

Before any of that, where no GPU is present, every function above is compiled for one
(gpu_target.py: deviceless, the `gpu` extra; `--aot-target`, default gh200, also on a GPU;
`--aot-only` times nothing) at the shapes the GPU run uses: per function whether it
compiles, its HBM and host bytes (`memory_analysis()`, against the target's HBM share) and
the kernels it calls, so that a broken or oversized check is found before a GPU is lent.
The timed and the compiled functions are the same `Program`s. Deviceless there is no
`cost_analysis()`: compiling says nothing about speed. At full size it all compiles in
about 40 s and 1.3 GB on 2 CPU cores: nothing is shrunk for it. tokamax's Mosaic GPU
kernel does not lower below 64-wide matrices ("WGMMA rhs swizzle must match lhs
swizzle"), so at the smoke size the layer's grouped matmul is tokamax's Triton kernel.
On a GPU, XLA gets the HBM share and GEMM options of launch/env.sh, as the compile assumes.

Without a GPU, or with --cpu-smoke, the timed part runs at a tiny size so that it cannot
rot; those numbers say nothing about any GPU. The compile runs at the GPU run's shapes
unless --cpu-smoke or --tokens. The compile's table comes first, the timing's last;
JSON is written too (the compile under "aot"). FLOPs follow flops.py: forward+backward
= 3 × forward, causal attention counts S(S+1)/2 query-key pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.dirname(os.path.abspath(__file__))]  # europa_jax, gpu_programs
import gpu_calibration  # noqa: E402
import gpu_regimes  # noqa: E402
from gpu_shared import gpu_driver_present, one_line, run_as_a_rank, section, timed  # noqa: E402
from gpu_programs import (OFFLOAD_BYTES, Program, arg_sharding, attention_kernel,  # noqa: E402
                          attention_reference, check_config, inputs, layer_flops,
                          one_device_mesh)
from gpu_programs import builders as layer_builders  # noqa: E402


def builders(cfg, tokens: int, smoke: bool) -> dict:
    """Every check's programs (gpu_programs.py, gpu_regimes.py, gpu_calibration.py), for a
    mesh."""
    return {**layer_builders(cfg, tokens, smoke), **gpu_regimes.builders(cfg, tokens, smoke),
            "calibration": lambda mesh: gpu_calibration.programs(cfg, tokens, mesh, smoke)}

# Dense bf16 peaks by device kind (hardware.py cites the Hopper figure).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}


# ----------------------------------------------------------------------------- timing


def check_layer(programs, model, tokens: int, peak: float | None, mesh, repeats: int) -> dict:
    import jax

    program = programs["fwd+bwd"]
    args = inputs(program, mesh)
    compiled = program.fn.lower(*args).compile()  # timed as compiled: one compile, not two
    seconds = timed(compiled, *args, repeats=repeats)
    stats = jax.devices()[0].memory_stats() or {}
    memory = compiled.memory_analysis()
    work = layer_flops(model, tokens)
    return {"tokens": tokens, "local_experts": model.n_routed_experts,
            "routed_rows": tokens * model.top_k, "seconds": seconds, "flops": work,
            "tflops": work / seconds / 1e12, "mfu": work / seconds / peak if peak else None,
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "xla_bytes": memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes}


def check_grouped_matmul(programs, model, tokens: int, mesh, repeats: int) -> dict:
    e, d, f = model.n_routed_experts, model.d_model, model.expert_ffn_dim
    rows = tokens * model.top_k
    work = 2.0 * rows * d * f
    out = {"rows": rows, "experts": e, "shape": [rows, d, f], "flops": work}
    for name, program in programs.items():
        section(out, name, lambda: {"tflops": work / timed(
            program.fn, *inputs(program, mesh), repeats=repeats) / 1e12})
    dense = out["dense_matmul"].get("tflops")
    for name in programs:
        if name != "dense_matmul" and dense and "tflops" in out[name]:
            out[name]["vs_dense"] = out[name]["tflops"] / dense
    return out


def check_attention(programs, model, execution, tokens: int, mesh, repeats: int,
                    smoke: bool) -> dict:
    h, qk, vd = model.n_heads, model.qk_head_dim, model.v_head_dim
    work = 6.0 * h * (qk + vd) * tokens * (tokens + 1) // 2  # causal pairs (flops.py)
    out = {"tokens": tokens, "heads": h, "flops": work,
           "kernels": {"model": attention_kernel(execution, mesh, smoke),
                       "reference": attention_reference(mesh)}}
    for name, program in programs.items():
        section(out, name, lambda: {"tflops": work / timed(
            program.fn, *inputs(program, mesh), repeats=repeats) / 1e12})
    ref = out["reference"].get("tflops")
    if ref and "tflops" in out["model"]:
        out["model"]["vs_reference"] = out["model"]["tflops"] / ref
    return out


def check_offload(programs, n_bytes: int, mesh, repeats: int) -> dict:
    to_host, to_device = programs["device_to_host"], programs["host_to_device"]
    x = inputs(to_host, mesh)
    on_host = inputs(to_device, mesh)
    out = {"bytes": n_bytes, "memory_kind": to_host.fn(*x).sharding.memory_kind}
    out["device_to_host_gbps"] = n_bytes / timed(to_host.fn, *x, repeats=repeats) / 1e9
    out["host_to_device_gbps"] = n_bytes / timed(to_device.fn, *on_host, repeats=repeats) / 1e9
    return out


# ----------------------------------------------------------------------------- GPU compile


def compile_for_target(program: Program, mesh, cfg) -> dict:
    """Compile `program` for the mesh's compile-only GPU at its inputs' shapes."""
    import jax

    from europa_jax.plan.program import gpu_program, gpu_target

    start = time.perf_counter()
    specs = tuple(jax.tree.map(lambda s, i=i: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=arg_sharding(program, mesh, i)), a)
        for i, a in enumerate(jax.eval_shape(program.make_args)))
    # tokamax picks its GPU kernels from the default device
    with gpu_target.lowering(mesh):
        lowered = program.fn.trace(*specs).lower()
    compiled = gpu_target.compile_lowered(lowered, mesh)
    mem = compiled.memory_analysis()
    memory = {f: getattr(mem, f"{f}_size_in_bytes") for f in gpu_program.MEMORY_FIELDS}
    facts = gpu_program.program_facts(compiled.as_text(), cfg)
    return {"compiled": True, "seconds": time.perf_counter() - start,
            "hbm_bytes": memory["argument"] + memory["output"] + memory["temp"]
            - memory["alias"],
            "host_bytes": memory["host_argument"] + memory["host_output"]
            + memory["host_temp"] - memory["host_alias"],
            "memory": memory, "kernels": facts["custom_calls"],
            "host_copies": facts["host_copies"],
            "dense_expert_buffers": [f"{b['dtype']}{b['shape']}"
                                     for b in facts["dense_expert_buffers"]]}


def compile_checks(cfg, tokens: int, smoke: bool, target_name: str) -> dict:
    """Every check's programs compiled for one GPU of `target_name`."""
    from europa_jax.plan.program import gpu_target

    missing = gpu_target.missing_toolchain()
    if missing:
        return {"target": target_name, "skipped": f"the gpu extra is missing: "
                f"{', '.join(missing)} (pip install -e '.[gpu]')"}
    start = time.perf_counter()
    target = gpu_target.TARGETS[target_name]
    out = {"target": target_name, "device": target.name, "tokens": tokens, "smoke": smoke,
           "hbm_budget_bytes": target.hbm_budget_bytes, "checks": {}}
    try:
        mesh = one_device_mesh(gpu_target.topology(target, 1)[0])
    except Exception as e:  # noqa: BLE001 - e.g. jax started the CUDA backend without a GPU
        return {**out, "error": one_line(e)}
    for check, build in builders(cfg, tokens, smoke).items():
        try:
            programs = build(mesh)
        except Exception as e:  # noqa: BLE001 - e.g. tokamax missing for the layer
            out["checks"][check] = {"error": one_line(e)}
            continue
        compiled = out["checks"][check] = {}
        for name, program in programs.items():
            section(compiled, name, lambda: compile_for_target(program, mesh, cfg))
    out["seconds"] = time.perf_counter() - start
    return out


# ----------------------------------------------------------------------------- tables


def errors_of(results: dict, prefix: str = "") -> list[str]:
    """'path: error' for every part that failed, however deep."""
    out = []
    for name, part in results.items():
        if isinstance(part, dict):
            if "error" in part:
                out.append(f"{prefix}{name}: {part['error']}")
            else:
                out += errors_of(part, f"{prefix}{name}/")
    return out


def aot_table(aot: dict) -> str:
    """Per compiled function: HBM and host bytes, compile time and the kernels it calls."""
    if "skipped" in aot or "error" in aot:
        return f"GPU-target compile ({aot['target']}): {aot.get('skipped') or aot['error']}"
    budget = aot["hbm_budget_bytes"]
    head = (f"GPU-target compile for {aot['device']} ({budget / 1e9:.1f} GB HBM for XLA), "
            f"{aot['tokens']:,} tokens")
    rows = [("function", "HBM GB", "host GB", "compile s", "kernels")]
    for check, programs in aot["checks"].items():
        for name, r in programs.items():
            if "compiled" not in r:
                continue
            fits = "" if r["hbm_bytes"] <= budget else " (over)"
            kernels = ", ".join(f"{k} ×{n}" for k, n in sorted(r["kernels"].items()))
            if r["host_copies"]:
                kernels = ", ".join(filter(None, [kernels, f"host copies ×{r['host_copies']}"]))
            if r["dense_expert_buffers"]:  # the slow grouped matmul's [E, M, ·] expansion
                kernels += f"; dense expert buffer {r['dense_expert_buffers'][0]}"
            rows.append((f"{check}/{name}", f"{r['hbm_bytes'] / 1e9:.3g}{fits}",
                         f"{r['host_bytes'] / 1e9:.3g}", f"{r['seconds']:.1f}", kernels or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  "
             f"{r[3]:>{widths[3]}}  {r[4]}" for r in rows]
    return "\n".join([head, *lines, *errors_of(aot["checks"])])


def table(results: dict) -> str:
    """The summary: one line per measurement, an error string where a part failed."""
    def get(*path, fmt="{:.3g}", scale=1.0):
        node = results
        for key in path:
            if not isinstance(node, dict):
                return "n/a"
            if key not in node:
                return "error" if "error" in node else "n/a"
            node = node[key]
        return "n/a" if node is None else fmt.format(node * scale)

    gm, at = "grouped_matmul", "attention"
    rows = [("device", results["device"], f"bf16 peak {results['peak_bf16_tflops'] or 'n/a'} "
             "TFLOP/s"),
            ("layer fwd+bwd TFLOP/s", get("layer", "tflops"),
             f"MFU {get('layer', 'mfu', fmt='{:.1%}')}"),
            ("layer peak memory GB", get("layer", "peak_bytes_in_use", scale=1e-9),
             f"XLA's estimate {get('layer', 'xla_bytes', scale=1e-9)} GB"),
            ("dense matmul TFLOP/s", get(gm, "dense_matmul", "tflops"), "same shape and FLOPs")]
    for name in ("lax.ragged_dot", "tokamax.ragged_dot"):
        if name in results.get(gm, {}):
            rows.append((f"{name} TFLOP/s", get(gm, name, "tflops"),
                         f"{get(gm, name, 'vs_dense', fmt='{:.2f}')} × dense"))
    kernels = results.get(at, {}).get("kernels", {})
    rows += [(f"attention ({kernels.get('model', 'model')}) TFLOP/s", get(at, "model", "tflops"),
              f"{get(at, 'model', 'vs_reference', fmt='{:.2f}')} × "
              f"{kernels.get('reference', 'reference')}"),
             ("device→pinned_host GB/s", get("offload", "device_to_host_gbps"), ""),
             ("pinned_host→device GB/s", get("offload", "host_to_device_gbps"), "")]
    rows += gpu_regimes.table_rows(results, get)
    rows += gpu_calibration.table_rows(results.get("calibration", {}))
    errors = errors_of({k: v for k, v in results.items()
                        if k not in ("aot", "clocks", "calibration")})
    width = max(len(r[0]) for r in rows)
    return "\n".join([f"{name:<{width}}  {value:>10}  {note}" for name, value, note in rows]
                     + errors)


def main() -> None:
    from europa_jax.plan.program import gpu_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu_check.json", help="where the results go")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on whatever backend there is (automatic without a GPU)")
    parser.add_argument("--tokens", type=int, help="tokens per GPU (default: 65,536; 256 smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--aot-target", choices=sorted(gpu_target.TARGETS),
                        help="compile every check for this GPU first (default without a GPU: "
                        "gh200, when the gpu extra is installed)")
    parser.add_argument("--aot-only", action="store_true",
                        help="only compile for the GPU target; time nothing")
    args = parser.parse_args()

    def config(smoke: bool, tokens: int):
        from europa_jax.config import ConfigError

        try:
            return check_config(smoke, tokens)
        except ConfigError as e:  # e.g. tokens that the attention blocks do not divide
            parser.error(f"--tokens {tokens}: {e}")

    gpu_here = gpu_driver_present()
    cpu_only = args.aot_only or not (gpu_here or os.environ.get("JAX_PLATFORMS"))
    if cpu_only:
        # the CUDA plugin's start-up check fails without a GPU, and then it cannot compile
        # for one either: jax starts on CPU alone, the GPU is only a compile target
        gpu_target.prepare_process()
    elif gpu_here:
        run_as_a_rank()
    import jax

    if cpu_only:
        jax.config.update("jax_platforms", "cpu")
    gpu = jax.default_backend() == "gpu"
    results = {}

    def write():
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)

    if args.aot_only or args.aot_target or not gpu:
        aot_tokens = args.tokens or (256 if args.cpu_smoke else 65536)
        results["aot"] = compile_checks(config(args.cpu_smoke, aot_tokens), aot_tokens,
                                        args.cpu_smoke, args.aot_target or "gh200")
        write()
        print(aot_table(results["aot"]), flush=True)
        if args.aot_only:
            return

    smoke = args.cpu_smoke or not gpu
    tokens = args.tokens or (256 if smoke else 65536)
    device = jax.devices()[0]
    mesh = one_device_mesh(device)
    peak = next((v for k, v in PEAK_BF16.items() if k in device.device_kind), None)
    results.update({"device": device.device_kind, "backend": jax.default_backend(),
                    "smoke": smoke, "peak_bf16_tflops": peak / 1e12 if peak else None})
    cfg = config(smoke, tokens)
    model, execution, build = cfg.model, cfg.execution, builders(cfg, tokens, smoke)
    start = time.perf_counter()
    section(results, "layer", lambda: check_layer(build["layer"](mesh), model, tokens, peak,
                                                  mesh, args.repeats))
    section(results, "grouped_matmul", lambda: check_grouped_matmul(
        build["grouped_matmul"](mesh), model, tokens, mesh, args.repeats))
    section(results, "attention", lambda: check_attention(build["attention"](mesh), model,
                                                          execution, tokens, mesh,
                                                          args.repeats, smoke))
    section(results, "offload", lambda: check_offload(build["offload"](mesh),
                                                      OFFLOAD_BYTES[smoke], mesh, args.repeats))
    with gpu_regimes.Clocks() as clocks:
        section(results, "moe_received", lambda: gpu_regimes.check_moe_received(
            build["moe_received"](mesh), model, execution, tokens, mesh, args.repeats))
        section(results, "grouped_regime", lambda: gpu_regimes.check_grouped_regime(
            build["grouped_regime"](mesh), model, execution, tokens, mesh, smoke,
            args.repeats))
        section(results, "documents", lambda: gpu_regimes.check_documents(
            build["documents"](mesh), model, execution, tokens, mesh, args.repeats))
        section(results, "fp8_dot", lambda: gpu_regimes.check_fp8(
            build["fp8_dot"](mesh), tokens, smoke, mesh, args.repeats))
        # the efficiencies plan/price/hardware.py assumes, as `europa-jax plan --hardware` reads
        # them (without a GPU: against a GH200's peak, at tiny shapes — it measures nothing)
        section(results, "calibration", lambda: gpu_calibration.calibrate(
            build["calibration"](mesh), cfg, tokens, mesh, smoke, args.repeats,
            peak or PEAK_BF16["GH200"]))
    results["clocks"] = clocks.summary() if gpu else {"error": "no GPU"}
    results["seconds"] = time.perf_counter() - start
    write()
    if smoke:
        print("smoke run at tiny shapes: checks that the script works, measures nothing")
    print(table(results))


if __name__ == "__main__":
    main()
