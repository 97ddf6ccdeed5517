"""The document-length models the plan prices attention on (plan/price/documents.py): Dolma's
measured mix by default, the long-tailed stress case by name."""

import numpy as np
import pytest

from europa_jax.plan.price import documents


def test_the_dolma_model_has_each_sources_measured_mean_and_share():
    lengths = documents.dolma_lengths(400_000, seed=0)
    # Table 1 of arXiv 2402.00159: 3,059 B tokens over 4,367 M documents
    assert lengths.mean() == pytest.approx(3059 / 4367 * 1000, rel=0.05)
    # the model's own draw by source reproduces each source's tokens per document
    rng = np.random.default_rng(0)
    docs = np.array([d for _, d, _ in documents.DOLMA_SOURCES])
    source = rng.choice(len(docs), size=400_000, p=docs / docs.sum())
    web = lengths[source == 0]
    assert web.mean() == pytest.approx(2479 / 3734 * 1000, rel=0.05)
    # log-normal with σ 1.4 inside a source: median = mean · e^(−σ²/2)
    assert np.median(web) == pytest.approx(664 * np.exp(-1.4**2 / 2), rel=0.05)


def test_about_30_percent_of_dolmas_tokens_are_in_documents_over_4k():
    """The check the model was not fitted to (Fu et al. 2024 on SlimPajama)."""
    lengths = documents.dolma_lengths(2_000_000, seed=1)
    share = lengths[lengths > 4096].sum() / lengths.sum()
    assert 0.25 < share < 0.37
    long_tail = documents.long_tail_lengths(2_000_000, seed=1)
    # the stress case holds more of its tokens in long documents, and rows' worth of them
    assert long_tail[long_tail > 65536].sum() / long_tail.sum() > 2 * (
        lengths[lengths > 65536].sum() / lengths.sum())


def test_a_model_gives_enough_documents_for_the_tokens_asked():
    for name in documents.MODELS:
        lengths = documents.lengths(name, 5_000_000, seed=2)
        assert lengths.sum() >= 5_000_000 * 0.8 and lengths.min() >= 1
        assert lengths.max() <= documents.MAX_LENGTH
    with pytest.raises(KeyError):
        documents.lengths("fineweb", 1000)
