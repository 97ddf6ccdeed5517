"""What measuring stragglers costs: the step's program and the loop's time per step, with and without.

    python benchmarks/straggler_overhead.py [--steps 30] [--rounds 2] [--json OUT]

1. The train step's optimized HLO for `train.straggler_factor=1.5` and `=0`: the timing
   lives in the Python loop, so the programs must be the same text.
2. Two CPU processes (launch/local.sh) of the tiny model, runs alternating between the two
   settings: the median of each run's per-step loop time (timeline.jsonl's step phases,
   which hold the batch, the step, its metrics fetch and the per-step gather the timings
   ride on) and of its device step time (metrics.jsonl's step_time_s), compiled steps
   excluded. Reported as ratios with/without, measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "execution.remat=none", "data.max_documents=40",
        "data.global_batch_size=8", "train.eval_every=0", "train.log_every=1",
        "data.seq_len=64", "execution.attention_block_size=64", "checkpoint.every_steps=0"]


def step_hlo(factor: float) -> str:
    """The optimized HLO of the train step on this process's 8 CPU devices."""
    import jax

    from europa_jax.config_loader import load_config
    from europa_jax.train.train import build_trainer, init_state, jit_train_step
    from europa_jax.job import distributed
    from europa_jax.run import loop

    cfg = load_config(REPO / "configs/tiny-cpu.yaml",
                      [*TINY, f"train.straggler_factor={factor}"])
    trainer = build_trainer(cfg, distributed.job_mesh(cfg.mesh))
    state = init_state(trainer, cfg.train.seed)
    batches = loop.device_batches(trainer, loop.host_batch_iterator(cfg))
    _, batch = next(batches)
    with jax.set_mesh(trainer.mesh):
        text = jit_train_step(trainer).lower(state, batch).compile().as_text()
    # Source locations (the Python call site's line and column) are not the program.
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return "\n".join(line for line in text.splitlines() if "file_name_id=" not in line)


def two_process_run(work: Path, name: str, factor: float, steps: int, env: dict) -> dict:
    run_dir = work / name
    args = ["--run-dir", str(run_dir), "--set", f"train.steps={steps}",
            "--set", f"train.straggler_factor={factor}"]
    for item in TINY:
        args += ["--set", item]
    done = subprocess.run([str(REPO / "launch/local.sh"), "2", str(REPO / "configs/tiny-cpu.yaml"),
                           *args], env={**env, "EUROPA_LOG_DIR": str(work / f"{name}-logs")},
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{name}: exit {done.returncode}: {done.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    first = min(r["step"] for r in metrics)
    loop_s: dict[int, float] = {}
    for p in phases:
        if p["phase"] == "step" and p["step"] > first:
            loop_s[p["step"]] = loop_s.get(p["step"], 0.0) + p["end"] - p["start"]
    return {"loop_s": statistics.median(loop_s.values()),
            "step_time_s": statistics.median(r["step_time_s"] for r in metrics
                                              if not r["compiled"]),
            "named_slowest": "slowest_process" in metrics[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    same_hlo = step_hlo(1.5) == step_hlo(0.0)
    print(f"train step HLO with and without straggler timing: "
          f"{'identical' if same_hlo else 'DIFFERENT'}", flush=True)

    with tempfile.TemporaryDirectory(prefix="straggler-overhead-") as tmp:
        work = Path(tmp)
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(JAX_COMPILATION_CACHE_DIR=str(work / "cache"), PYTHONPATH=str(REPO),
                   EUROPA_JAX=f"{sys.executable} -m europa_jax.cli")
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for name, factor in (("on", 1.5), ("off", 0.0)):
                runs[name].append(two_process_run(work, f"{name}-{r}", factor, args.steps, env))
                print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    result = {"identical_step_hlo": same_hlo, "steps": args.steps, "rounds": args.rounds}
    for key in ("loop_s", "step_time_s"):
        on = statistics.median(x[key] for x in runs["on"])
        off = statistics.median(x[key] for x in runs["off"])
        result[key] = {"with": on, "without": off, "ratio": on / off}
        print(f"median {key}: with {on * 1e3:.1f} ms, without {off * 1e3:.1f} ms, "
              f"ratio {on / off:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
