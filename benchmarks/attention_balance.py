"""Attention balance at the recipe's scale, with and without context parallelism over the node.

    python benchmarks/attention_balance.py [--batches 100] [--json OUT]

europa-952b at 384 GPUs (96 nodes × 4, one 65,536-token row per GPU): global batches of
the long-tailed document model (plan/price/attention_cost.py, the one benchmarks/data_balance.py
uses) cut from a shuffled stream and laid out by the real balancer — ranks balanced on
their own, or nodes balanced as units when the node's GPUs share its rows' attention
(`execution.attention_context_parallel`). Reported for both: attention cost (Σ L²) max/mean
per rank and per node, and the query-key pairs of the GPU the step waits for (expected,
p95, worst sampled) against one document per row, as attention TFLOP per GPU per step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from europa_jax.config_loader import load_config
    from europa_jax.model import flops
    from europa_jax.plan.price import attention_cost, documents

    cfg = load_config(Path(__file__).parent.parent / "configs/europa-952b.yaml")
    m = cfg.model
    per_pair = 3 * 2 * m.n_layers * m.n_heads * (m.qk_head_dim + m.v_head_dim)  # fwd + bwd
    results = {"config": "europa-952b", "gpus": cfg.mesh.n_devices, "seq_len": cfg.data.seq_len,
               "batches": args.batches, "documents": documents.LONG_TAIL}
    for cp in (False, True):
        start = time.perf_counter()
        r = attention_cost.slowest_pairs(cfg, batches=args.batches, context_parallel=cp,
                                         documents_model="long-tail")
        pairs = r["pairs_per_gpu"]
        results["context_parallel" if cp else "per_rank"] = {
            "slowest": r["slowest_unit"],
            "cost_max_over_mean_per_rank": round(r["cost_max_over_mean"]["per_rank"], 3),
            "cost_max_over_mean_per_node": round(r["cost_max_over_mean"]["per_node"], 3),
            "slowest_gpu_attention_tflop": {k: round(v * per_pair / 1e12, 1)
                                            for k, v in pairs.items()},
            "seconds": round(time.perf_counter() - start, 1)}
    matmul = flops.train_flops(m, cfg.data.seq_len, 0)  # one row per GPU
    results["matmul_tflop_per_gpu"] = round(matmul / 1e12, 1)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
