"""Multi-token prediction (DeepSeek-V3 §2.2; model.mtp_layers): its loss against the
paper's formula on the same weights, its place in the objective and its gradients, its
export as DeepSeek-V3's layer `n_layers` and the import back, counts and config checks."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extra: transformers' DeepseekV3 decoder layer as the MTP block
import transformers
import transformers.masking_utils
from safetensors import safe_open

from europa_jax import param_table
from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.interop import hf_import
from europa_jax.interop.export import export
from europa_jax.model import flops
from europa_jax.model.transformer import init_router_bias, Transformer
from europa_jax.parallel import sharding
from europa_jax.train import objective, qk_clip, train
from conftest import (cli, config_path, first_batch_and_initial_state, nested_params,
                      objective_gradients, rows_with_documents, saved_state)

# tiny-cpu as shipped with one MTP module, a few steps (test_export.py's run otherwise).
TRAIN = ["train.steps=3", "train.eval_every=0", "checkpoint.every_steps=0",
         "data.max_documents=40", "execution.remat=none", "model.mtp_layers=1"]


def sets(items):
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    result = cli("train", config_path("tiny-cpu.yaml"), "--run-dir", str(run_dir), *sets(TRAIN))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, load_config(config_path("tiny-cpu.yaml"), TRAIN), metrics


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    run_dir, _, _ = trained
    out = tmp_path_factory.mktemp("hf") / "fp32"
    export(run_dir, out, dtype="fp32", max_shard_bytes=400_000)
    return out


def hf_tensors(hf_dir) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(path, "np") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def rms_norm(x, scale, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def reference_mtp_loss(hf_dir, cfg, batch) -> float:
    """DeepSeek-V3 eq. 21-24 for one module, document by document, from the exported files:
    h⁰ = transformers' main model (final-normed states), then in NumPy (float64)
    M·[RMSNorm(Emb(t_{i+1})); RMSNorm(h⁰_i)], transformers' decoder layer `n_layers` (the
    MoE block, its router bias included) on the document's positions, the module's norm,
    the shared head, and the mean cross entropy against t_{i+2} over the batch."""
    m = cfg.model
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    w = hf_tensors(hf_dir)
    prefix = f"model.layers.{m.n_layers}."
    # the module's block as transformers builds layer `n_layers` of a one-layer-deeper model
    # (its loader fuses the per-expert tensors as it does for every MoE layer)
    deeper = transformers.DeepseekV3ForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, num_hidden_layers=m.n_layers + 1)
    block = deeper.model.layers[m.n_layers].eval()
    total, count = 0.0, 0
    for b in range(batch["tokens"].shape[0]):
        segments = batch["segment_ids"][b]
        for seg in np.unique(segments[segments > 0]):
            tokens = batch["tokens"][b, segments == seg].astype(np.int64)
            n = len(tokens)
            if n < 3:
                continue
            with torch.no_grad():
                h0 = model.model(torch.tensor(tokens[None])).last_hidden_state[0].numpy()
            emb = w[prefix + "embed_tokens.weight"][tokens[1:]]  # t_{i+1}, i = 0 … n-2
            joined = np.concatenate([rms_norm(emb, w[prefix + "enorm.weight"], m.rms_norm_eps),
                                     rms_norm(h0[:-1], w[prefix + "hnorm.weight"],
                                              m.rms_norm_eps)], axis=-1)
            x = joined @ w[prefix + "eh_proj.weight"].astype(np.float64).T
            x_t = torch.tensor(x[None], dtype=torch.float32)
            positions = torch.arange(n - 1)[None]
            with torch.no_grad():
                mask = transformers.masking_utils.create_causal_mask(
                    config=model.config, inputs_embeds=x_t, attention_mask=None, cache=None,
                    position_ids=positions)
                out = block(x_t, attention_mask=mask, position_ids=positions,
                            position_embeddings=model.model.rotary_emb(x_t, positions))
            out = (out[0] if isinstance(out, tuple) else out)[0].numpy()
            logits = rms_norm(out, w[prefix + "shared_head.norm.weight"], m.rms_norm_eps) \
                @ w[prefix + "shared_head.head.weight"].astype(np.float64).T
            logits = logits[:n - 2]  # position i predicts t_{i+2}
            shifted = logits - logits.max(axis=-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            total -= log_probs[np.arange(n - 2), tokens[2:]].sum()
            count += n - 2
    return total / count


@pytest.mark.slow
def test_the_mtp_loss_equals_the_papers_formula_on_the_same_weights(trained, exported):
    run_dir, cfg, _ = trained
    state = saved_state(run_dir)
    batch = rows_with_documents(cfg)
    _, stats = objective.loss_and_stats(Transformer(cfg.model, cfg.execution), nested_params(state),
                                        jnp.asarray(state["router_bias_LE"]),
                                        {k: jnp.asarray(v) for k, v in batch.items()})
    expected = reference_mtp_loss(exported, cfg, batch)
    print(f"mtp_loss {float(stats['mtp_loss']):.6f}, reference {expected:.6f}")
    assert 3.0 < expected < 7.0  # a few steps from initialization: near ln(257) = 5.55
    np.testing.assert_allclose(float(stats["mtp_loss"]), expected, rtol=1e-5)


@pytest.mark.slow
def test_a_run_logs_the_mtp_loss_beside_the_lm_loss(trained):
    _, _, metrics = trained
    steps = [r for r in metrics if "mtp_loss" in r]
    assert len(steps) >= 1
    assert all(np.isfinite(r["mtp_loss"]) and 3.0 < r["mtp_loss"] < 7.0 for r in steps)


@pytest.mark.slow
def test_the_export_is_deepseek_v3_s_layout_and_imports_back_bitwise(trained, exported, tmp_path):
    run_dir, cfg, _ = trained
    m = cfg.model
    config = json.loads((exported / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == m.n_layers
    w = hf_tensors(exported)
    mtp = f"model.layers.{m.n_layers}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.q_b_proj.weight", "mlp.gate.e_score_correction_bias",
                 f"mlp.experts.{m.n_routed_experts - 1}.down_proj.weight",
                 "mlp.shared_experts.up_proj.weight"):
        assert mtp + name in w, name
    assert w[mtp + "eh_proj.weight"].shape == (m.d_model, 2 * m.d_model)
    # the shared embedding and head, again, where vLLM's deepseek_mtp reads them
    np.testing.assert_array_equal(w[mtp + "embed_tokens.weight"], w["model.embed_tokens.weight"])
    np.testing.assert_array_equal(w[mtp + "shared_head.head.weight"], w["lm_head.weight"])
    assert not any(k.startswith(f"model.layers.{m.n_layers + 1}.") for k in w)

    imported = tmp_path / "imported"
    result = cli("import", str(exported), "--config", config_path("tiny-cpu.yaml"), *sets(TRAIN),
                 "--out", str(imported))
    assert result.returncode == 0, result.stderr[-3000:]
    original, back = saved_state(run_dir), saved_state(imported)
    assert original.keys() == back.keys()
    assert back["router_bias_LE"].shape == (m.n_moe_layers + 1, m.n_routed_experts)
    assert any(k.startswith("params.mtp_layers.") for k in back)
    v = m.vocab_size
    for key in original:
        a, b = original[key], back[key]
        if key == "params.embedding":
            a, b = a[:v], b[:v]
        elif key == "params.lm_head":
            a, b = a[:, :v], b[:, :v]
        np.testing.assert_array_equal(b, a, err_msg=key)


@pytest.mark.slow
def test_transformers_loads_the_main_model_and_leaves_the_module(trained, exported):
    """transformers' DeepseekV3 has no MTP module: it loads the rest and lists the module's
    tensors as unexpected; its logits are our main model's."""
    run_dir, cfg, _ = trained
    m = cfg.model
    model, loading = transformers.DeepseekV3ForCausalLM.from_pretrained(
        exported, dtype=torch.float32, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["mismatched_keys"]
    assert loading["unexpected_keys"]
    assert all(k.startswith(f"model.layers.{m.n_layers}.") for k in loading["unexpected_keys"])
    state = saved_state(run_dir)
    tokens = rows_with_documents(cfg)["tokens"][:1, :64]
    ours, _ = Transformer(m, cfg.execution).apply({"params": nested_params(state)}, tokens,
                                                  np.ones_like(tokens), np.arange(64)[None],
                                                  jnp.asarray(state["router_bias_LE"]))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens.astype(np.int64))).logits[0].numpy()
    ours = np.asarray(ours)[0, :, :m.vocab_size]
    assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) <= 1e-4


@pytest.mark.slow
def test_an_import_leaves_out_modules_the_config_lacks_and_refuses_missing_ones(
        trained, exported, tmp_path):
    run_dir, cfg, _ = trained
    without = [item for item in TRAIN if not item.startswith("model.mtp_layers")]
    imported = tmp_path / "main_only"
    result = cli("import", str(exported), "--config", config_path("tiny-cpu.yaml"),
                 *sets(without), "--out", str(imported))
    assert result.returncode == 0, result.stderr[-3000:]
    original, back = saved_state(run_dir), saved_state(imported)
    assert not any(k.startswith("params.mtp_layers") for k in back)
    np.testing.assert_array_equal(back["router_bias_LE"], original["router_bias_LE"][:-1])
    np.testing.assert_array_equal(back["params.moe_layers.moe.w_up"],
                                  original["params.moe_layers.moe.w_up"])
    # a checkpoint without the module cannot fill a config that trains one
    config = json.loads((exported / "config.json").read_text())
    hf = tmp_path / "hf"
    hf.mkdir()
    for path in exported.iterdir():
        (hf / path.name).symlink_to(path)
    (hf / "config.json").unlink()
    (hf / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers=0 but the config has "
                                          r"model\.mtp_layers=1"):
        hf_import.import_hf(hf, cfg, tmp_path / "never")
    assert not (tmp_path / "never").exists()


# ----------------------------------------------------------------------------- on a mesh

ROWS = 32  # 4 rows per device: microbatches of 2 keep 2 each


@pytest.fixture(scope="module")
def batch_and_state(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, mtp_layers=1),
                              data=dataclasses.replace(tiny_cfg.data, global_batch_size=ROWS))
    return cfg, *first_batch_and_initial_state(cfg)


@pytest.fixture(scope="module")
def mtp_gradients(batch_and_state):
    """objective_gradients of the first batch by (microbatches, λ), each computed once:
    the whole batch at λ = 0.5 is both tests' reference."""
    cfg, batch, state = batch_and_state
    computed = {}

    def gradients(microbatches, weight):
        if (microbatches, weight) not in computed:
            computed[microbatches, weight] = objective_gradients(
                cfg, batch, state, microbatches, mtp_loss_weight=weight)
        return computed[microbatches, weight]

    return gradients


@pytest.mark.slow
def test_the_objective_adds_lambda_times_the_mtp_loss_and_its_gradients_flow(mtp_gradients):
    (loss_0, stats_0), grads_0 = mtp_gradients(1, 0.0)
    (loss_w, stats_w), grads_w = mtp_gradients(1, 0.5)
    assert loss_0 == stats_0["lm_loss"]
    np.testing.assert_allclose(stats_w["mtp_loss"], stats_0["mtp_loss"], rtol=1e-6)
    np.testing.assert_allclose(loss_w, stats_w["lm_loss"] + 0.5 * stats_w["mtp_loss"], rtol=1e-6)
    # λ = 0: the module learns nothing; λ > 0: every one of its parameters does
    for path, g in jax.tree_util.tree_flatten_with_path(grads_0["mtp_layers"])[0]:
        assert not np.any(g), path
    for path, g in jax.tree_util.tree_flatten_with_path(grads_w["mtp_layers"])[0]:
        assert np.any(g), path
    # and its loss reaches the shared embedding and head and the main model's layers
    for key in ("embedding", "lm_head"):
        assert not np.allclose(grads_w[key], grads_0[key])
    assert not np.allclose(grads_w["moe_layers"]["attention"]["w_q_b"],
                           grads_0["moe_layers"]["attention"]["w_q_b"])


@pytest.mark.slow
def test_microbatches_give_the_whole_batch_s_mtp_loss_and_gradients(mtp_gradients):
    (loss_1, stats_1), grads_1 = mtp_gradients(1, 0.5)
    (loss_2, stats_2), grads_2 = mtp_gradients(2, 0.5)
    np.testing.assert_allclose(stats_2["mtp_loss"], stats_1["mtp_loss"], rtol=1e-5)
    np.testing.assert_allclose(loss_2, loss_1, rtol=1e-5)
    np.testing.assert_allclose(grads_2["mtp_layers"]["eh_proj"], grads_1["mtp_layers"]["eh_proj"],
                               rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_a_step_balances_and_clips_the_module_s_block_too(batch_and_state):
    """The module's MoE block has its own router-bias row (the last) and QK-clip reaches its
    attention: a threshold below every logit scales its w_q_b too."""
    cfg, batch, state = batch_and_state
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, qk_clip_threshold=1e-3))
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    assert qk_clip.layer_stacks(cfg.model, cfg.execution.scan_layers)[-1] == (
        "mtp_layers", slice(cfg.model.n_layers, cfg.model.n_layers + 1))
    before = jax.device_get(state)
    with jax.set_mesh(trainer.mesh):
        new, metrics = jax.device_get(train.jit_train_step(trainer)(
            jax.tree.map(lambda x: x.copy(), state), batch))
    assert np.isfinite(metrics["mtp_loss"])
    assert metrics["attention_logit_max_per_layer"].shape == (cfg.model.n_layers + 1,)
    assert np.any(new.router_bias_LE[-1] != before.router_bias_LE[-1])
    assert metrics["qk_clip_heads_clipped"] == (cfg.model.n_layers + 1) * cfg.model.n_heads


# ----------------------------------------------------------------------------- the module


@pytest.mark.slow
def test_scanned_equals_unrolled_and_module_k_sees_no_token_past_its_target(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg.model, mtp_layers=2)
    ex = dataclasses.replace(tiny_cfg.execution, remat="none")
    b, s = 2, 32
    tokens = jax.random.randint(jax.random.key(0), (b, s), 0, cfg.vocab_size)
    seg = jnp.ones((b, s), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    bias = jax.random.normal(jax.random.key(1), (cfg.n_moe_layers + 2, cfg.n_routed_experts))
    params = Transformer(cfg, ex).init(jax.random.key(0), tokens, seg, pos,
                                       init_router_bias(cfg))["params"]
    assert params["mtp_layers"]["eh_proj"].shape == (2, 2 * cfg.d_model, cfg.d_model)

    def mtp_nll(ex, p, tokens):
        _, stats = Transformer(cfg, ex).apply({"params": p}, tokens, seg, pos, bias * 0.01,
                                              jnp.roll(tokens, -1, axis=1))
        return np.asarray(stats["mtp_nll_KBS"])

    unrolled = {k: v for k, v in params.items() if not k.endswith("_layers")}
    for stack, n in (("dense_layers", cfg.n_dense_layers), ("moe_layers", cfg.n_moe_layers),
                     ("mtp_layers", 2)):
        for i in range(n):
            unrolled[f"{stack}_{i}"] = jax.tree.map(lambda x: x[i], params[stack])
    scanned = mtp_nll(ex, params, tokens)
    assert scanned.shape == (2, b, s)
    np.testing.assert_allclose(mtp_nll(dataclasses.replace(ex, scan_layers=False), unrolled,
                                       tokens), scanned, rtol=1e-5, atol=1e-5)
    # change the tokens from position q on: module k's losses at positions i + k + 1 < q
    # (its inputs up to t_{i+k}, its target t_{i+k+1}) stay; the one whose target moved not
    q = 20
    changed = tokens.at[:, q:].set((tokens[:, q:] + 1) % cfg.vocab_size)
    after = mtp_nll(ex, params, changed)
    for k in (1, 2):
        np.testing.assert_allclose(after[k - 1, :, :q - k - 1], scanned[k - 1, :, :q - k - 1],
                                   rtol=1e-6, atol=1e-6)
        assert np.all(after[k - 1, :, q - k - 1] != scanned[k - 1, :, q - k - 1])


def test_target_weights_count_only_targets_in_the_same_document():
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    np.testing.assert_array_equal(objective.target_weights(seg, 1),
                                  [[1, 1, 0, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(objective.target_weights(seg, 2),
                                  [[1, 0, 0, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(objective.mtp_target_weights(seg, 2)[1],
                                  [[0, 0, 0, 1, 0, 0, 0, 0]])


# ----------------------------------------------------------------------------- counts, config


def test_deepseek_v3_counts_671b_and_with_its_mtp_module_685b():
    cfg = load_config(config_path("deepseek-v3.yaml")).model
    counts = flops.parameter_counts(cfg)
    assert abs(counts["total_params"] - 671e9) < 0.5e9
    assert abs(counts["active_params"] - 37e9) < 1e9
    # DeepSeek-V3's release: 671B main + 14B MTP (its copies of embedding and head counted)
    shipped = counts["mtp_params"] + 2 * cfg.vocab_size * cfg.d_model
    assert 684e9 < counts["total_params"] + shipped < 685.5e9
    # training FLOPs: the module's block, projection and the head once more per token
    without = dataclasses.replace(cfg, mtp_layers=0)
    extra = flops.train_flops(cfg, 1, 0) - flops.train_flops(without, 1, 0)
    routed = param_table.size(param_table.row("moe.w_gate"), cfg) * 3 * cfg.top_k \
        // cfg.n_routed_experts
    assert extra > 6 * (cfg.d_model * cfg.vocab_size + 2 * cfg.d_model ** 2 + routed)
    assert flops.parameter_counts(without)["mtp_params"] == 0


@pytest.mark.parametrize("overrides,message", [
    (["model.mtp_layers=-1"], r"model\.mtp_layers: -1 must be >= 0"),
    (["model.mtp_layers=1", "model.n_dense_layers=3"],
     r"model\.mtp_layers: 1 needs MoE layers .*model\.n_dense_layers=3 = model\.n_layers"),
    (["model.mtp_loss_weight=-0.1"], r"model\.mtp_loss_weight: -0\.1 must be >= 0"),
])
def test_config_mistakes_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config_path("tiny-cpu.yaml"), overrides)


@pytest.mark.slow
def test_the_plan_compiles_and_prices_the_module(tiny_cfg):
    """`plan` sizes the step with the module from the compiled program (its memory, its
    matmuls) and prices its attention like a layer's."""
    from test_plan import plan_json, TEST_SIZE

    without, with_mtp = (plan_json("tiny-cpu.yaml", {**TEST_SIZE, "model.mtp_layers": k})
                         for k in (0, 1))
    m = dataclasses.replace(tiny_cfg.model, mtp_layers=1)
    matmul_KP = [6.0 * flops.matmul_params_per_token(dataclasses.replace(m, mtp_layers=k))
                 * without["tokens_per_device"] for k in (0, 1)]
    attention_per_layer = (without["flops"]["model"] - matmul_KP[0]) / m.n_layers
    np.testing.assert_allclose(with_mtp["flops"]["model"],
                               matmul_KP[1] + (m.n_layers + 1) * attention_per_layer, rtol=1e-6)
    attention = [r["flops"]["by_class"]["attention_forward"] for r in (without, with_mtp)]
    np.testing.assert_allclose(attention[1] / attention[0], (m.n_layers + 1) / m.n_layers)
    assert with_mtp["flops"]["hlo_matmul_loss"] > 1.1 * without["flops"]["hlo_matmul_loss"]
    assert with_mtp["memory"]["step"]["xla_cpu"]["temp"] > without["memory"]["step"]["xla_cpu"][
        "temp"]
