"""Analytic parameter counts and FLOPs against independent computations."""

import math

import jax
import numpy as np

from europa_jax.model import flops
from europa_jax.train.train import abstract_params


def test_causal_pairs_counts_each_document_triangle():
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    # row 0: docs of 3 and 2 tokens (padding ignored): 6 + 3; row 1: one doc of 6: 21
    assert flops.causal_pairs(seg) == 6 + 3 + 21


def test_counts_match_a_direct_sum_over_the_tree(tiny_cfg):
    cfg = tiny_cfg.model
    params = abstract_params(tiny_cfg)  # the model's own tree: the table must agree
    counts = flops.parameter_counts(cfg)
    raw = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    padding = 2 * (cfg.padded_vocab_size - cfg.vocab_size) * cfg.d_model
    assert counts["total_params"] == raw - padding
    per_expert = 3 * cfg.d_model * cfg.expert_ffn_dim
    assert counts["routed_expert_params"] == cfg.n_moe_layers * cfg.n_routed_experts * per_expert
    unused = cfg.n_moe_layers * (cfg.n_routed_experts - cfg.top_k) * per_expert
    assert counts["active_params"] == counts["total_params"] - unused


def test_matmul_params_are_active_params_minus_embedding_and_norms(tiny_cfg):
    cfg = tiny_cfg.model
    params = abstract_params(tiny_cfg)  # the model's own tree: the table must agree
    counts = flops.parameter_counts(cfg)
    norms = sum(math.prod(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                if str(getattr(p[-1], "key", "")) == "scale")
    embedding = cfg.vocab_size * cfg.d_model
    assert flops.matmul_params_per_token(cfg) == counts["active_params"] - embedding - norms


def test_train_flops_grow_with_attention_pairs(tiny_cfg):
    cfg = tiny_cfg.model
    base = flops.train_flops(cfg, 100, 0)
    assert base == 6 * flops.matmul_params_per_token(cfg) * 100
    extra = flops.train_flops(cfg, 100, 10) - base
    assert extra == 6 * 10 * cfg.n_layers * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
