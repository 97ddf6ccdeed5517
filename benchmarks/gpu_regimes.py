"""gpu_check.py's measurements of the regime europa-952b's MoE and attention actually run
in, and what they cost besides matmuls: the programs, their timing, a profile split.

- `moe_received`: one device's routed experts (the library path in windows,
  model/experts/expert_windows.py) on the rows an expert-parallel-4 device receives in one
  dispatch of 65,536 tokens — R = 4 · C rows (C = moe_dispatch.exchange_capacity) of 8
  slots, filled as uniform routing fills them — forward+backward, traced by jax.profiler:
  matmul kernels' time and the rest (memory-bound: gathers, scatters, SwiGLU, converts)
  apart;
- `grouped_regime`: the grouped matmul forward, dgrad (weights laid out [E, F, D]) and
  wgrad (float32) on a 131,072-row buffer of which 32,768 rows are filled, over 96 groups
  (the worst-case buffers of the former 4,096-token chunks), and on one expert window of
  the shipped layout (≈80 % filled);
- `documents`: the model's attention forward+backward on one 65,536-token document
  against 64 documents of 1,024 (the backward skips other documents' chunk pairs);
- `fp8_dot`: a 65,536 × 7,168 × 1,536 `dot_general` in bf16 and in float8 e4m3;
- `clocks`: SM/memory clocks, power and temperature (nvidia-smi) while the checks ran.
Imports of jax and the project stay inside functions (gpu_check.py picks the platform).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import subprocess
import tempfile
import threading

from gpu_programs import Program
from gpu_shared import section, timed

EXPERT_AXIS = 4  # europa-952b's expert parallelism: the rows a device of a node receives
# Kernel names that are matrix multiplications (cuBLAS/cuBLASLt, CUTLASS, tokamax's Mosaic
# GPU and Triton kernels, flash attention; tokamax 0.0.17 leaves its sm90 flash backward
# kernels unnamed, `anonymous`); everything else counts as memory-bound.
MATMUL_KERNELS = re.compile(r"gemm|cutlass|xmma|wgmma|nvjet|ragged|mosaic|flash|attention|"
                            r"matmul|dot|anonymous", re.IGNORECASE)
GROUPED_BUFFER_ROWS, GROUPED_FILLED_ROWS = 131072, 32768


def received_layout(model, execution, tokens: int) -> dict:
    """The rows and copies one device of expert-parallel 4 receives in one dispatch."""
    from europa_jax.model.experts import moe_dispatch

    capacity, _ = moe_dispatch.exchange_capacity(tokens, model, execution, EXPERT_AXIS)
    rows = EXPERT_AXIS * capacity
    filled = min(rows, round(tokens * moe_dispatch.expected_destinations(model, EXPERT_AXIS)))
    return {"rows": rows, "slots": model.top_k, "filled_rows": filled,
            "copies": tokens * model.top_k}


def _impl(mesh, smoke: bool) -> str:
    from europa_jax.parallel import sharding

    if sharding.mesh_platform(mesh) != "gpu":
        return "ragged_dot"
    return "tokamax_triton" if smoke else "tokamax"  # Mosaic does not lower the smoke widths


def moe_received_programs(model, execution, tokens: int, mesh, smoke: bool
                          ) -> dict[str, Program]:
    import jax
    import jax.numpy as jnp

    from europa_jax.model.experts import moe
    from europa_jax.model.experts.expert_matmul import compute_local_experts

    lay = received_layout(model, execution, tokens)
    e, d, f, u = model.n_routed_experts, model.d_model, model.expert_ffn_dim, model.top_k
    impl = _impl(mesh, smoke)
    groups = moe.expert_groups(tokens, model, execution, e)
    window = moe.expert_window_rows(tokens, model, execution, groups)

    def make_args():
        r = lay["rows"]
        per_row = lay["copies"] // lay["filled_rows"]  # local choices of a filled row
        key = jax.random.split(jax.random.key(0), 5)
        experts = jax.random.randint(key[0], (r, u), 0, e, jnp.int32)
        used = (jnp.arange(r)[:, None] < lay["filled_rows"]) & (jnp.arange(u) < per_row)
        return (jax.random.normal(key[1], (r, d), jnp.bfloat16),
                jnp.where(used, experts, -1),
                jax.random.uniform(key[2], (r, u), jnp.float32),
                jax.random.normal(key[3], (e, d, f), jnp.bfloat16) / 32,
                jax.random.normal(key[4], (e, d, f), jnp.bfloat16) / 32,
                jax.random.normal(key[0], (e, f, d), jnp.bfloat16) / 32)

    def loss(x, experts, gates, *w):
        y, _ = compute_local_experts(x, experts, gates, *w, impl=impl, groups=groups,
                                     window=window)
        return y.astype(jnp.float32).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5)))
    return {"fwd+bwd": Program(grad, make_args)}


def grouped_regime_programs(model, execution, tokens: int, mesh, smoke: bool
                            ) -> dict[str, Program]:
    """Forward, dgrad and wgrad of one grouped matmul [M, D] × [E, D, F] on a buffer of
    which the first rows are filled, evenly over the experts; and one expert window."""
    programs = {}
    for name, v in grouped_regime_shapes(model, execution, tokens, _impl(mesh, smoke)).items():
        programs.update(grouped_passes(model, _impl(mesh, smoke), v["rows"], v["filled"],
                                       v["experts"], prefix=f"{name}/"))
    return programs


def grouped_passes(model, impl: str, rows: int, filled: int, experts: int, *, prefix: str
                   ) -> dict[str, Program]:
    """`{prefix}fwd`, `dgrad`, `wgrad`: a grouped matmul's three passes on `rows` rows of
    which `filled` are spread evenly over `experts` ([E, D, F] weights; dgrad by the
    [E, F, D] layout; wgrad in float32)."""
    import jax
    import jax.numpy as jnp

    from europa_jax.model.experts import expert_windows

    d, f = model.d_model, model.expert_ffn_dim
    mm, contract = expert_windows.matmul_kernel(impl), expert_windows.contract_kernel(impl)

    def make_args():
        sizes = jnp.full((experts,), filled // experts, jnp.int32).at[-1].add(
            filled % experts)
        key = jax.random.split(jax.random.key(1), 4)
        return (jax.random.normal(key[0], (rows, d), jnp.bfloat16),
                jax.random.normal(key[1], (rows, f), jnp.bfloat16),
                jax.random.normal(key[2], (experts, d, f), jnp.bfloat16),
                jax.random.normal(key[3], (experts, f, d), jnp.bfloat16), sizes)

    return {f"{prefix}fwd": Program(jax.jit(lambda x, h, w, wt, s: mm(x, w, s)), make_args),
            f"{prefix}dgrad": Program(jax.jit(lambda x, h, w, wt, s: mm(h, wt, s)), make_args),
            f"{prefix}wgrad": Program(jax.jit(lambda x, h, w, wt, s: contract(x, h, s)),
                                      make_args)}


def grouped_regime_shapes(model, execution, tokens: int, impl: str = "tokamax") -> dict:
    """Rows, filled rows and experts of the two grouped-matmul regimes (the smoke size
    shrinks the buffer with the tokens)."""
    from europa_jax.model.experts import expert_windows, moe

    e = model.n_routed_experts
    scale = tokens / 65536
    groups = moe.expert_groups(tokens, model, execution, e)
    window = expert_windows.Windows(impl, groups,
                                    moe.expert_window_rows(tokens, model, execution, groups))
    return {"buffer": {"rows": max(64, round(GROUPED_BUFFER_ROWS * scale)),
                       "filled": max(16, round(GROUPED_FILLED_ROWS * scale)), "experts": e},
            "window": {"rows": window.window,
                       "filled": round(window.window / execution.moe_buffer_factor),
                       "experts": e // groups}}


def document_programs(model, execution, tokens: int, mesh, smoke: bool) -> dict[str, Program]:
    """The model's attention forward+backward on one document, and on 64 of equal length."""
    import jax
    import jax.numpy as jnp

    def with_documents(n: int):
        segments = (jnp.arange(tokens, dtype=jnp.int32) // (tokens // n) + 1)[None]
        attend = model_attention(model, execution, mesh, smoke, segments)
        return jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))

    make_args = attention_inputs(model, tokens)
    return {"one_document": Program(with_documents(1), make_args),
            "64_documents": Program(with_documents(64), make_args)}


def attention_inputs(model, tokens: int, seed: int = 0):
    """The maker of one row's q, k [1, S, H, K] and v [1, S, H, O] in bf16."""
    def make_args():
        import jax
        import jax.numpy as jnp

        h, qk, vd = model.n_heads, model.qk_head_dim, model.v_head_dim
        keys = jax.random.split(jax.random.key(seed), 3)
        return (jax.random.normal(keys[0], (1, tokens, h, qk), jnp.bfloat16),
                jax.random.normal(keys[1], (1, tokens, h, qk), jnp.bfloat16),
                jax.random.normal(keys[2], (1, tokens, h, vd), jnp.bfloat16))

    return make_args


def model_attention(model, execution, mesh, smoke: bool, segments_BS):
    """attend(q, k, v): the model's attention kernel on the mesh's platform (gpu_programs.
    attention_kernel), masked by these documents, with the model's backward chunk."""
    from europa_jax.model.attention import library_attention, blockwise_attention
    from gpu_programs import attention_kernel

    impl, scale = attention_kernel(execution, mesh, smoke), model.qk_head_dim ** -0.5

    def attend(q, k, v):
        if impl == "blockwise":
            return blockwise_attention(q, k, v, segments_BS, scale=scale,
                                       block_size=execution.attention_block_size)
        return library_attention(q, k, v, segments_BS, scale=scale, impl=impl,
                                 backward_chunk=execution.attention_backward_chunk)

    return attend


def fp8_programs(tokens: int, smoke: bool) -> dict[str, Program]:
    import jax
    import jax.numpy as jnp

    m, k, n = (tokens, 7168, 1536) if not smoke else (tokens, 256, 128)

    def make_args():
        keys = jax.random.split(jax.random.key(2), 2)
        return (jax.random.normal(keys[0], (m, k), jnp.bfloat16),
                jax.random.normal(keys[1], (k, n), jnp.bfloat16))

    def dot(dtype):
        def f(a, b):
            return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.bfloat16)
        return jax.jit(f)

    return {"bf16": Program(dot(jnp.bfloat16), make_args),
            "fp8_e4m3": Program(dot(jnp.float8_e4m3fn), make_args)}


def fp8_shape(tokens: int, smoke: bool) -> tuple[int, int, int]:
    return (tokens, 7168, 1536) if not smoke else (tokens, 256, 128)


def builders(cfg, tokens: int, smoke: bool) -> dict:
    model, ex = cfg.model, cfg.execution
    return {"moe_received": lambda mesh: moe_received_programs(model, ex, tokens, mesh, smoke),
            "grouped_regime": lambda mesh: grouped_regime_programs(model, ex, tokens, mesh,
                                                                   smoke),
            "documents": lambda mesh: document_programs(model, ex, tokens, mesh, smoke),
            "fp8_dot": lambda mesh: fp8_programs(tokens, smoke)}


# ----------------------------------------------------------------------------- timing


def kernel_time_split(trace_dir: str) -> dict:
    """Device time of a jax.profiler trace, matmul kernels (MATMUL_KERNELS) and the rest
    apart, and the longest other kernels: from the Perfetto trace's complete events on
    device tracks (processes named like a GPU)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"error": f"no trace in {trace_dir}"}
    with gzip.open(max(files, key=os.path.getmtime), "rt") as fh:
        trace = json.load(fh)
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    device_pids = {e["pid"] for e in events if e.get("ph") == "M"
                   and e.get("name") == "process_name"
                   and re.search(r"GPU|/device:", str(e.get("args", {}).get("name", "")))}
    split = {"matmul_s": 0.0, "other_s": 0.0}
    others: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        seconds = float(e.get("dur", 0)) / 1e6
        if MATMUL_KERNELS.search(e.get("name", "")):
            split["matmul_s"] += seconds
        else:
            split["other_s"] += seconds
            others[e["name"]] = others.get(e["name"], 0.0) + seconds
    total = split["matmul_s"] + split["other_s"]
    split["other_fraction"] = split["other_s"] / total if total else None
    split["longest_other"] = sorted(others.items(), key=lambda kv: -kv[1])[:8]
    return split


def profiled(fn, args, repeats: int) -> dict:
    """Best wall time over `repeats`, then one traced run split by kernel class."""
    import jax


    seconds = timed(fn, *args, repeats=repeats)
    with tempfile.TemporaryDirectory(prefix="gpu_check-trace-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn(*args))
        return {"seconds": seconds, "profile": kernel_time_split(trace_dir)}


def check_moe_received(programs, model, execution, tokens: int, mesh, repeats: int) -> dict:
    from gpu_programs import inputs

    program = programs["fwd+bwd"]
    lay = received_layout(model, execution, tokens)
    work = 3 * 2.0 * lay["copies"] * 3 * model.d_model * model.expert_ffn_dim  # fwd+bwd
    out = {**lay, "flops": work, **profiled(program.fn, inputs(program, mesh), repeats)}
    out["tflops"] = work / out["seconds"] / 1e12
    return out


def check_grouped_regime(programs, model, execution, tokens: int, mesh, smoke: bool,
                         repeats: int) -> dict:
    from gpu_programs import inputs

    out = {}
    for name, shape in grouped_regime_shapes(model, execution, tokens,
                                             _impl(mesh, smoke)).items():
        work = 2.0 * shape["filled"] * model.d_model * model.expert_ffn_dim
        part = out[name] = {**shape, "flops_per_pass": work}
        for kind in ("fwd", "dgrad", "wgrad"):
            program = programs[f"{name}/{kind}"]
            section(part, kind, lambda: {"tflops_filled": work / timed(
                program.fn, *inputs(program, mesh), repeats=repeats) / 1e12})
    return out


def check_documents(programs, model, execution, tokens: int, mesh, repeats: int) -> dict:
    from gpu_programs import inputs

    out = {"tokens": tokens, "backward_chunk": execution.attention_backward_chunk}
    for name, program in programs.items():
        section(out, name, lambda: {"seconds": timed(program.fn, *inputs(program, mesh),
                                                     repeats=repeats)})
    one, many = out["one_document"].get("seconds"), out["64_documents"].get("seconds")
    out["64_over_one"] = many / one if one and many else None
    return out


def check_fp8(programs, tokens: int, smoke: bool, mesh, repeats: int) -> dict:
    from gpu_programs import inputs

    m, k, n = fp8_shape(tokens, smoke)
    out = {"shape": [m, k, n]}
    for name, program in programs.items():
        section(out, name, lambda: {"tflops": 2.0 * m * k * n / timed(
            program.fn, *inputs(program, mesh), repeats=repeats) / 1e12})
    bf16, fp8 = out["bf16"].get("tflops"), out["fp8_e4m3"].get("tflops")
    out["fp8_over_bf16"] = fp8 / bf16 if bf16 and fp8 else None
    return out


class Clocks:
    """nvidia-smi polled in the background while the checks run: SM and memory clocks
    (MHz), power (W) and temperature (°C), summarized as min / median / max."""

    FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")

    def __init__(self, period_s: float = 0.5):
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            try:
                line = subprocess.run(
                    ["nvidia-smi", f"--query-gpu={','.join(self.FIELDS)}",
                     "--format=csv,noheader,nounits", "-i", "0"], capture_output=True,
                    text=True, timeout=5).stdout.strip()
                self.samples.append([float(v) for v in line.split(",")])
            except (OSError, ValueError, subprocess.SubprocessError):
                return  # no nvidia-smi: nothing to report
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self) -> dict:
        if not self.samples:
            return {"error": "nvidia-smi gave no readings"}
        out = {"samples": len(self.samples)}
        for i, field in enumerate(self.FIELDS):
            values = sorted(s[i] for s in self.samples)
            out[field] = {"min": values[0], "median": values[len(values) // 2],
                          "max": values[-1]}
        return out


def table_rows(results: dict, get) -> list[tuple[str, str, str]]:
    """gpu_check's summary lines for these checks (`get` reads a path of the results)."""
    rows = [("MoE received rows fwd+bwd TFLOP/s", get("moe_received", "tflops"),
             f"{get('moe_received', 'profile', 'other_fraction', fmt='{:.0%}')} of kernel time "
             "not matmuls")]
    for name in ("buffer", "window"):
        for kind in ("fwd", "dgrad", "wgrad"):
            rows.append((f"grouped {name} {kind} TFLOP/s (filled rows)",
                         get("grouped_regime", name, kind, "tflops_filled"), ""))
    rows += [("attention 64 docs / 1 doc time", get("documents", "64_over_one",
                                                     fmt="{:.3f}"), "fwd+bwd, 65,536 tokens"),
             ("fp8 / bf16 dot_general", get("fp8_dot", "fp8_over_bf16", fmt="{:.2f}"),
              f"bf16 {get('fp8_dot', 'bf16', 'tflops')} TFLOP/s"),
             ("SM clock MHz (median)", get("clocks", "clocks.sm", "median"),
              f"power median {get('clocks', 'power.draw', 'median')} W")]
    return rows
