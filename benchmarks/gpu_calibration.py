"""gpu_check.py's calibration: the efficiencies plan/price/hardware.py assumes, measured on one
GPU at europa-952b's per-GPU shapes and written as `europa-jax plan --hardware` reads them.

Each class of kernel the plan prices (europa_jax/plan/price/step_time.py) at what it measures:
- `dense_gemm`: the model's dense GEMMs at 65,536 tokens — q_a, q_b, kv_a, kv_b, o, the
  shared expert, the router (all 384 experts' scores) and an LM-head chunk of 4,096 rows
  — one point per smallest dimension (the plan's curve is by it);
- `grouped_gemm`: tokamax's grouped matmul forward, dgrad and wgrad on an expert window
  of the shipped layout (8 experts, ~5,500 rows each) and on windows of a quarter and a
  sixteenth of its rows: one point per rows per expert;
- `attention_forward` / `attention_backward`: the model's flash attention on one
  65,536-token document with the model's heads, forward alone and forward+backward (the
  backward is the difference), FLOPs at the pairs the kernels run
  (flash_backward.kernel_pair_fraction), the backward's at the head dims' ratio
  (step_time.backward_per_forward), as the plan counts them;
- `memory_bound`: a triad and an RMSNorm on a [65,536, 7,168] bf16 activation, bytes
  read and written over the device's HBM peak;
- `host_copy`: 1 GiB to and from pinned host memory, the slower way over 450 GB/s — on a
  GH200 only (elsewhere the host link is PCIe, not NVLink-C2C).
Each efficiency is a range from the repeats: the slowest run's (low), the median's
(expected) and the fastest's (high). NVLink and InfiniBand need more than one GPU: they
stay assumed. Imports of jax and the project stay inside functions.
"""

from __future__ import annotations

import datetime
import statistics
import time

from gpu_programs import OFFLOAD_BYTES, Program, inputs, offload_programs
from gpu_regimes import (_impl, attention_inputs, grouped_passes, grouped_regime_shapes,
                         model_attention)
from gpu_shared import one_line

C2C_BANDWIDTH = 450e9  # per direction (europa_jax/plan/price/hardware.py [jsc])
# HBM peaks by device kind (vendor datasheets; gpu_target.TARGETS); a GH200 with more
# than 100 GB for XLA is the 144 GB HBM3e part.
HBM_PEAK = (("GH200", 4.0e12), ("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12))
GH200_HBM3E = 4.9e12
LM_HEAD_ROWS = 4096  # the loss's rows per vocabulary chunk in the europa-952b program


def dense_shapes(model, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of each dense GEMM of a layer (and the LM head) on `tokens` tokens."""
    h, d = model.n_heads, model.d_model
    return {"q_a": (tokens, d, model.q_lora_rank),
            "q_b": (tokens, model.q_lora_rank, h * model.qk_head_dim),
            "kv_a": (tokens, d, model.kv_lora_rank + model.qk_rope_head_dim),
            "kv_b": (tokens, model.kv_lora_rank, h * (model.qk_nope_head_dim + model.v_head_dim)),
            "o": (tokens, h * model.v_head_dim, d),
            "shared_expert": (tokens, d, model.expert_ffn_dim * max(1, model.n_shared_experts)),
            "router": (tokens, d, model.n_routed_experts * 4),  # 4: the node's expert axis
            "lm_head": (min(tokens, LM_HEAD_ROWS), d, model.vocab_size)}


def grouped_shapes(model, execution, tokens: int, impl: str) -> dict[str, dict]:
    """Windows of the shipped layout's size and of a quarter and a sixteenth of it (whole
    kernel tiles), each with its filled rows and experts."""
    window = grouped_regime_shapes(model, execution, tokens, impl)["window"]
    out = {}
    for name, part in (("window", 1), ("quarter", 4), ("sixteenth", 16)):
        rows = max(128, -(-window["rows"] // part // 128) * 128)
        out[name] = {"rows": rows, "experts": window["experts"],
                     "filled": max(window["experts"],
                                   round(rows * window["filled"] / window["rows"]))}
    return out


def programs(cfg, tokens: int, mesh, smoke: bool) -> dict[str, Program]:
    import jax
    import jax.numpy as jnp

    model, out, d = cfg.model, {}, cfg.model.d_model
    for name, (m, k, n) in dense_shapes(model, tokens).items():
        def make_dense(m=m, k=k, n=n):
            keys = jax.random.split(jax.random.key(3), 2)
            return (jax.random.normal(keys[0], (m, k), jnp.bfloat16),
                    jax.random.normal(keys[1], (k, n), jnp.bfloat16) / 32)
        out[f"dense/{name}"] = Program(jax.jit(lambda a, b: a @ b), make_dense)

    impl = _impl(mesh, smoke)
    for name, shape in grouped_shapes(model, cfg.execution, tokens, impl).items():
        out.update(grouped_passes(model, impl, shape["rows"], shape["filled"], shape["experts"],
                                  prefix=f"grouped/{name}/"))

    # the model's kernel on one document (segments of ones)
    attend = model_attention(model, cfg.execution, mesh, smoke, jnp.ones((1, tokens), jnp.int32))
    make_attention = attention_inputs(model, tokens, seed=5)
    out["attention/forward"] = Program(jax.jit(attend), make_attention)
    out["attention/forward+backward"] = Program(jax.jit(jax.grad(
        lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))),
        make_attention)

    def make_activation():
        keys = jax.random.split(jax.random.key(6), 3)
        return (jax.random.normal(keys[0], (tokens, d), jnp.bfloat16),
                jax.random.normal(keys[1], (tokens, d), jnp.bfloat16),
                jax.random.normal(keys[2], (d,), jnp.bfloat16))

    def rms_norm(x, _, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
                ).astype(x.dtype) * w

    out["memory/triad"] = Program(jax.jit(lambda a, b, w: a + 3 * b), make_activation)
    out["memory/rms_norm"] = Program(jax.jit(rms_norm), make_activation)
    for name, program in offload_programs(OFFLOAD_BYTES[smoke], mesh).items():
        out[f"host/{name}"] = program
    return out


def run_times(fn, args, repeats: int) -> list[float]:
    """Every run's wall time after one compile-and-warm-up call, sorted."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)


def efficiency(work: float, times: list[float], peak: float) -> dict[str, float]:
    """The range of `work / time / peak` over the runs: slowest, median, fastest."""
    return {"low": work / times[-1] / peak, "expected": work / statistics.median(times) / peak,
            "high": work / times[0] / peak}


def _sum_times(*runs: list[float]) -> list[float]:
    """Run-by-run sums of several programs' sorted times (slowest with slowest …)."""
    return [sum(t) for t in zip(*runs)]


def hbm_peak(device) -> float:
    kind = device.device_kind
    peak = next((v for k, v in HBM_PEAK if k in kind), HBM_PEAK[0][1])
    limit = (device.memory_stats() or {}).get("bytes_limit", 0) if device.platform == "gpu" else 0
    return GH200_HBM3E if "GH200" in kind and limit > 100e9 else peak


def calibrate(built: dict[str, Program], cfg, tokens: int, mesh, smoke: bool, repeats: int,
              flops_peak: float) -> dict:
    """Time every program and turn the times into the calibration plan/price/hardware.py reads.
    A class that fails records its error; the others still count."""
    from europa_jax.model import flash_backward
    from europa_jax.model.attention import LIBRARY_SEQ_MULTIPLE, backward_chunk_for
    from europa_jax.plan.price import step_time

    device = mesh.devices.flat[0]
    peaks = {"bf16_flops": flops_peak, "hbm_bandwidth": hbm_peak(device),
             "c2c_bandwidth": C2C_BANDWIDTH}
    out = {"device": device.device_kind, "date": datetime.date.today().isoformat(),
           "smoke": smoke, "tokens": tokens, "repeats": repeats, "peaks": peaks}
    times = {}

    def timed(name):
        if name not in times:
            times[name] = run_times(built[name].fn, inputs(built[name], mesh), repeats)
        return times[name]

    def part(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - one class failing must not lose the rest
            out[name] = {"error": one_line(e)}

    model, execution = cfg.model, cfg.execution

    def dense():
        points = {}
        for name, (m, k, n) in dense_shapes(model, tokens).items():
            points.setdefault(min(m, k, n), []).append(
                (name, [m, k, n], efficiency(2.0 * m * k * n, timed(f"dense/{name}"),
                                             peaks["bf16_flops"])))
        return {"points": [_merged(size, rows) for size, rows in sorted(points.items())]}

    def grouped():
        points = []
        for name, shape in grouped_shapes(model, execution, tokens,
                                          _impl(mesh, smoke)).items():
            work = 3 * 2.0 * shape["filled"] * model.d_model * model.expert_ffn_dim
            runs = _sum_times(*(timed(f"grouped/{name}/{kind}")
                                for kind in ("fwd", "dgrad", "wgrad")))
            points.append({"size": shape["filled"] / shape["experts"], "shape": dict(shape),
                           "efficiency": efficiency(work, sorted(runs), peaks["bf16_flops"])})
        return {"points": sorted(points, key=lambda p: p["size"])}

    s = tokens
    chunk = backward_chunk_for(s, execution.attention_backward_chunk)
    run = flash_backward.kernel_pair_fraction([s], seq_len=-(-s // (chunk or s)) * (chunk or s),
                                              chunk=chunk or s, tile=LIBRARY_SEQ_MULTIPLE)
    per_pass = (2.0 * (model.qk_head_dim + model.v_head_dim) * model.n_heads
                * s * (s + 1) / 2)

    def attention_forward():
        return {"efficiency": efficiency(per_pass * run["forward"], timed("attention/forward"),
                                         peaks["bf16_flops"])}

    def attention_backward():
        fwd, both = timed("attention/forward"), timed("attention/forward+backward")
        backward = sorted(b - f for b, f in zip(both, fwd))
        if backward[0] <= 0:
            raise ValueError(f"forward+backward {both[0]:.3g} s is not slower than the "
                             f"forward {fwd[0]:.3g} s: no backward time to measure")
        # FLOPs as the plan prices them: the backward's five matmuls at the model's head
        # dims (2.6 × the forward at MLA's 192/128)
        ratio = step_time.backward_per_forward(model.qk_head_dim, model.v_head_dim)
        return {"efficiency": efficiency(ratio * per_pass * run["backward"], backward,
                                         peaks["bf16_flops"])}

    def memory_bound():
        act = tokens * model.d_model * 2  # bf16
        triad = efficiency(3 * act, timed("memory/triad"), peaks["hbm_bandwidth"])
        norm = efficiency(2 * act, timed("memory/rms_norm"), peaks["hbm_bandwidth"])
        return {"efficiency": {c: (triad[c] + norm[c]) / 2 for c in triad},
                "triad": triad, "rms_norm": norm}

    def host_copy():
        from gpu_programs import OFFLOAD_BYTES

        if "GH200" not in device.device_kind and not smoke:
            raise ValueError(f"{device.device_kind} is not a GH200: its host link is not "
                             "NVLink-C2C")
        n = OFFLOAD_BYTES[smoke]
        ways = {w: efficiency(n, timed(f"host/{w}"), C2C_BANDWIDTH)
                for w in ("device_to_host", "host_to_device")}
        slower = min(ways.values(), key=lambda e: e["expected"])
        return {"efficiency": slower, **ways}

    for name, fn in (("dense_gemm", dense), ("grouped_gemm", grouped),
                     ("attention_forward", attention_forward),
                     ("attention_backward", attention_backward),
                     ("memory_bound", memory_bound), ("host_copy", host_copy)):
        part(name, fn)
    return out


def _merged(size: int, rows: list) -> dict:
    """One curve point of GEMMs that share their smallest dimension: their mean."""
    eff = {c: statistics.mean(r[2][c] for r in rows) for c in ("low", "expected", "high")}
    return {"size": size, "shape": "; ".join(f"{n} {'×'.join(map(str, s))}" for n, s, _ in rows),
            "efficiency": eff}


def table_rows(cal: dict) -> list[tuple[str, str, str]]:
    """gpu_check's summary lines: each calibrated class's expected efficiency."""
    rows = []
    for name in ("dense_gemm", "grouped_gemm", "attention_forward", "attention_backward",
                 "memory_bound", "host_copy"):
        part = cal.get(name, {})
        if "error" in part or not part:
            rows.append((f"calibration {name}", "error", part.get("error", "not run")))
        elif "points" in part:
            rows.append((f"calibration {name}", ", ".join(
                f"{p['efficiency']['expected']:.1%}" for p in part["points"]),
                "at " + ", ".join(f"{p['size']:,.0f}" for p in part["points"])))
        else:
            rows.append((f"calibration {name}", f"{part['efficiency']['expected']:.1%}", ""))
    return rows
