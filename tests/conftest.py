"""Every test runs on 8 CPU devices (set before jax creates its backends)."""

import dataclasses
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from europa_jax.config_loader import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_path(name: str) -> str:
    return os.path.join(REPO, "configs", name)


@pytest.fixture(scope="session")
def tiny_cfg():
    """tiny-cpu shrunk further so one compiled step takes seconds on 2 cores."""
    cfg = load_config(config_path("tiny-cpu.yaml"))
    model = dataclasses.replace(cfg.model, d_model=32, q_lora_rank=16, kv_lora_rank=16,
                                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                dense_ffn_dim=64, expert_ffn_dim=16, attention_block_size=16)
    data = dataclasses.replace(cfg.data, seq_len=64, global_batch_size=8, max_documents=40,
                               validation_fraction=0.0)
    train = dataclasses.replace(cfg.train, steps=10, eval_every=0)
    return dataclasses.replace(cfg, model=model, data=data, train=train)


def train_for(cfg, steps):
    """Train `steps` steps from seed 0 on the config's mesh: (final state, losses)."""
    import jax

    from europa_jax.run import loop
    from europa_jax.parallel import sharding
    from europa_jax.train import train

    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    state = train.init_state(trainer, seed=0)
    step = train.jit_train_step(trainer)
    losses = []
    with jax.set_mesh(mesh):
        for _, (_, batch) in zip(range(steps), loop.device_batches(
                trainer, loop.host_batch_iterator(cfg))):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return state, losses


def split_padding(padded, shape):
    """(the leading `shape` part of a zero-padded stored array, the padding's values)."""
    import numpy as np

    used = tuple(slice(0, n) for n in shape)
    rest = np.ones(padded.shape, bool)
    rest[used] = False
    return padded[used], padded[rest]
