"""Pipeline-parallel layouts of a config priced against its compiled FSDP step
(europa_jax/plan/pipeline.py): every stage count the nodes divide into, v = 1 and the
finest interleave, each weight policy, at the config's global batch and twice it.

    europa-jax plan configs/europa-952b.yaml --devices 384 --documents long-tail --json > plan.json
    python benchmarks/pipeline_layouts.py plan.json [--config FILE] [--top 12] [--json OUT]

The plan's JSON is the baseline: its step's seconds per class, its memory, its devices.
Prints the fastest layouts at each batch, fitting or not, and the fastest that fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plan_json", help="europa-jax plan … --json output (the FSDP baseline)")
    parser.add_argument("--config", help="the config the plan priced (default: "
                        "configs/<its name>.yaml)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from europa_jax.config_loader import load_config
    from europa_jax.plan import pipeline

    baseline = json.loads(Path(args.plan_json).read_text())
    cfg = load_config(args.config or ROOT / "configs" / f"{baseline['config']}.yaml")
    devices, rows = baseline["devices"], cfg.data.global_batch_size
    results = {}
    for batch in (rows, 2 * rows):
        priced = sorted((pipeline.price(cfg, baseline, layout)
                         for layout in pipeline.layouts(cfg, devices, batch)),
                        key=lambda r: -r["tokens_per_s_per_gpu"])
        results[batch] = priced
        fsdp = next(r for r in priced if r["layout"]["policy"] == "fsdp")
        print(f"{batch} rows: FSDP {fsdp['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"
              f"{'' if fsdp['fits'] else ' (does not fit)'}")
        print("  stages chunks policy           m  bubble  InfiniBand GB (s)  compute s"
              "  step s  tokens/s/GPU  HBM GB  host GB  fits")
        shown = priced[:args.top] + [r for r in priced if r["fits"]][:3]
        seen = set()
        for r in shown:
            key = tuple(r["layout"].values())
            if key in seen:
                continue
            seen.add(key)
            lay = r["layout"]
            print(f"  {lay['stages']:>6} {lay['virtual']:>6} {lay['policy']:<15} "
                  f"{r['microbatches']:>3.0f} {r['bubble']:>7.2f} "
                  f"{r['infiniband_bytes'] / 1e9:>8,.0f} ({r['infiniband_s']:5.1f}) "
                  f"{r['compute_s']:>10.1f} {r['step_s']:>7.1f} "
                  f"{r['tokens_per_s_per_gpu']:>13,.0f} {r['hbm_peak_bytes'] / 1e9:>7.1f} "
                  f"{r['host_peak_bytes'] / 1e9:>8.1f}  {'yes' if r['fits'] else 'no'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
