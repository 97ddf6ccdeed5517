"""One GPU, under five minutes: are europa-952b's kernels fast here, and is offload cheap?

    python benchmarks/gpu_check.py [--json gpu_check.json] [--tokens N] [--cpu-smoke]

On a GPU (H100/H200/GH200) it runs at europa-952b's per-GPU shapes — expert parallelism
4, so 96 local experts, and 65,536 tokens whose 8 routed copies (524,288 rows) land on
this GPU's experts under even routing:
1. one MoE decoder layer (MLA attention + MoE, the model's own code; weights in bf16 as
   the FSDP gather delivers them), forward+backward: achieved TFLOP/s against the chip's
   bf16 peak, and peak HBM;
2. the grouped matmul alone (`jax.lax.ragged_dot`, and `tokamax.ragged_dot` if installed)
   against one dense matmul of the same shape and FLOPs: well below 1 means a slow path;
3. attention alone, forward+backward: the model's blockwise kernel against cuDNN flash
   attention (causal, one document; v padded to the qk width cuDNN needs);
4. copies to and from `pinned_host` memory: the offload path (NVLink-C2C on a GH200).
Each part reports its own error instead of stopping the others (e.g. out of memory).
Without a GPU, or with --cpu-smoke, the same code runs at a tiny size so that it cannot
rot; those numbers say nothing about any GPU. The table comes last; JSON is written too.
FLOPs follow flops.py: forward+backward = 3 × forward, causal attention counts S(S+1)/2
query-key pairs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Dense bf16 peaks by device kind (hardware.py cites the Hopper figure).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}
SMOKE_MODEL = dict(d_model=64, n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, dense_ffn_dim=128, n_routed_experts=8,
                   expert_ffn_dim=32, top_k=4, n_group=4, topk_group=2,
                   attention_block_size=64, vocab_size=512, vocab_pad_multiple=128)
LOCAL_EXPERTS = 96  # europa-952b's 384 experts over the 4 GPUs of a node


def timed(fn, *args, repeats: int) -> float:
    """Best wall time of `fn(*args)` after one compile-and-warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def section(results: dict, name: str, fn) -> None:
    """Run one check; an exception (OOM, missing kernel) is recorded, not fatal."""
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - the report must survive any one failure
        results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def layer_config(smoke: bool):
    """europa-952b's ModelConfig as one MoE layer on one GPU of an expert-parallel node."""
    from europa_jax.config_loader import load_config

    cfg = load_config(os.path.join(REPO, "configs", "europa-952b.yaml"))
    model = dict(n_routed_experts=LOCAL_EXPERTS, param_dtype="bfloat16")
    if smoke:
        model.update(SMOKE_MODEL)
    return dataclasses.replace(cfg.model, n_layers=1, n_dense_layers=0, **model)


def layer_flops(model, tokens: int) -> float:
    """Forward+backward FLOPs of one MoE layer on one causal document of `tokens`."""
    from europa_jax import flops

    pairs = tokens * (tokens + 1) // 2
    head = 6.0 * model.d_model * model.vocab_size * tokens  # train_flops counts the LM head
    return flops.train_flops(model, tokens, pairs) - head


def check_layer(model, tokens: int, peak: float | None, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from europa_jax.model.layers import rope_tables
    from europa_jax.model.transformer import DecoderBlock

    block = DecoderBlock(model, is_moe=True)
    positions_BS = jnp.arange(tokens, dtype=jnp.int32)[None]
    segments_BS = jnp.ones((1, tokens), jnp.int32)
    cos_BSP2, sin_BSP2 = rope_tables(positions_BS, model)
    bias_E = jnp.zeros((model.n_routed_experts,), jnp.float32)
    x_BSD = jax.random.normal(jax.random.key(0), (1, tokens, model.d_model), jnp.bfloat16)
    params = jax.jit(block.init)(jax.random.key(1), x_BSD, segments_BS, cos_BSP2, sin_BSP2,
                                 bias_E)

    def loss(params, x_BSD):
        y_BSD, _ = block.apply(params, x_BSD, segments_BS, cos_BSP2, sin_BSP2, bias_E)
        return y_BSD.astype(jnp.float32).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    seconds = timed(step, params, x_BSD, repeats=repeats)
    stats = jax.devices()[0].memory_stats() or {}
    memory = step.lower(params, x_BSD).compile().memory_analysis()
    work = layer_flops(model, tokens)
    return {"tokens": tokens, "local_experts": model.n_routed_experts,
            "routed_rows": tokens * model.top_k, "seconds": seconds, "flops": work,
            "tflops": work / seconds / 1e12, "mfu": work / seconds / peak if peak else None,
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "xla_bytes": memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes}


def check_grouped_matmul(model, tokens: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    e, d, f = model.n_routed_experts, model.d_model, model.expert_ffn_dim
    rows = tokens * model.top_k
    sizes_E = jnp.full((e,), rows // e, jnp.int32).at[-1].add(rows % e)  # even routing
    x_MD = jax.random.normal(jax.random.key(0), (rows, d), jnp.bfloat16)
    w_EDF = jax.random.normal(jax.random.key(1), (e, d, f), jnp.bfloat16)
    work = 2.0 * rows * d * f
    kernels = {"dense_matmul": (jax.jit(lambda x, w: x @ w[0]), (x_MD, w_EDF)),
               "lax.ragged_dot": (jax.jit(jax.lax.ragged_dot), (x_MD, w_EDF, sizes_E))}
    try:
        import tokamax

        kernels["tokamax.ragged_dot"] = (jax.jit(tokamax.ragged_dot), (x_MD, w_EDF, sizes_E))
    except ImportError:
        pass
    out = {"rows": rows, "experts": e, "shape": [rows, d, f], "flops": work}
    for name, (fn, args) in kernels.items():
        section(out, name, lambda: {"tflops": work / timed(fn, *args, repeats=repeats) / 1e12})
    dense = out["dense_matmul"].get("tflops")
    for name in kernels:
        if name != "dense_matmul" and dense and "tflops" in out[name]:
            out[name]["vs_dense"] = out[name]["tflops"] / dense
    return out


def check_attention(model, tokens: int, gpu: bool, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from europa_jax.model.attention import blockwise_attention

    h, qk, vd = model.n_heads, model.qk_head_dim, model.v_head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q_BSHK, k_BSHK = (jax.random.normal(key, (1, tokens, h, qk), jnp.bfloat16)
                      for key in keys[:2])
    v_BSHO = jax.random.normal(keys[2], (1, tokens, h, vd), jnp.bfloat16)
    segments = jnp.ones((1, tokens), jnp.int32)
    pairs = tokens * (tokens + 1) // 2

    def fwd_bwd(attend):
        return jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))

    ours = fwd_bwd(lambda q, k, v: blockwise_attention(
        q, k, v, segments, block_size=model.attention_block_size, scale=qk ** -0.5))
    # cuDNN wants one head width for q, k and v: pad v (its FLOPs counted as padded)
    v_padded_BSHK = jnp.pad(v_BSHO, ((0, 0), (0, 0), (0, 0), (0, qk - vd)))
    reference_name = "cudnn" if gpu else "xla (reference)"
    reference = fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn" if gpu else "xla"))
    out = {"tokens": tokens, "heads": h}
    section(out, "blockwise (model)", lambda: {"tflops": 6.0 * h * (qk + vd) * pairs / timed(
        ours, q_BSHK, k_BSHK, v_BSHO, repeats=repeats) / 1e12})
    section(out, reference_name, lambda: {"tflops": 6.0 * h * 2 * qk * pairs / timed(
        reference, q_BSHK, k_BSHK, v_padded_BSHK, repeats=repeats) / 1e12})
    ref = out[reference_name].get("tflops")
    if ref and "tflops" in out["blockwise (model)"]:
        out["blockwise (model)"]["vs_reference"] = out["blockwise (model)"]["tflops"] / ref
    return out


def check_offload(n_bytes: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    device = jax.devices()[0]
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    to_host = SingleDeviceSharding(device, memory_kind="pinned_host")
    to_device = SingleDeviceSharding(device, memory_kind="device")
    on_host = jax.device_put(x, to_host)
    out = {"bytes": n_bytes, "memory_kind": on_host.sharding.memory_kind}
    out["device_to_host_gbps"] = n_bytes / timed(lambda a: jax.device_put(a, to_host), x,
                                                 repeats=repeats) / 1e9
    out["host_to_device_gbps"] = n_bytes / timed(lambda a: jax.device_put(a, to_device),
                                                 on_host, repeats=repeats) / 1e9
    return out


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
    rows += [("attention (model) TFLOP/s", get(at, "blockwise (model)", "tflops"),
              f"{get(at, 'blockwise (model)', 'vs_reference', fmt='{:.2f}')} × reference"),
             ("device→pinned_host GB/s", get("offload", "device_to_host_gbps"), ""),
             ("pinned_host→device GB/s", get("offload", "host_to_device_gbps"), "")]
    errors = [f"{name}: {part['error']}" for name, part in results.items()
              if isinstance(part, dict) and "error" in part]
    errors += [f"{name}/{sub}: {v['error']}" for name, part in results.items()
               if isinstance(part, dict) for sub, v in part.items()
               if isinstance(v, dict) and "error" in v]
    width = max(len(r[0]) for r in rows)
    return "\n".join([f"{name:<{width}}  {value:>10}  {note}" for name, value, note in rows]
                     + errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu_check.json", help="where the results go")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on whatever backend there is (automatic without a GPU)")
    parser.add_argument("--tokens", type=int, help="tokens per GPU (default: 65,536; 256 smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax

    gpu = jax.default_backend() == "gpu"
    smoke = args.cpu_smoke or not gpu
    tokens = args.tokens or (256 if smoke else 65536)
    device = jax.devices()[0]
    peak = next((v for k, v in PEAK_BF16.items() if k in device.device_kind), None)
    results = {"device": device.device_kind, "backend": jax.default_backend(), "smoke": smoke,
               "peak_bf16_tflops": peak / 1e12 if peak else None}
    model = layer_config(smoke)
    start = time.perf_counter()
    section(results, "layer", lambda: check_layer(model, tokens, peak, args.repeats))
    section(results, "grouped_matmul", lambda: check_grouped_matmul(model, tokens, args.repeats))
    section(results, "attention", lambda: check_attention(model, tokens, gpu, args.repeats))
    section(results, "offload", lambda: check_offload(2**30 if not smoke else 2**24,
                                                      args.repeats))
    results["seconds"] = time.perf_counter() - start
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    if smoke:
        print("smoke run at tiny shapes: checks that the script works, measures nothing")
    print(table(results))


if __name__ == "__main__":
    main()
