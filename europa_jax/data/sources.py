"""What a config asks the input pipeline for: which corpora, which of their documents.

- `data.path` (or the stdlib corpus), or `data.sources`, a weighted mixture of prepared
  corpora that must share one tokenizer;
- the validation split: `data.validation_fraction` holds out documents of every source by
  a hash of their index (split_documents), `data.validation_path` names a corpus of its own.
Each corpus is checked against the model's vocab and the expected tokenizer before any
compile; pipeline.py builds the iterators.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from europa_jax.data.corpus import DataError, MANIFEST, TokenCorpus
from europa_jax.data.pipeline import BatchIterator, make_mixture_iterator, Source

if TYPE_CHECKING:
    from europa_jax.config import Config


def split_documents(n_documents: int, fraction: float, seed: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) corpus indices: document i is held out iff a hash of (i, seed)
    falls below `fraction`, so the split is disjoint, fixed by the seed, the same on every
    process, and a document keeps its side when the corpus grows."""
    golden = np.uint64((seed + 1) * 0x9E3779B97F4A7C15 % 2**64)  # (seed + 1): 0 ↦ 0 else
    z = np.arange(n_documents, dtype=np.uint64) + golden
    # splitmix64's finalizer: every input bit moves every output bit (uint64 arithmetic wraps)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    held_out = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction
    ids = np.arange(n_documents, dtype=np.int64)
    return ids[~held_out], ids[held_out]



def open_corpus(cfg: Config, path: str | Path | None = None) -> TokenCorpus:
    """The configured corpus (or the one at `path`, e.g. the validation corpus), checked
    against the model's vocab and the expected tokenizer."""
    from europa_jax.data import prepare

    data = cfg.data
    if path is None:
        path = prepare.stdlib_corpus() if data.source == "stdlib" else Path(data.path)
    path = Path(path)
    corpus = TokenCorpus(path)
    manifest_path = path / MANIFEST
    vocab = int(corpus.manifest.tokenizer["vocab_size"])
    if vocab > cfg.model.vocab_size:
        raise DataError(f"{manifest_path}: tokenizer vocab {vocab} > model.vocab_size "
                        f"{cfg.model.vocab_size}; the model cannot embed every token")
    if data.tokenizer is not None:
        kind, sha = _tokenizer_identity(data.tokenizer)
        have = corpus.manifest.tokenizer
        if (kind, sha) != (have["kind"], have.get("sha256")):
            raise DataError(f"{manifest_path}: corpus was prepared with {have['kind']} "
                            f"'{have['name']}' (sha256 {str(have.get('sha256'))[:12]}) but "
                            f"data.tokenizer is {data.tokenizer} (sha256 {str(sha)[:12]})")
    return corpus


def _tokenizer_identity(spec: str) -> tuple[str, str | None]:
    if spec == "bytes":
        return "bytes", None
    try:
        return "huggingface", hashlib.sha256(Path(spec).read_bytes()).hexdigest()
    except OSError as e:
        raise DataError(f"data.tokenizer: {spec}: cannot read ({e.strerror or e}); expected "
                        "'bytes' or a tokenizer.json") from None


def open_sources(cfg: Config) -> list[tuple[TokenCorpus, float]]:
    """(corpus, weight) of each configured source: data.sources, else the one corpus."""
    if not cfg.data.sources:
        return [(open_corpus(cfg), 1.0)]
    opened = [(open_corpus(cfg, s.path), s.weight) for s in cfg.data.sources]
    first = opened[0][0]
    for corpus, _ in opened[1:]:
        a, b = (_tokenizer_key(c) for c in (first, corpus))
        if a != b:
            raise DataError(f"data.sources: {corpus.path} was prepared with tokenizer {b} but "
                            f"{first.path} with {a}; a mixture needs one tokenizer")
    return opened


def _tokenizer_key(corpus: TokenCorpus) -> tuple:
    t = corpus.manifest.tokenizer
    return t["kind"], t.get("sha256"), t["vocab_size"], t.get("eos_id")


def batch_iterator_for(cfg: Config, *, process_index: int = 0, process_count: int = 1
                       ) -> BatchIterator:
    """The loop's iterator: ranks are the mesh's devices (the batch is sharded over all);
    documents held out for validation (data.validation_fraction) never appear."""
    sources = [Source(corpus=corpus, weight=weight, documents=_split(cfg, corpus)[0])
               for corpus, weight in open_sources(cfg)]
    return _iterator(cfg, sources, process_index, process_count, cfg.data.prefetch)


def validation_iterator_for(cfg: Config, *, process_index: int = 0, process_count: int = 1
                            ) -> BatchIterator:
    """A fresh iterator over the validation documents (the held-out part of every source,
    mixed by the same weights, or data.validation_path): the same batches every time.

    Its window holds every held-out token (up to data.shuffle_window_tokens), so the first
    batches are pieces drawn from across the held-out documents, not the head of the
    first few."""
    data = cfg.data
    if data.validation_path:
        sources = [Source(corpus=open_corpus(cfg, data.validation_path))]
    elif data.validation_fraction:
        sources = [Source(corpus=corpus, weight=weight, documents=_split(cfg, corpus)[1])
                   for corpus, weight in open_sources(cfg)]
    else:
        raise DataError("no validation documents: set data.validation_fraction or "
                        "data.validation_path")
    return _iterator(cfg, sources, process_index, process_count, 0)


def _documents(source: Source, cfg: Config) -> np.ndarray:
    """The corpus indices a source draws from."""
    if source.documents is not None:
        return source.documents
    return np.arange(min(len(source.corpus), cfg.data.max_documents or len(source.corpus)))


def _split(cfg: Config, corpus: TokenCorpus) -> tuple[np.ndarray | None, np.ndarray | None]:
    data = cfg.data
    if not data.validation_fraction:
        return None, None
    n = min(len(corpus), data.max_documents or len(corpus))
    training, validation = split_documents(n, data.validation_fraction, data.seed)
    if not len(training) or (not len(validation) and cfg.train.eval_every):
        raise DataError(f"{corpus.path}: data.validation_fraction {data.validation_fraction} "
                        f"of {n} documents leaves {len(training)} for training and "
                        f"{len(validation)} for validation; both need at least one")
    return training, validation


def _iterator(cfg: Config, sources: list[Source], process_index: int, process_count: int,
              prefetch: int) -> BatchIterator:
    data = cfg.data
    return make_mixture_iterator(
        sources, seq_len=data.seq_len, global_batch_size=data.global_batch_size,
        n_ranks=cfg.mesh.n_devices, seed=data.seed, balance=data.balance,
        max_documents=data.max_documents, process_index=process_index,
        process_count=process_count, prefetch=prefetch, ranks_per_node=cfg.mesh.node_group,
        balance_nodes=cfg.execution.attention_context_parallel,
        window_batches=window_batches(cfg, sources))


def window_batches(cfg: Config, sources: list[Source]) -> int:
    """Global batches whose pieces are shuffled together: data.shuffle_window_tokens, at most
    one pass over the sources' documents (a longer window mixes no better and would plan
    many epochs of a small corpus at once), in whole batches and at least one; 0: none."""
    if not cfg.data.shuffle_window_tokens:
        return 0
    tokens = sum(int(s.corpus.lengths(_documents(s, cfg)).sum()) for s in sources)
    batch_tokens = cfg.data.global_batch_size * cfg.data.seq_len
    return max(min(cfg.data.shuffle_window_tokens, tokens) // batch_tokens, 1)
