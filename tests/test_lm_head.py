"""The chunked next-token loss: the same values and gradients as whole-sequence logits, a
fraction of the memory, and the trained model's loss unchanged by the chunk size."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.model import lm_head
from europa_jax.parallel import sharding
from europa_jax.run import loop
from europa_jax.train import train
from conftest import config_path

VOCAB = 200  # of a padded 256: the padding rows must never be predicted


def inputs(b=2, s=64, d=16, v=256, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x_BSD = jax.random.normal(k1, (b, s, d), jnp.float32)
    head_DV = jax.random.normal(k2, (d, v), jnp.float32) * 0.3
    targets_BS = jax.random.randint(k3, (b, s), 0, VOCAB)
    return x_BSD, head_DV, targets_BS


def reference_nll(x_BSD, head_DV, targets_BS):
    """Whole-sequence logits with the padding rows removed: what the loss means."""
    logits_BSV = jnp.einsum("bsd,dv->bsv", x_BSD, head_DV[:, :VOCAB])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS)


@pytest.mark.parametrize("chunk", [0, 8, 16, 64, 128])
def test_chunked_loss_and_gradients_equal_whole_sequence_logits(chunk):
    x_BSD, head_DV, targets_BS = inputs()
    weight_BS = jax.random.uniform(jax.random.key(1), targets_BS.shape)

    def loss(fn):
        return lambda x, h: jnp.sum(fn(x, h) * weight_BS)

    chunked = loss(lambda x, h: lm_head.token_nll(x, h, targets_BS, VOCAB, chunk))
    whole = loss(lambda x, h: reference_nll(x, h, targets_BS))
    np.testing.assert_allclose(lm_head.token_nll(x_BSD, head_DV, targets_BS, VOCAB, chunk),
                               reference_nll(x_BSD, head_DV, targets_BS), rtol=1e-5, atol=1e-6)
    grads = jax.grad(chunked, argnums=(0, 1))(x_BSD, head_DV)
    expected = jax.grad(whole, argnums=(0, 1))(x_BSD, head_DV)
    np.testing.assert_allclose(grads[0], expected[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1], expected[1], rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(grads[1][:, VOCAB:]))  # padding rows get no gradient


def compiled_temp_bytes(chunk, s=2048, v=4096, d=64):
    x_BSD, head_DV, targets_BS = (jax.ShapeDtypeStruct((1, s, d), jnp.float32),
                                  jax.ShapeDtypeStruct((d, v), jnp.float32),
                                  jax.ShapeDtypeStruct((1, s), jnp.int32))
    grad = jax.grad(lambda x, h, t: jnp.sum(lm_head.token_nll(x, h, t, v - 8, chunk)),
                    argnums=(0, 1))
    return jax.jit(grad).lower(x_BSD, head_DV, targets_BS).compile().memory_analysis() \
        .temp_size_in_bytes


def test_chunks_bound_the_logits_memory_of_forward_and_backward():
    logits_bytes = 2048 * 4096 * 4  # one sequence's f32 logits: 32 MiB
    whole, chunked = compiled_temp_bytes(0), compiled_temp_bytes(256)
    print(f"temp bytes of loss+grad: whole {whole / 2**20:.1f} MiB, "
          f"256-token chunks {chunked / 2**20:.1f} MiB (logits {logits_bytes / 2**20:.0f} MiB)")
    assert whole >= logits_bytes  # at least the logits, whole
    assert chunked < whole / 4 and chunked < logits_bytes / 2


def test_a_chunk_that_does_not_divide_the_sequence_is_a_config_error():
    with pytest.raises(ConfigError, match=r"execution.loss_chunk_tokens: 48 does not divide "
                                          r"data.seq_len=256"):
        load_config(config_path("tiny-cpu.yaml"), ["execution.loss_chunk_tokens=48"])


@pytest.mark.slow
def test_training_loss_and_gradients_do_not_depend_on_the_chunk(tiny_cfg):
    """The sharded training loss (2×4 mesh, document masks) with 16-token chunks vs none."""
    mesh = sharding.make_mesh(tiny_cfg.mesh)
    batch = next(loop.host_batch_iterator(tiny_cfg))
    results = []
    for chunk in (0, 16):
        cfg = dataclasses.replace(
            tiny_cfg, execution=dataclasses.replace(tiny_cfg.execution, loss_chunk_tokens=chunk))
        trainer = train.build_trainer(cfg, mesh)
        state = train.init_state(trainer, seed=0)
        placed = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
        with jax.set_mesh(mesh):
            results.append(jax.device_get(jax.jit(jax.value_and_grad(
                lambda p: trainer.loss(p, state.router_bias_LE, placed)[0]))(state.params)))
    (loss0, grads0), (loss16, grads16) = results
    np.testing.assert_allclose(loss16, loss0, rtol=1e-5)
    for g16, g0 in zip(jax.tree.leaves(grads16), jax.tree.leaves(grads0)):
        np.testing.assert_allclose(g16, g0, rtol=1e-4, atol=1e-7)


def test_the_heads_backward_gemms_run_in_the_compute_dtype():
    """bf16 activations and head: the logits are f32, and so is their gradient, but the
    two backward GEMMs take it in bf16 (a float32 operand would make XLA run them in TF32
    at half the BF16 peak on a GPU) — and the gradients are those of the f32 cotangent
    rounded to bf16."""
    x_BSD, head_DV, targets_BS = inputs()
    x_BSD, head_DV = x_BSD.astype(jnp.bfloat16), head_DV.astype(jnp.bfloat16)
    loss = lambda x, h: jnp.sum(lm_head.token_nll(x, h, targets_BS, VOCAB, 16))
    grad = jax.grad(loss, argnums=(0, 1))
    text = jax.jit(grad).lower(x_BSD, head_DV).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) >= 3  # forward (recomputed) and the two backward GEMMs
    operand_types = [line.rsplit(":", 1)[1].split("->")[0] for line in dots]
    assert all("f32" not in t and "bf16" in t for t in operand_types), operand_types
    # the same as the plain transpose with the cotangent rounded to bf16
    nll = lambda x, h: optax.softmax_cross_entropy_with_integer_labels(
        lm_head.logits(x, h, VOCAB), targets_BS)
    dlogits_BSV = jax.grad(lambda z: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
        z, targets_BS)))(lm_head.logits(x_BSD, head_DV, VOCAB)).astype(jnp.bfloat16)
    dx_BSD = jnp.einsum("bsv,dv->bsd", dlogits_BSV, head_DV,
                        preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    dx, dh = grad(x_BSD, head_DV)
    assert jax.grad(lambda x: jnp.sum(nll(x, head_DV)))(x_BSD).dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_BSD, np.float32),
                               rtol=1e-2, atol=1e-2)
    assert dh.dtype == jnp.bfloat16 and not np.any(np.asarray(dh[:, VOCAB:], np.float32))
