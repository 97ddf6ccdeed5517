"""Host offload: state in pinned_host between steps, the lowered step's placements, activation presets."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from europa_jax.parallel import offload, sharding
from europa_jax.train import train
from conftest import train_for


def with_offload(cfg, **kw):
    return dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, **kw))


@pytest.mark.slow
def test_offloaded_state_stays_on_host_between_steps(tiny_cfg):
    """After real steps the state is back in pinned_host (the step's out_shardings). XLA:CPU
    ignores memory kinds in the program itself: that the GPU program reads, copies and writes
    it in host memory is tests/test_gpu_target.py's."""
    cfg = with_offload(tiny_cfg, optimizer_state=True, master_params=True)
    state, losses = train_for(cfg, 2)
    assert all(np.isfinite(losses))
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)
             if leaf.ndim}
    assert kinds == {"pinned_host"}
    assert {p.sharding.memory_kind for p in jax.tree.leaves(state.params)} == {"pinned_host"}
    assert state.step.sharding.memory_kind == "device"
    assert offload.memory_kinds(state)["pinned_host"] > 0.99 * sum(
        offload.memory_kinds(state).values())


def lowered(cfg):
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    with jax.set_mesh(mesh):
        return trainer, train.jit_train_step(trainer).lower(trainer.abstract_state,
                                                            train.abstract_batch(trainer))


def lowered_hlo(cfg):
    return lowered(cfg)[1].compiler_ir("hlo").as_hlo_text()


def host_placements(hlo):
    return hlo.count('_xla_buffer_placement="pinned_host"')


@pytest.mark.slow
def test_lowered_step_reads_state_from_host_and_writes_it_back(tiny_cfg):
    trainer, low = lowered(with_offload(tiny_cfg, optimizer_state=True))
    n_state = sum(1 for x in jax.tree.leaves(trainer.abstract_state.opt_state) if x.ndim)
    # The step's signature: every offloaded leaf comes in and goes out in host memory.
    assert low.as_text().count('mhlo.memory_kind = "pinned_host"') == 2 * n_state
    hlo = low.compiler_ir("hlo").as_hlo_text()
    assert host_placements(hlo) == n_state  # new values written back to the host
    assert hlo.count('_xla_buffer_placement="device"') > 0  # moved in for the update
    assert host_placements(lowered_hlo(tiny_cfg)) == 0


def step_jaxpr(cfg):
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    return str(jax.make_jaxpr(lambda s, b: train.train_step(s, b, trainer=trainer))(
        trainer.abstract_state, train.abstract_batch(trainer)))


@pytest.mark.slow
def test_each_activation_preset_changes_the_program_as_named(tiny_cfg):
    """Recompute shows in the lowered HLO (more matmuls); offloaded residuals show as
    host-memory values in the program jax hands to XLA (XLA:CPU's lowering drops the
    memory-space moves of remat offload, so they are checked one level up)."""
    def cfg_for(preset, remat="full"):
        cfg = dataclasses.replace(tiny_cfg, execution=dataclasses.replace(tiny_cfg.execution,
                                                                          remat=remat))
        return with_offload(cfg, activations=preset)

    dots = lambda preset, **kw: len(re.findall(r" dot\(", lowered_hlo(cfg_for(preset, **kw))))
    host_values = lambda preset: len(re.findall(r"f32<host>|bf16<host>",
                                                step_jaxpr(cfg_for(preset))))
    full = dots("full_remat")
    assert full > dots("none", remat="none")  # the forward runs again in backward
    assert dots("save_dots") < full  # matmul outputs kept, not recomputed
    assert dots("none") == full  # `none` defers to execution.remat (full here)
    assert host_values("full_remat") == 0
    assert 0 < host_values("offload_layer_inputs") < host_values("offload_attention_moe")


def test_the_config_knows_which_presets_keep_the_layer_input():
    """config.py refuses `execution.layer_input_format: e4m3` under a preset that keeps no
    layer input; its list must be this module's."""
    from europa_jax.config import PRESETS_KEEPING_LAYER_INPUT
    assert sorted(PRESETS_KEEPING_LAYER_INPUT) == sorted(
        name for name, actions in offload.PRESETS.items() if "layer_input" in actions)
