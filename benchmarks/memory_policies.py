"""How a GPU's HBM and host peaks move with the MoE chunk and the offload policy.

    python benchmarks/memory_policies.py [--config configs/europa-952b.yaml] [--devices 384]
        [--chunks 2048,4096,8192] [--policies none,optimizer,optimizer+inputs] [--json OUT]

Each cell is one `europa-jax plan CONFIG --devices N --target gh200 --json` with
`--set execution.moe_chunk_tokens=C` and the policy's `--set`s, run as its own process: the
step compiled for the GPU target (gpu_target.py), so every number is XLA:GPU's own
`memory_analysis()` of the program a GH200 would run. Policies:
- none: optimizer state in HBM, every layer recomputed from its saved input, kept in HBM;
- optimizer: the optimizer state in host (Grace) memory;
- optimizer+inputs: that, and every layer's saved input offloaded to host memory
  (what configs/europa-952b.yaml ships).
Printed per cell: HBM peak against 0.92 × 96 GB, host peak against the 96 GB pinned pool
(and the 30 GB a GPU gets if only 120 GB per node were usable), the estimate. About 2.5
minutes and 2.4 GB of RAM per cell on 2 cores: the default grid takes about 25 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = {
    "none": ["offload.optimizer_state=false", "offload.activations=none"],
    "optimizer": ["offload.optimizer_state=true", "offload.activations=none"],
    "optimizer+inputs": ["offload.optimizer_state=true",
                         "offload.activations=offload_layer_inputs"],
}


def plan_cell(config: str, devices: int, chunk: int, policy: str) -> dict:
    sets = [f"execution.moe_chunk_tokens={chunk}", *POLICIES[policy]]
    command = [sys.executable, "-m", "europa_jax.cli", "plan", config, "--devices",
               str(devices), "--target", "gh200", "--json"]
    for item in sets:
        command += ["--set", item]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    cell = {"chunk": chunk, "policy": policy, "set": sets,
            "seconds": time.perf_counter() - start}
    if result.returncode not in (0, 1):  # 1: the plan ran, the compile failed (reported)
        return {**cell, "error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    report = json.loads(result.stdout)
    return {**cell, "error": report["compiled"]["error"], "fits": report["fits"],
            "fits_strict_host": report["fits_strict_host"],
            "hbm_peak_bytes": report["per_device"]["hbm_peak_bytes"],
            "host_peak_bytes": report["per_device"]["host_peak_bytes"],
            "budget": report["budget"],
            "tokens_per_s_per_gpu": report["estimate"]["tokens_per_s_per_gpu"]}


def gb(x) -> str:
    return "n/a" if x is None else f"{x / 1e9:.1f}"


def table(cells: list[dict]) -> str:
    rows = [("moe_chunk_tokens", "policy", "HBM GB", "host GB", "fits", "fits 30 GB host",
             "tokens/s/GPU")]
    for c in cells:
        if c.get("error"):
            rows.append((str(c["chunk"]), c["policy"], "error", "", "", "", c["error"][:60]))
            continue
        rows.append((f"{c['chunk']:,}", c["policy"], gb(c["hbm_peak_bytes"]),
                     gb(c["host_peak_bytes"]), "yes" if c["fits"] else "no",
                     "yes" if c["fits_strict_host"] else "no",
                     f"{c['tokens_per_s_per_gpu']:,.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(f"{v:>{w}}" for v, w in zip(r, widths)) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "europa-952b.yaml"))
    parser.add_argument("--devices", type=int, default=384)
    parser.add_argument("--chunks", default="2048,4096,8192")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", help="write the cells here too")
    args = parser.parse_args()
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"--policies: {', '.join(unknown)} not among {', '.join(POLICIES)}")
    cells = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        for policy in policies:
            cells.append(plan_cell(args.config, args.devices, chunk, policy))
            print(f"chunk {chunk:,} / {policy}: {cells[-1]['seconds']:.0f} s", file=sys.stderr,
                  flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(cells, f, indent=2)
    budget = next((c["budget"] for c in cells if "budget" in c), None)
    if budget:
        print(f"budgets per GPU: HBM {gb(budget['hbm_bytes'])} GB (0.92 × 96 GB), host "
              f"{gb(budget['host_bytes'])} GB (pinned pool), strict host "
              f"{gb(budget['host_bytes_strict'])} GB")
    print(table(cells))


if __name__ == "__main__":
    main()
