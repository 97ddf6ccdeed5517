"""The document-length models of plan/price/documents.py, and where the Dolma model's spread
comes from.

    python benchmarks/document_lengths.py [--json OUT]

1. Refits σ, the log-normal spread of document lengths within a source, to the token
   counts Pouransari et al. 2024 measured per length bucket (github.com/apple/
   ml-dataset-decomposition, README "Get stats": DCLM-Baseline subset and Wikipedia,
   GPT-NeoX tokens). Their decomposition (scripts/make_dd_buckets.py `get_binary`) cuts
   each document (+ an end-of-text token) into pieces of 2^k + 1 tokens, k in 8…13, the
   largest that fits, choosing k at random (weights 1, 2, …, 32 from 8,192 down to 256)
   while the rest is longer than 8,193, and drops a rest under 257. The fit draws
   log-normal documents, cuts them the same way and matches the six buckets' token
   shares over a grid of (median, σ).
2. Prints each model's statistics: mean and median tokens per document, and the share of
   tokens in documents longer than 4,096 and 65,536 tokens (Fu et al. 2024, arXiv
   2402.10171, report "about 30 %" of SlimPajama's data longer than 4K — a check on the
   Dolma model, not an input to it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# tokens per bucket 256, 512, …, 8,192 (the README's "# tokens" column)
MEASURED = {
    "DCLM-Baseline subset": (3_732_930_560, 6_287_261_696, 7_769_948_160, 6_615_465_984,
                             5_407_506_432, 4_732_223_488),
    "Wikipedia": (579_862_528, 816_840_704, 871_366_656, 723_517_440, 498_073_600,
                  305_135_616),
}


def bucket_shares(lengths, rng: np.random.Generator) -> np.ndarray:
    """Token shares of the six buckets after the decomposition (module docstring)."""
    tokens = np.zeros(6)
    weights = 2.0 ** np.arange(6)  # k = 13, 12, …, 8
    weights /= weights.sum()
    for length in lengths:
        n = int(length) + 1  # the end-of-text token
        while n > 1:
            k = int(np.log2(n - 1))
            if k < 8:
                break
            if k > 13:
                k = int(rng.choice(np.arange(13, 7, -1), p=weights))
            tokens[k - 8] += 2**k
            n -= (1 << k) + 1
    return tokens / tokens.sum()


def fit_sigma(measured, documents: int = 20000) -> dict:
    """The (median, σ) whose cut log-normal documents match `measured`'s bucket shares
    best (least squares over the six)."""
    target = np.asarray(measured, float) / sum(measured)
    z = np.random.default_rng(0).standard_normal(documents)
    best = None
    for sigma in np.arange(1.0, 1.81, 0.05):
        for median in np.exp(np.arange(np.log(150), np.log(1500), 0.1)):
            shares = bucket_shares(np.clip(median * np.exp(sigma * z), 1, 2e6),
                                   np.random.default_rng(1))
            err = float(np.sum((shares - target) ** 2))
            if best is None or err < best[0]:
                best = (err, float(sigma), float(median), shares)
    err, sigma, median, shares = best
    return {"sigma": round(sigma, 2), "median": round(median), "rms_error": (err / 6) ** 0.5,
            "fitted_shares": np.round(shares, 3).tolist(),
            "measured_shares": np.round(target, 3).tolist()}


def model_stats(lengths) -> dict:
    tokens = lengths.sum()
    return {"mean": float(lengths.mean()), "median": float(np.median(lengths)),
            "token_share_over_4096": float(lengths[lengths > 4096].sum() / tokens),
            "token_share_over_65536": float(lengths[lengths > 65536].sum() / tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    from europa_jax.plan.price import documents

    out = {"fits": {name: fit_sigma(counts) for name, counts in MEASURED.items()},
           "used_sigma": documents.DOLMA_SIGMA,
           "models": {name: {"described": text, **model_stats(sample(2_000_000, 0))}
                      for name, (text, sample, _) in documents.MODELS.items()}}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
