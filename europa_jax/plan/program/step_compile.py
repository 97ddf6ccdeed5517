"""Compile a config's step for a fake mesh of XLA:CPU devices and read its numbers.

`measure` compiles the whole step, forward+backward alone and the optimizer update alone,
and returns every number the plan reports as one flat dict (memory by phase, matmul
FLOPs, collectives by op/axes/dtype, offloaded activation bytes); `extrapolate` reads
two shallow compiles on a line per MoE layer, and `with_exact_update` puts back the
update's own numbers compiled at full depth (plan.py says when probes are used).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

from europa_jax.config import Config
from europa_jax.plan.program import hlo_report
from europa_jax.train import train

TOP_BUFFERS = 8


def _outside_shard_map(line: str) -> bool:
    return "shard_map" not in line


def _on_device(tree):
    """The same abstract arrays in device memory (the loss is computed on device values)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding.with_memory_kind("device")), tree)


def lower_loss(trainer: train.Trainer, state: train.TrainState, batch):
    """Forward + backward alone (no optimizer): per-device shapes, all in the shard_map."""
    def loss(params, router_bias_LE, batch):
        return trainer.loss(params, router_bias_LE, batch)[0]

    return jax.jit(jax.grad(loss)).lower(_on_device(state.params), state.router_bias_LE, batch)


def lower_update(trainer: train.Trainer, state: train.TrainState):
    """The optimizer update alone, on device values: gradients shaped like the parameters."""
    def update(grads, opt_state, params):
        updates, opt_state = trainer.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = _on_device(state.params)
    return jax.jit(update, donate_argnums=(1, 2)).lower(params, _on_device(state.opt_state),
                                                         params)


def lowered_hlo(lowered) -> str:
    return lowered.compiler_ir("hlo").as_hlo_text()


def _host_values_bytes(jaxpr) -> int:
    """Bytes of host-memory values a (per-device) jaxpr produces and keeps.

    Loops count by their stacked outputs (not per iteration); calls and remat regions
    are entered, since what they return is what their insides made.
    """
    total = 0
    for eqn in jaxpr.eqns:
        subs = [p.jaxpr if hasattr(p, "jaxpr") else p for p in eqn.params.values()
                if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]
        if subs and eqn.primitive.name not in ("scan", "while"):
            total += sum(_host_values_bytes(s) for s in subs)
            continue
        for v in eqn.outvars:
            if str(getattr(v.aval, "memory_space", "")).endswith("Host"):
                total += math.prod(v.aval.shape) * v.aval.dtype.itemsize
    return total


def offloaded_activation_bytes(jaxpr) -> int:
    """Per-device bytes of saved activations the remat policy sends to host memory.

    XLA:CPU drops the memory-space moves of remat offload, so they are read from the
    step's jaxpr: host-typed values made inside the loss's shard_map (per-device shapes).
    """
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            total += _host_values_bytes(eqn.params["jaxpr"])
            continue
        for p in eqn.params.values():
            inner = p.jaxpr if hasattr(p, "jaxpr") else p
            if hasattr(inner, "eqns"):
                total += offloaded_activation_bytes(inner)
    return total


def collective_numbers(rows: list[dict], prefix: str) -> dict[str, float]:
    numbers = {}
    for r in rows:
        key = f"{prefix}/{r['op']}/{r['axes']}/{r['dtype']}"
        numbers[key + "/bytes"] = r["bytes_per_device"]
        numbers[key + "/count"] = r["count"]
        numbers[key + "/ib_bytes"] = r.get("infiniband_bytes", 0.0)
    return numbers


def collective_table(text: str, mesh, cfg: Config, **kw) -> list[dict]:
    """hlo_report's collectives of a program of `cfg`'s step, summarized, the links
    between its nodes (mesh.devices_per_node) apart."""
    return hlo_report.summarize(hlo_report.collectives(
        text, mesh, devices_per_node=cfg.mesh.devices_per_node, **kw))


def measure(cfg: Config, mesh) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """Compile the step of `cfg` on `mesh`: every number the plan extrapolates, flat.

    Returns (numbers, the largest buffers of the compiled step and of forward+backward).
    """
    trainer = train.build_trainer(cfg, mesh)
    state, batch = trainer.abstract_state, train.abstract_batch(trainer)
    plain = train.build_trainer(without_remat(cfg), mesh)
    with jax.set_mesh(mesh):
        traced = train.jit_train_step(trainer).trace(state, batch)
        lowered = traced.lower()
        loss_lowered = lower_loss(trainer, state, batch)
        plain_flops = hlo_report.dot_flops(lowered_hlo(lower_loss(
            plain, plain.abstract_state, batch)))
        compiled = lowered.compile()
        loss_compiled = loss_lowered.compile()
        update_compiled = lower_update(trainer, state).compile()
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    numbers = _update_numbers(update_compiled, mesh, cfg)
    for prefix, mem in (("memory", compiled.memory_analysis()),
                        ("memory_fb", loss_compiled.memory_analysis())):
        numbers.update(_memory_numbers(prefix, mem))
    numbers.update({
        "flops/hlo_loss": hlo_report.dot_flops(lowered_hlo(loss_lowered)),
        "flops/hlo_loss_no_remat": plain_flops,
        "flops/xla_cost_analysis": float((cost or {}).get("flops", 0.0)),
        "host/activations": float(offloaded_activation_bytes(traced.jaxpr.jaxpr)),
    })
    numbers.update(collective_numbers(collective_table(lowered_hlo(lowered), mesh, cfg),
                                      "collective/step"))
    numbers.update(collective_numbers(collective_table(text, mesh, cfg, keep=_outside_shard_map),
                                      "collective/partitioner"))
    largest = {"step": hlo_report.largest_buffers(text, TOP_BUFFERS),
               "forward_backward": hlo_report.largest_buffers(loss_compiled.as_text(),
                                                              TOP_BUFFERS)}
    return numbers, largest


def without_remat(cfg: Config) -> Config:
    """The same step saving every activation: its matmuls ÷ the step's = recompute. (The
    layer inputs' e4m3 rounding, which only a kept input needs, moves no matmul.)"""
    return dataclasses.replace(cfg, execution=dataclasses.replace(
                                   cfg.execution, remat="none",
                                   layer_input_format="compute_dtype"),
                               offload=dataclasses.replace(cfg.offload, activations="none"))


def _memory_numbers(prefix: str, mem) -> dict[str, float]:
    return {f"{prefix}/{f}": float(getattr(mem, f"{f}_size_in_bytes"))
            for f in ("argument", "output", "alias", "temp", "generated_code")}


def _update_numbers(update_compiled, mesh, cfg: Config) -> dict[str, float]:
    """The optimizer update compiled alone: memory, matmul FLOPs, collectives.

    FLOPs are read here, not off the step: in the step's optimized text XLA:CPU fuses the
    model's attention dots and drops their metadata, so "outside the shard_map" cannot be
    read off a dot (on europa-952b that misattributed 53.7 PFLOP).
    """
    text = update_compiled.as_text()
    numbers = _memory_numbers("memory_update", update_compiled.memory_analysis())
    numbers["flops/optimizer"] = hlo_report.dot_flops(text)
    numbers.update(collective_numbers(collective_table(text, mesh, cfg), "collective/update"))
    return numbers


def measure_update(cfg: Config, mesh) -> dict[str, float]:
    """`_update_numbers` at `cfg`'s own depth, for probed plans: Muon pads each stack's
    matrices with zero matrices to a multiple of the devices (muon_sharded.py), a step
    function of depth that no line through two probes follows."""
    trainer = train.build_trainer(cfg, mesh)
    with jax.set_mesh(mesh):
        compiled = lower_update(trainer, trainer.abstract_state).compile()
    return _update_numbers(compiled, mesh, cfg)


def with_exact_update(probed: dict[str, float], exact: dict[str, float]) -> dict[str, float]:
    """Extrapolated numbers with the update's own replaced by `exact` (full depth).

    The step's partitioner collectives are the update's plus a few of its own (outside the
    shard_map, linear in depth): the update's extrapolated share is swapped for its exact one.
    """
    update_prefixes = ("memory_update/", "flops/optimizer", "collective/update/")
    out = {k: v for k, v in probed.items() if not k.startswith(update_prefixes)}

    def step_key(key: str) -> str:
        return "collective/partitioner/" + key.removeprefix("collective/update/")

    for key, value in probed.items():
        if key.startswith("collective/update/"):
            out[step_key(key)] = max(0.0, out.get(step_key(key), 0.0) - value)
    for key, value in exact.items():
        out[key] = value
        if key.startswith("collective/update/"):
            out[step_key(key)] = out.get(step_key(key), 0.0) + value
    return {k: v for k, v in out.items() if v or not k.startswith("collective/")}


def with_moe_layers(cfg: Config, n_moe: int) -> Config:
    model = dataclasses.replace(cfg.model, n_layers=cfg.model.n_dense_layers + n_moe)
    return dataclasses.replace(cfg, model=model)


def extrapolate(at_a: dict[str, float], at_b: dict[str, float], a: int, b: int,
                target: int) -> dict[str, float]:
    """Each number on the line through (a, at_a) and (b, at_b), read at `target`."""
    out = {}
    for key in at_a.keys() | at_b.keys():
        va, vb = at_a.get(key, 0.0), at_b.get(key, 0.0)
        out[key] = max(0.0, vb + (vb - va) / (b - a) * (target - b))
    return out
