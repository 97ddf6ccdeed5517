"""Pipeline parallelism for a config, priced against the FSDP step the plan compiled.

The recipe leaves open whether pipeline parallelism would have been faster. This prices
pipelined layouts of the same 384 GPUs with the plan's own numbers: the compiled FSDP
step's seconds per class (`europa-jax plan … --json`, the baseline) and the hardware's
efficiency table (hardware.py). Nothing here is compiled; what it counts:

- **Stages over nodes.** P stages of 96/P nodes each hold 1/P of the layers; experts stay
  `mesh.expert`-way parallel inside a node; a stage's weights are FSDP-sharded over its
  nodes. A GPU runs m = rows·P/devices microbatches of one row through its layers, in v
  chunks (interleaved 1F1B: Narayanan et al. 2021, arXiv 2104.04473, §2.2): its kernels'
  work is the FSDP step's × rows/devices, and the schedule's bubble adds (P − 1)/(v·m) of it.
- **What crosses InfiniBand**, per GPU per step, for the stage's parameters (its quarter of
  each MoE layer's routed experts, all other parameters whole), a share (N − 1)/N of them
  from the stage's other N nodes:
  - `fsdp`: what the compiled step does, P = 1: gathered forward and again backward
    (`comm.weight_gather_dtype`), gradients reduce-scattered (`comm.grad_reduce_dtype`)
    once, for all rows a GPU holds;
  - `per_microbatch`: each microbatch gathers its chunks' weights and reduce-scatters
    their gradients, as FSDP does per row — HBM as the FSDP step;
  - `resident`: gathered once per step and kept, gradients accumulated over the
    microbatches (in the reduction dtype) and reduce-scattered once: HBM holds the stage's
    gathered weights and gradient sums, less the two layers' gather buffers FSDP needs;
  - `expert_parallel` (DeepSeek-V3's layout, arXiv 2412.19437 §3.2): routed experts
    spread over the stage's GPUs and never gathered; the other parameters as
    `per_microbatch`; each MoE layer's copies leave the node with probability 1 − 1/N
    (balanced routing), in `comm.expert_exchange_dtype`, forward, recomputed and backward.
  - and at every stage boundary, each microbatch's activations forward and their gradient
    back (bf16 rows of the model width).
- **Host memory**: 1F1B keeps at most P microbatches in flight, so a stage's saved layer
  inputs are the FSDP step's × min(m, P)/P (all m for `fsdp`).

The step is step_time.step_seconds of those seconds: the model every plan estimate uses.
"""

from __future__ import annotations

import dataclasses

from europa_jax.config import Config
from europa_jax.plan.price import exchange, hardware, step_time

POLICIES = ("fsdp", "per_microbatch", "resident", "expert_parallel")
CASE = "expected"
# comm.weight_gather_dtype / comm.grad_reduce_dtype: bytes per value on the wire
DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class Weights:
    """Parameters a GPU gathers per pass in the FSDP step (P = 1)."""

    routed_per_layer: float  # one MoE layer's experts held by one GPU's expert shard
    moe_layers: int
    other: float  # every other parameter: attention, shared experts, dense layers, embeddings

    @property
    def per_pass(self) -> float:
        return self.routed_per_layer * self.moe_layers + self.other


def weights_of(cfg: Config, total_params: float) -> Weights:
    m = cfg.model
    moe_layers = m.n_layers - m.n_dense_layers
    routed_layer = m.n_routed_experts * 3 * m.d_model * m.expert_ffn_dim
    return Weights(routed_layer / cfg.mesh.expert, moe_layers,
                   total_params - routed_layer * moe_layers)


@dataclasses.dataclass(frozen=True)
class Layout:
    stages: int
    virtual: int  # chunks of layers per GPU
    rows: int  # global batch, rows of seq_len tokens
    policy: str


def price(cfg: Config, baseline: dict, layout: Layout,
          hw: hardware.Hardware = hardware.GH200_JUPITER) -> dict:
    """One layout's step, InfiniBand bytes, HBM and host peaks, from `baseline` (the
    plan's --json of `cfg` as compiled: FSDP, one row per GPU)."""
    if layout.policy not in POLICIES:
        raise ValueError(f"policy {layout.policy!r}: one of {', '.join(POLICIES)}")
    devices, per_node = baseline["devices"], cfg.mesh.devices_per_node
    p, v = layout.stages, layout.virtual
    nodes = devices // per_node
    if nodes % p or p > cfg.model.n_layers or not 1 <= v <= cfg.model.n_layers // p:
        raise ValueError(f"{p} stages × {v} chunks do not fit {nodes} nodes and "
                         f"{cfg.model.n_layers} layers")
    if layout.policy == "fsdp" and p != 1:
        raise ValueError("fsdp is the layout without stages (stages 1)")
    stage_nodes = nodes // p
    rows_per_gpu = layout.rows * p / devices  # microbatches of one row
    work = layout.rows / devices  # per GPU, against the baseline's one row
    bubble = (p - 1) / (v * rows_per_gpu) if p > 1 else 0.0

    est = baseline["estimate"]
    seconds = {k: est["by_class"][k]["seconds"][CASE] for k in step_time.CLASSES}
    seconds.update({k: est["lines"][k]["seconds"][CASE] for k in step_time.LINES})
    for k in step_time.COMPUTE + step_time.CHAIN + ("host_copy", "nvlink"):
        seconds[k] *= work * (1 + (bubble if k in step_time.COMPUTE + step_time.CHAIN
                                   else 0.0))

    comm = cfg.comm
    gather, reduce = DTYPE_BYTES[comm.weight_gather_dtype], DTYPE_BYTES[comm.grad_reduce_dtype]
    total = baseline["memory"]["state"]["params"]["device"] / 4 * devices  # f32 shards
    w = weights_of(cfg, total)
    remote = (stage_nodes - 1) / stage_nodes
    stage_params = w.per_pass / p
    m = rows_per_gpu
    hbm = baseline["per_device"]["hbm_peak_bytes"]
    infiniband = {"weights": 0.0, "tokens": 0.0, "boundaries": 0.0}
    if layout.policy == "fsdp":
        infiniband["weights"] = (2 * gather + reduce) * stage_params * remote
    elif layout.policy == "per_microbatch":
        infiniband["weights"] = m * (2 * gather + reduce) * stage_params * remote
    elif layout.policy == "resident":
        infiniband["weights"] = (gather + reduce) * stage_params * remote
        hbm += (gather + reduce) * stage_params - 2 * gather * w.routed_per_layer
    else:  # expert_parallel
        infiniband["weights"] = m * (2 * gather + reduce) * w.other / p * remote
        x = exchange.wire_bytes(comm.expert_exchange_dtype)  # mean of the four exchanges
        copies = cfg.data.seq_len * cfg.model.top_k
        infiniband["tokens"] = (m * w.moe_layers / p * copies * cfg.model.d_model
                                * 6 * x * remote)  # dispatch + combine, three passes
        own_experts = w.routed_per_layer * w.moe_layers * cfg.mesh.expert / devices
        hbm += 2 * own_experts - 2 * (gather + 2) * w.routed_per_layer
    if p > 1:  # each microbatch's activations forward and their gradient back, per chunk
        infiniband["boundaries"] = m * v * 2 * cfg.data.seq_len * cfg.model.d_model * 2
    ib_bytes = sum(infiniband.values())
    seconds["infiniband"] = ib_bytes / (hw.network_bandwidth * hw.infiniband.at(CASE))
    serial_ib = seconds["update_exchange"] + seconds["fill_drain"]
    step = step_time.step_seconds(seconds, hw.overlap_compute.at(CASE), (0.0, serial_ib))
    host = baseline["per_device"]["host_peak_bytes"]
    activations = baseline["memory"]["activations_offloaded"]
    in_flight = layout.rows / devices if layout.policy == "fsdp" else min(m, p) / p
    host += activations * (in_flight - 1)
    budget = baseline["budget"]
    tokens = layout.rows * cfg.data.seq_len / devices
    return {"layout": dataclasses.asdict(layout), "microbatches": m, "bubble": bubble,
            "infiniband_bytes": ib_bytes, "infiniband_by_kind": infiniband,
            "infiniband_s": seconds["infiniband"],
            "compute_s": sum(seconds[k] for k in step_time.COMPUTE + step_time.CHAIN),
            "step_s": step, "tokens_per_s_per_gpu": tokens / step,
            "hbm_peak_bytes": hbm, "host_peak_bytes": host,
            "fits": hbm <= budget["hbm_bytes"] and host <= budget["host_bytes"]}


def layouts(cfg: Config, devices: int, rows: int) -> list[Layout]:
    """FSDP and every pipeline the nodes divide into: v = 1 and the finest interleave
    (one layer per chunk), each weight policy."""
    nodes, out = devices // cfg.mesh.devices_per_node, [Layout(1, 1, rows, "fsdp")]
    for p in range(2, min(nodes, cfg.model.n_layers) + 1):
        if nodes % p:
            continue
        for v in sorted({1, cfg.model.n_layers // p}):
            out += [Layout(p, v, rows, policy) for policy in POLICIES[1:]]
    return out
