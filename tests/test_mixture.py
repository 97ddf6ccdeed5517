"""Weighted mixtures of prepared corpora (data.sources): shares, resume, epochs, balance.

Every token says where it came from: source k's token = k · SOURCE + doc · STRIDE +
position, so the batches themselves are measured, not the pipeline's own statistics.
"""

import dataclasses
import re

import numpy as np
import pytest

from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.data import batch_plan, pipeline, sources as data_sources
from europa_jax.data.corpus import CorpusWriter, DataError, TokenCorpus
from conftest import config_path
from test_data import long_tailed_lengths

S, ROWS, RANKS = 64, 8, 4
STRIDE, SOURCE = 1024, 1 << 26
VOCAB = 2 * SOURCE


def write_source(path, k, lengths, tokenizer_sha256=None):
    with CorpusWriter(path, vocab_size=VOCAB) as writer:
        for doc, n in enumerate(lengths):
            writer.add(k * SOURCE + doc * STRIDE + np.arange(n))
        writer.commit(tokenizer={"kind": "bytes", "name": "synthetic",
                                 "sha256": tokenizer_sha256, "vocab_size": VOCAB, "eos_id": 0})
    return TokenCorpus(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    # the big source lasts ~10 epochs of the small one over 1,000 batches
    big = write_source(root / "big", 0, long_tailed_lengths(0, 400 * ROWS * S))
    small = write_source(root / "small", 1, long_tailed_lengths(1, 15 * ROWS * S))
    return big, small


def mixture(corpora, weights=(0.7, 0.3), **overrides):
    kwargs = dict(seq_len=S, global_batch_size=ROWS, n_ranks=RANKS, seed=0, prefetch=0)
    kwargs.update(overrides)
    sources = [pipeline.Source(corpus=c, weight=w) for c, w in zip(corpora, weights)]
    return pipeline.make_mixture_iterator(sources, **kwargs)


def test_batches_follow_the_weights_over_a_run(corpora):
    it = mixture(corpora)
    small_tokens, epochs = 0, []
    for _ in range(1000):
        tokens = next(it)["tokens"]
        small_tokens += int((tokens >= SOURCE).sum())
        epochs.append(it.stats.source_epochs_I.copy())
        assert tokens.size == ROWS * S  # every batch is full
    assert abs(small_tokens / (1000 * ROWS * S) - 0.3) < 0.02 * 0.3
    # exact, in fact: cumulative shares are rounded once
    assert small_tokens == round(0.3 * 1000 * ROWS * S)
    epochs = np.array(epochs)
    assert np.all(np.diff(epochs, axis=0) >= 0)  # epochs only move forward
    assert epochs[-1, 1] > 5 and 0.5 < epochs[-1, 0] < 2  # the small source cycles


def test_shares_sum_to_the_batch_and_never_drift():
    weights = np.array([0.5, 0.2, 0.3])
    total = np.zeros(3, np.int64)
    for b in range(500):
        share = batch_plan.shares(weights, b, 100)
        assert share.sum() == 100 and share.min() >= 0
        total += share
        assert np.all(np.abs(total - weights * (b + 1) * 100) <= 1)


def test_each_source_epoch_holds_its_tokens_once(corpora):
    _, small = corpora
    it = mixture(corpora, weights=(0.5, 0.5), seed=3)
    want = np.sort(np.concatenate([SOURCE + d * STRIDE + np.arange(n) for d, n in
                                   enumerate(small.lengths(np.arange(len(small))))]))
    seen = []
    while not seen or it.stats.source_epochs_I[1] < 1:
        tokens = next(it)["tokens"].ravel()
        seen.append(tokens[tokens >= SOURCE])
    seen = np.concatenate(seen)
    # the last batch of the epoch may already hold the next epoch's first tokens
    first_epoch = np.sort(seen[:len(want)])
    assert np.array_equal(first_epoch, want)


def test_resume_continues_exactly(corpora):
    it = mixture(corpora)
    for _ in range(37):
        next(it)
    state = it.get_state()
    assert set(state) == {"batch", "positions", "offsets", "pipeline", "corpus_paths"}
    expected = [next(it) for _ in range(5)]
    fresh = mixture(corpora)
    fresh.set_state(state)
    for want in expected:
        got = next(fresh)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(DataError, match="saved for a different pipeline"):
        mixture(corpora, weights=(0.6, 0.4)).set_state(state)


def test_a_window_keeps_every_batchs_shares_and_resumes_exactly_inside_it(corpora):
    it = mixture(corpora, window_batches=4)
    want = []
    for b in range(10):
        tokens = next(it)["tokens"]
        small = int((tokens >= SOURCE).sum())
        assert small == batch_plan.shares(np.array([0.7, 0.3]), b, ROWS * S)[1]
        want.append(tokens)
        if b == 5:  # inside the second window
            state = it.get_state()
    fresh = mixture(corpora, window_batches=4)
    fresh.set_state(state)
    for tokens in want[6:]:
        np.testing.assert_array_equal(next(fresh)["tokens"], tokens)


def test_balancing_still_evens_the_attention_cost(corpora):
    costs = {}
    for balance in (True, False):
        it = mixture(corpora, balance=balance)
        costs[balance] = np.mean([(next(it), it.stats.attention_cost_max_over_mean)[1]
                                  for _ in range(30)])
    assert costs[True] < costs[False]


def test_processes_read_their_rows_of_the_same_batches(corpora):
    whole = mixture(corpora)
    halves = [mixture(corpora, process_index=i, process_count=2) for i in range(2)]
    for _ in range(5):
        want = next(whole)["tokens"]
        got = np.concatenate([next(h)["tokens"] for h in halves])
        assert np.array_equal(got, want)


# ----------------------------------------------------------------------------- from a config


def mixture_cfg(tiny_cfg, sources):
    return dataclasses.replace(
        tiny_cfg, model=dataclasses.replace(tiny_cfg.model, vocab_size=VOCAB),
        data=dataclasses.replace(tiny_cfg.data, source="prepared", path=None,
                                 sources=tuple(sources)))


def test_config_mixture_reads_both_sources(tiny_cfg, corpora, tmp_path):
    from europa_jax.config import MixtureSource

    big, small = corpora
    cfg = mixture_cfg(tiny_cfg, [MixtureSource(path=str(big.path), weight=7),
                                 MixtureSource(path=str(small.path), weight=3)])
    it = data_sources.batch_iterator_for(cfg)
    tokens = np.concatenate([next(it)["tokens"].ravel() for _ in range(50)])
    assert abs((tokens >= SOURCE).mean() - 0.3) < 0.01
    write_source(tmp_path / "other", 1, [100, 200], tokenizer_sha256="another tokenizer")
    bad = mixture_cfg(tiny_cfg, [MixtureSource(path=str(big.path), weight=1),
                                 MixtureSource(path=str(tmp_path / "other"), weight=1)])
    with pytest.raises(DataError, match=re.escape(
            f"data.sources: {tmp_path / 'other'} was prepared with tokenizer")):
        data_sources.open_sources(bad)


@pytest.mark.parametrize("overrides, message", [
    (["data.source=prepared", "data.sources=[{path: a, weight: 0}]"],
     "data.sources: a: weight 0.0 must be > 0"),
    (["data.source=prepared", "data.sources=[{path: a, weight: 1}, {path: a, weight: 2}]"],
     "data.sources: a corpus appears twice"),
    (["data.sources=[{path: a, weight: 1}]"], "data.sources: a mixture needs data.source: "
     "prepared"),
    (["data.source=prepared", "data.path=b", "data.sources=[{path: a, weight: 1}]"],
     "data.sources: a mixture needs data.source: prepared and no data.path"),
    (["data.source=prepared", "data.sources=[{path: a}]"], "data.sources[0].weight: required"),
])
def test_bad_mixtures_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(config_path("tiny-cpu.yaml"), overrides)
