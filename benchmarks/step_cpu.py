"""Step time and MFU of `small-cpu` on the 8-device CPU mesh, against a matmul peak
measured in the same run (these machines are noisy: compare ratios, not seconds).

    python benchmarks/step_cpu.py [--config configs/small-cpu.yaml] [--steps 5] [--json OUT]

Runs the real train step with float32 and with bfloat16 compute, so the choice of
`compute_dtype` for CPU configs rests on a measurement.
"""

from __future__ import annotations

import argparse
import json
import time


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best-of float32 FLOP/s of one large matmul on this host (all cores)."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices()[0])
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def time_steps(cfg, steps: int) -> tuple[float, float]:
    """Median step seconds after compile, and the analytic FLOPs of one step."""
    import jax

    from europa_jax.model import flops
    from europa_jax.run import loop
    from europa_jax.parallel import sharding
    from europa_jax.train import train

    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    state = train.init_state(trainer, cfg.train.seed)
    step_fn = train.jit_train_step(trainer)
    batches = loop.device_batches(trainer, loop.host_batch_iterator(cfg))
    times, step_flops = [], 0.0
    with jax.set_mesh(mesh):
        for i in range(steps + 1):
            host_batch, batch = next(batches)
            start = time.perf_counter()
            state, metrics = step_fn(state, batch)
            jax.block_until_ready(metrics)
            if i:  # step 0 compiles
                times.append(time.perf_counter() - start)
            step_flops = flops.train_flops(cfg.model, host_batch["tokens"].size,
                                           flops.causal_pairs(host_batch["segment_ids"]))
    return sorted(times)[len(times) // 2], step_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small-cpu.yaml")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import dataclasses

    import jax

    from europa_jax.config_loader import load_config

    cfg = load_config(args.config)
    jax.config.update("jax_num_cpu_devices", cfg.mesh.n_devices)
    peak = matmul_peak_flops()
    results = {"config": args.config, "host_matmul_peak_gflops": peak / 1e9, "runs": []}
    for dtype in ("float32", "bfloat16"):
        run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                     compute_dtype=dtype))
        step_s, step_flops = time_steps(run_cfg, args.steps)
        tokens = cfg.data.global_batch_size * cfg.data.seq_len
        results["runs"].append({"compute_dtype": dtype, "step_time_s": step_s,
                                "tokens_per_s": tokens / step_s,
                                "model_gflops_per_step": step_flops / 1e9,
                                "mfu_vs_host_matmul_peak": step_flops / step_s / peak})
    f32, bf16 = results["runs"]
    results["bf16_over_f32_step_time"] = bf16["step_time_s"] / f32["step_time_s"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"host float32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"{'compute':>10} {'step s':>8} {'tokens/s':>9} {'GFLOP/step':>11} {'MFU':>7}")
    for r in results["runs"]:
        print(f"{r['compute_dtype']:>10} {r['step_time_s']:8.3f} {r['tokens_per_s']:9.0f} "
              f"{r['model_gflops_per_step']:11.2f} {r['mfu_vs_host_matmul_peak']:7.1%}")
    print(f"bf16 / f32 step time: {results['bf16_over_f32_step_time']:.2f}")


if __name__ == "__main__":
    main()
