"""Document-length models: the documents the plan prices attention on when no corpus is
given (`europa-jax plan --documents NAME`; `--corpus DIR` takes a prepared corpus's own).

Document-masked attention costs Σ L(L+1)/2 pairs per row, so the step's attention depends
on how long the documents are — above all on the few long ones. Two models:

- `dolma` (the default): a public pretraining corpus as measured. Dolma v1's sources with
  their documents and tokens (Soldaini et al. 2024, "Dolma: an Open Corpus of Three
  Trillion Tokens for Language Model Pretraining Research", arXiv 2402.00159, Table 1;
  Llama tokenizer): each source's mean tokens per document is its tokens over its
  documents, and a document is drawn from a source in proportion to its documents. Within
  a source lengths are log-normal at that mean with σ = 1.4: the spread fitted to the
  token-length buckets (256 … 8,192) that Pouransari et al. 2024 ("Dataset
  Decomposition", arXiv 2405.13226; github.com/apple/ml-dataset-decomposition, README)
  measured on DCLM-Baseline (σ 1.45) and Wikipedia (σ 1.40) — `python
  benchmarks/document_lengths.py` refits it from their counts (1 min 44 s). The shape within a source
  (log-normal, one σ for all) is the assumption; the means and the mix are measured.
  Mean 700 tokens; 0.2 % of the tokens are books (Project Gutenberg, mean 107k tokens);
  31 % of the tokens are in documents over 4,096 tokens, 1 % over 65,536 — where Fu et
  al. 2024 (arXiv 2402.10171) report "about 30 %" of SlimPajama's data longer than 4K, a
  check the model was not fitted to.
- `long-tail`: the stress case benchmarks/data_balance.py was built on — 98 % web-like
  documents (log-normal, median 600, σ 1.2) and 2 % long ones (Pareto from 4,096 tokens,
  α 1.6, capped at 1M), ~44 % of the tokens in long documents: a corpus rich in books, code
  and papers, where the slowest node holds a whole-document row in most batches.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

# (source, documents in millions, Llama tokens in billions): Dolma v1, Table 1
DOLMA_SOURCES = (("Common Crawl", 3734.0, 2479.0), ("GitHub", 210.0, 411.0),
                 ("Reddit", 377.0, 89.0), ("Semantic Scholar", 38.8, 70.0),
                 ("Project Gutenberg", 0.056, 6.0), ("Wikipedia, Wikibooks", 6.2, 4.3))
DOLMA_SIGMA = 1.4  # log-normal spread within a source (module docstring)
MAX_LENGTH = 1 << 20  # a document longer than this is cut (both models)
DOLMA = ("dolma: Dolma v1's sources (arXiv 2402.00159, Table 1: documents and Llama tokens "
         "per source), each log-normal at its mean tokens per document with sigma 1.4 "
         "(fitted to DCLM-Baseline's and Wikipedia's measured length buckets, arXiv "
         "2405.13226)")
LONG_TAIL = ("long-tail: 98 % log-normal (median 600 tokens, sigma 1.2), "
             "2 % Pareto from 4,096 tokens (alpha 1.6, cap 1,048,576) — a stress case")


def dolma_lengths(n: int, seed: int = 0) -> np.ndarray:
    """`n` document lengths of the Dolma model (module docstring) [W] int64."""
    rng = np.random.default_rng(seed)
    docs = np.array([d for _, d, _ in DOLMA_SOURCES])
    mean = np.array([t * 1e9 / (d * 1e6) for _, d, t in DOLMA_SOURCES])
    source_W = rng.choice(len(docs), size=n, p=docs / docs.sum())
    # a log-normal's mean is exp(μ + σ²/2): μ at each source's measured mean
    mu_W = np.log(mean[source_W]) - DOLMA_SIGMA**2 / 2
    lengths_W = np.exp(mu_W + DOLMA_SIGMA * rng.standard_normal(n))
    return np.clip(lengths_W, 1, MAX_LENGTH).astype(np.int64)


def long_tail_lengths(n: int, seed: int = 0) -> np.ndarray:
    """`n` document lengths of the long-tailed model (LONG_TAIL) [W] int64."""
    rng = np.random.default_rng(seed)
    web_W = rng.lognormal(np.log(600), 1.2, n)
    long_W = 4096 * (1 + rng.pareto(1.6, n))
    lengths_W = np.where(rng.random(n) < 0.02, long_W, web_W)
    return np.clip(lengths_W, 16, MAX_LENGTH).astype(np.int64)


# name → (description, sampler, mean tokens per document: how many to draw per batch)
MODELS: dict[str, tuple[str, Callable[[int, int], np.ndarray], float]] = {
    "dolma": (DOLMA, dolma_lengths, 700.0),
    "long-tail": (LONG_TAIL, long_tail_lengths, 1300.0),
}
DEFAULT = "dolma"


def lengths(name: str, tokens: float, seed: int = 0) -> np.ndarray:
    """Enough documents of model `name` for about `tokens` tokens (the stream repeats,
    reshuffled, if a batch needs more)."""
    _, sample, mean = MODELS[name]
    return sample(int(tokens / mean) + 1, seed)
