"""HBM bytes per step of a config's non-matmul GPU kernels, by part of the model; before
and after against another revision, both read by this tree's counter.

    python benchmarks/hbm_traffic.py [--config configs/europa-952b.yaml] [--set KEY=VALUE …]
                                     [--against REV] [--json OUT]

Each tree compiles the config's train step for its GPU mesh (deviceless, as `europa-jax
plan --target gh200`), in a process of its own, and writes the optimized HLO; this tree's
`europa_jax/plan/program/hbm_traffic.py` reads every program, so the counts compare programs, not
counters. `--against REV` checks REV out into a temporary git worktree and compiles its
own copy of the config (a config of this repository: as REV ships it; another path: the
same file) with the same `--set`s (a key REV lacks is an error there). Loops whose
trip count is data are counted once per entry here (`europa-jax plan` uses the trips its
assumptions give). europa-952b: about 3 min and 5 GB of RAM per compile on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a tree's own checkout: its code compiles the step; prints nothing but errors.
COMPILE = """
import os, sys, time
from europa_jax.plan.program import gpu_target
gpu_target.prepare_process()
from europa_jax.plan import plan as plan_lib
os.environ["XLA_FLAGS"] = plan_lib.compile_only_xla_flags(os.environ.get("XLA_FLAGS", ""))
import jax
jax.config.update("jax_num_cpu_devices", 1)
from europa_jax.config_loader import load_config
from europa_jax.plan.program import gpu_program
from europa_jax.train import train
cfg = load_config(sys.argv[1], sys.argv[3:])
mesh = gpu_program.plan_mesh(cfg, "gh200")
trainer = train.build_trainer(cfg, mesh)
start = time.perf_counter()
with gpu_target.lowering(mesh):
    lowered = train.jit_train_step(trainer).trace(trainer.abstract_state,
                                                  train.abstract_batch(trainer)).lower()
    compiled = gpu_target.compile_lowered(lowered, mesh)
open(sys.argv[2], "w").write(compiled.as_text())
m = compiled.memory_analysis()
print(time.perf_counter() - start, m.argument_size_in_bytes + m.output_size_in_bytes
      - m.alias_size_in_bytes + m.temp_size_in_bytes)
"""


def compile_tree(tree: Path, config: Path, sets: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", COMPILE, str(config), str(out), *sets],
                          cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"compile in {tree} failed: {done.stderr.strip().splitlines()[-1]}")
    seconds, hbm = done.stdout.split()[-2:]
    return {"compile_s": float(seconds), "hbm_peak_bytes": float(hbm)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "europa-952b.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--against", metavar="REV")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from europa_jax.plan.program import hbm_traffic

    config = Path(args.config).resolve()
    results = {}
    with tempfile.TemporaryDirectory(prefix="hbm_traffic-") as scratch:
        trees = {"this tree": ROOT}
        if args.against:
            into = Path(scratch) / "rev"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into),
                            args.against], check=True, capture_output=True)
            trees = {args.against: into, **trees}
        try:
            for name, tree in trees.items():
                hlo = Path(scratch) / f"{len(results)}.hlo"
                own = (tree / config.relative_to(ROOT) if config.is_relative_to(ROOT)
                       else config)
                run = compile_tree(tree, own, args.set, hlo)
                run["config"] = str(own.relative_to(tree) if own.is_relative_to(tree) else own)
                run.update(hbm_traffic.summary(hbm_traffic.kernels(hlo.read_text())))
                results[name] = run
                tb = lambda x: f"{x / 1e12:.2f} TB"
                print(f"{name}: {tb(run['bytes_per_step'])} per step (+ "
                      f"{tb(run['data_dependent_bytes_per_step'])} data-dependent, once per "
                      f"entry); MoE loops {tb(run['moe_loop_bytes_per_step'])}; HBM peak "
                      f"{run['hbm_peak_bytes'] / 1e9:.2f} GB; compiled in "
                      f"{run['compile_s']:.0f} s", flush=True)
                for region, value in run["by_region"].items():
                    print(f"  {region:<28} {tb(value):>10}")
        finally:
            if args.against:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(Path(scratch) / "rev")], capture_output=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
