"""Data balancing and loader throughput at the recipe's scale: 384 ranks, 65,536 tokens.

    python benchmarks/data_balance.py [--batches 10] [--json OUT]

Builds a prepared corpus (the real on-disk format) whose document lengths follow a
long-tailed mix: 98 % web-like documents (log-normal, median 600 tokens) and 2 %
long ones (Pareto tail from 4,096 tokens, α = 1.6, capped at 1M: books, code, papers).
The token file is sparse (zeros), so the run is quick and needs no disk space: storage
bandwidth is not measured, and a process needs only ~21 KB/s of it (5,200 tokens × 4 B).

Then runs the real Grain pipeline as process 0 of 96 (4 ranks per process, GH200 nodes)
with and without balancing, for two layouts with the same tokens per rank:
  65,536 × 1 row per rank (the recipe) and 8,192 × 8 rows per rank (its earlier length).
Reported per layout: `attention_cost_max_over_mean` across ranks (mean and worst over
batches), the slowest rank's cost relative to no balancing, the estimated step-time gain
on europa-952b (slowest rank's matmul + attention FLOPs), and loader throughput of one
process (prefetch off: the whole cost of making a batch, on one core) against the 4 ×
1,300 tokens/s its GPUs consume.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np

RANKS, RANKS_PER_PROCESS, GPU_TOKENS_PER_S = 384, 4, 1300
LAYOUTS = ((65_536, 1), (8_192, 8))  # (seq_len, rows per rank)
VOCAB = 262_144


def document_lengths(n: int, seed: int = 0) -> np.ndarray:
    """The long-tailed stress mix the plan can price attention with (plan/price/documents.py)."""
    from europa_jax.plan.price.documents import long_tail_lengths

    return long_tail_lengths(n, seed)


def write_sparse_corpus(out: Path, lengths: np.ndarray) -> None:
    """The real format (manifest, offsets, uint32 tokens) with an all-zero sparse token file."""
    from europa_jax.data.corpus import Manifest, Shard, token_dtype

    out.mkdir(parents=True)
    n_tokens = int(lengths.sum())
    itemsize = token_dtype(VOCAB).itemsize
    with open(out / "tokens-00000.bin", "wb") as f:
        f.truncate(n_tokens * itemsize)
    ends = np.cumsum(lengths).astype("<i8")
    ends.tofile(out / "offsets-00000.bin")
    zeros = hashlib.sha256()
    block = bytes(1 << 24)
    for start in range(0, n_tokens * itemsize, len(block)):
        zeros.update(block[:min(len(block), n_tokens * itemsize - start)])
    shard = Shard(tokens_file="tokens-00000.bin", offsets_file="offsets-00000.bin",
                  documents=len(lengths), tokens=n_tokens, tokens_sha256=zeros.hexdigest(),
                  offsets_sha256=hashlib.sha256(ends.tobytes()).hexdigest())
    manifest = Manifest(tokenizer={"kind": "synthetic", "name": "long-tailed", "sha256": None,
                                   "vocab_size": VOCAB, "eos_id": 0},
                        dtype=token_dtype(VOCAB).name, documents=len(lengths), tokens=n_tokens,
                        max_document_tokens=int(lengths.max()), shards=(shard,))
    (out / "manifest.json").write_text(json.dumps(manifest.to_json()))


def run_layout(corpus, model_cfg, seq_len: int, per_rank: int, batches: int) -> dict:
    from europa_jax.data import pipeline
    from europa_jax.model import flops

    rows = RANKS * per_rank
    result = {"seq_len": seq_len, "rows_per_rank": per_rank}
    slowest = {}
    for balance in (False, True):
        it = pipeline.make_batch_iterator(corpus, seq_len=seq_len, global_batch_size=rows,
                                      n_ranks=RANKS, seed=0, balance=balance,
                                      process_index=0, process_count=RANKS // RANKS_PER_PROCESS,
                                      prefetch=0)
        next(it)  # warm the page cache and Grain
        ratios, worst_flops, worst_cost, split, seconds = [], [], [], [], 0.0
        for _ in range(batches):
            start = time.perf_counter()
            batch = next(it)
            seconds += time.perf_counter() - start
            cost_J = it.stats.rank_cost_J
            ratios.append(it.stats.attention_cost_max_over_mean)
            worst_cost.append(cost_J.max())
            split.append(it.stats.documents_split)
            # Causal pairs Σ L(L+1)/2 = (Σ L² + tokens) / 2 per rank.
            tokens = per_rank * seq_len
            worst_flops.append(flops.train_flops(model_cfg, tokens,
                                                 int((cost_J.max() + tokens) // 2)))
        name = "balanced" if balance else "stream_order"
        slowest[name] = (np.array(worst_cost), np.array(worst_flops))
        result[name] = {
            "attention_cost_max_over_mean": round(float(np.mean(ratios)), 3),
            "attention_cost_max_over_mean_worst": round(float(np.max(ratios)), 3),
            "documents_split_per_batch": round(float(np.mean(split)), 1),
            "tokens_per_s_per_process": round(batch["tokens"].size * batches / seconds),
            "seconds_per_global_batch": round(seconds / batches, 3),
        }
        it.close()
    cost_ratio = slowest["balanced"][0] / slowest["stream_order"][0]
    flops_gain = slowest["stream_order"][1] / slowest["balanced"][1] - 1
    result["slowest_rank_cost_balanced_over_stream_order"] = round(float(np.mean(cost_ratio)), 3)
    result["estimated_step_time_gain_europa_952b"] = f"{100 * float(np.mean(flops_gain)):.1f} %"
    result["need_tokens_per_s_per_process"] = RANKS_PER_PROCESS * GPU_TOKENS_PER_S
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from europa_jax.config_loader import load_config
    from europa_jax.data.corpus import TokenCorpus

    model_cfg = load_config(Path(__file__).parent.parent / "configs/europa-952b.yaml").model
    tokens_needed = (args.batches + 1) * RANKS * LAYOUTS[0][0]
    lengths = document_lengths(int(tokens_needed / 1300))  # mean ≈ 1,400 tokens: > 1 epoch
    ge_seq = float(np.sum(lengths >= LAYOUTS[0][0]) / lengths.sum() * RANKS * LAYOUTS[0][0])
    print(f"corpus: {len(lengths):,} documents, {int(lengths.sum()):,} tokens, median "
          f"{int(np.median(lengths))}, mean {lengths.mean():.0f}, max {lengths.max():,}; "
          f"{100 * lengths[lengths > 8192].sum() / lengths.sum():.0f} % of tokens in "
          f"documents > 8,192; {ge_seq:.1f} documents >= 65,536 per global batch", flush=True)
    results = {"ranks": RANKS, "processes": RANKS // RANKS_PER_PROCESS, "layouts": []}
    with tempfile.TemporaryDirectory() as tmp:
        write_sparse_corpus(Path(tmp) / "corpus", lengths)
        corpus = TokenCorpus(Path(tmp) / "corpus")
        for seq_len, per_rank in LAYOUTS:
            layout = run_layout(corpus, model_cfg, seq_len, per_rank, args.batches)
            results["layouts"].append(layout)
            print(json.dumps(layout), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
