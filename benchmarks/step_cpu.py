"""Step time, tokens/s and MFU of a config's train step on the CPU mesh, against a matmul
peak measured in the same run; before/after against another revision; where time goes.

    python benchmarks/step_cpu.py [--config configs/small-cpu.yaml] [--dtypes float32,bfloat16]
                                  [--steps 8] [--repeats 1] [--against REV]
                                  [--against-python PYTHON] [--profile DIR] [--json OUT]

Each measurement is `europa-jax train` in a process of its own (the real loop: batches,
step, metrics), the median step over steps 4..N (step 1 compiles, 2–3 warm up), as
`benchmarks/maxtext_cpu.sh` measures MaxText. `--against REV` checks REV out into a
temporary git worktree and measures it on the very same config file, alternating with
this tree repetition by repetition, so both see the same machine load: these machines
are noisy, only ratios measured in one run count. `--against-python` runs REV with another
interpreter (a venv of REV's own dependencies, e.g. the jax stack before an upgrade); the
default corpus is that interpreter's standard library, so give both the same corpus then
(`--set data.source=prepared --set data.path=DIR`). `--profile DIR` traces one step of this
tree (jax.profiler, Perfetto) and prints where its device time goes, by part of the
model (profile_breakdown.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_TIMED_STEP = 4


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


def run_train(tree: Path, config: Path, dtype: str, steps: int,
              overrides: tuple[str, ...] = (), python: str = sys.executable) -> dict:
    """One `europa-jax train` of `tree`'s code by `python` on `config`: its step times
    (after the compile and warm-up steps), median, and the run's final loss."""
    with tempfile.TemporaryDirectory(prefix="step_cpu-") as run_dir:
        env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
        command = [python, "-m", "europa_jax.cli", "train", str(config), "--quiet",
                   "--run-dir", run_dir, "--set", f"train.steps={steps}",
                   "--set", f"execution.compute_dtype={dtype}", "--set", "train.log_every=1",
                   "--set", "train.eval_every=0", *(a for o in overrides for a in ("--set", o))]
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{tree}: train failed ({done.returncode}): "
                               f"{done.stderr.strip().splitlines()[-1:]}")
        records = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    timed = [r["step_time_s"] for r in records if r["step"] >= FIRST_TIMED_STEP]
    return {"step_time_s": statistics.median(timed), "step_times_s": timed,
            "losses": [r["loss"] for r in records]}


def model_flops_per_step(config: Path, steps: int) -> float:
    """Analytic FLOPs of one step (6·N·tokens + attention pairs), averaged over the
    batches the timed steps train on."""
    from europa_jax.config_loader import load_config
    from europa_jax.model import flops
    from europa_jax.run import loop

    cfg = load_config(str(config))
    batches = loop.host_batch_iterator(cfg)
    per_step = [flops.train_flops(cfg.model, b["tokens"].size, flops.causal_pairs(
        b["segment_ids"])) for _, b in zip(range(steps), batches)]
    return statistics.mean(per_step[FIRST_TIMED_STEP - 1:])


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), rev],
                   check=True, capture_output=True)
    return into


def profile(config: Path, dtype: str, out_dir: Path) -> dict[str, float]:
    """Trace one step (after compile and warm-up) of this tree; seconds per category."""
    import dataclasses

    import jax

    from europa_jax.config_loader import load_config
    from europa_jax.parallel import sharding
    from europa_jax.run import loop
    from europa_jax.train import train
    from profile_breakdown import breakdown

    cfg = load_config(str(config))
    cfg = dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution,
                                                                 compute_dtype=dtype))
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    state = train.init_state(trainer, cfg.train.seed)
    step = train.jit_train_step(trainer)
    batches = loop.device_batches(trainer, loop.host_batch_iterator(cfg))
    with jax.set_mesh(mesh):
        for _ in range(FIRST_TIMED_STEP):
            state, metrics = step(state, next(batches)[1])
            jax.block_until_ready(metrics)
        batch = next(batches)[1]
        jax.profiler.start_trace(str(out_dir), create_perfetto_trace=True)
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        hlo = step.lower(state, batch).compile().as_text()
    return breakdown(str(out_dir), hlo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small-cpu.yaml")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, for every tree measured")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--against", metavar="REV", help="also measure this git revision")
    parser.add_argument("--against-python", metavar="PYTHON", default=sys.executable,
                        help="the interpreter that runs REV (default: this one)")
    parser.add_argument("--profile", metavar="DIR", help="trace a step of this tree into DIR")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    config = (ROOT / args.config).resolve()
    dtypes = args.dtypes.split(",")

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    peak = matmul_peak_flops()
    step_flops = model_flops_per_step(config, args.steps)
    tokens = _tokens(config)
    results = {"config": args.config, "host_matmul_peak_gflops": peak / 1e9,
               "model_gflops_per_step": step_flops / 1e9, "steps": args.steps, "runs": []}
    with tempfile.TemporaryDirectory(prefix="step_cpu-rev-") as scratch:
        trees = {"this tree": (ROOT, sys.executable)}
        if args.against:
            trees = {args.against: (checkout(args.against, Path(scratch) / "rev"),
                                    args.against_python), **trees}
        try:
            for dtype in dtypes:
                for repeat in range(args.repeats):
                    for name, (tree, python) in trees.items():  # alternating: same load
                        run = run_train(tree, config, dtype, args.steps, tuple(args.set), python)
                        run.update(tree=name, compute_dtype=dtype, repeat=repeat,
                                   tokens_per_s=tokens / run["step_time_s"],
                                   mfu_vs_host_matmul_peak=step_flops / run["step_time_s"] / peak)
                        results["runs"].append(run)
                        print(f"{name:>12} {dtype:>9} step {run['step_time_s']:.3f} s", flush=True)
        finally:
            if args.against:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(Path(scratch) / "rev")], capture_output=True)
    summary = {}
    for dtype in dtypes:
        for name in trees:
            times = [r["step_time_s"] for r in results["runs"]
                     if r["tree"] == name and r["compute_dtype"] == dtype]
            summary[f"{name} {dtype}"] = statistics.median(times)
        if args.against:
            summary[f"speedup {dtype}"] = (summary[f"{args.against} {dtype}"]
                                           / summary[f"this tree {dtype}"])
    results["median_step_time_s"] = summary
    if args.profile:
        seconds = profile(config, dtypes[0], Path(args.profile))
        total = sum(seconds.values())
        results["profile_device_seconds"] = seconds
        print(f"\nwhere one step's device time goes ({dtypes[0]}, {total:.1f} s over "
              "all devices):")
        for name, value in seconds.items():
            print(f"  {name:42s} {value:7.2f} s {value / total:6.1%}")
    print(f"\nhost float32 matmul peak: {peak / 1e9:.1f} GFLOP/s; model: "
          f"{step_flops / 1e9:.2f} GFLOP/step")
    for key, value in summary.items():
        unit = "×" if key.startswith("speedup") else " s/step"
        print(f"  {key:32s} {value:.3f}{unit}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _tokens(config: Path) -> int:
    from europa_jax.config_loader import load_config

    cfg = load_config(str(config))
    return cfg.data.global_batch_size * cfg.data.seq_len


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
