"""What the step waits for besides its kernels' work: the GPU program's collectives by the
phase they sit in, its kernel launches and the host round trips of its data-dependent loops.

The overlap model (step_time.py) lets every collective run beside compute. Some cannot:
- `update_exchange`: the optimizer update's collectives (Muon's re-layout all-to-alls,
  muon_sharded.py; the gradient norm's all-reduce). The update needs every gradient and
  the next forward needs the update, so nothing of the forward or backward runs beside
  them: serial.
- `fill` / `drain`: the forward's first gathers and the backward's last reduce-scatters
  — the embedding's and the head's (outside the layer loops) and one execution of the
  first layer kind's (the dense layers when the model has them, else the MoE ones): the
  step starts with nothing to hide the first behind and ends with nothing to hide the
  last behind. A bound: XLA's schedule may start the head's gather early.
- `in_layer_exchange`: the exchanges of activations inside the forward and backward (the
  MoE's dispatch and combine, context parallelism's head all-to-alls and its gathers
  and reduce-scatters of keys and values over the node) sit between the kernels
  that make their input and those that use it: the compute stream waits for them, less
  what the kernels XLA's latency-hiding scheduler put between an exchange's start and
  its done cover (`covered_exchange_bytes`: e.g. the shared expert's GEMMs beside the
  MoE's dispatch).
Op names say the phase: jax names the forward and backward `…jvp(…)…` (the update has no
such name) and a scanned layer's ops `…/while/body/…`; ragged all-to-alls carry no op
name and are always the MoE's exchange.

Kernel launches: every launch the program runs per step (kernel_classes.py). Loop trips:
a while loop whose trip count is data copies its predicate to the host on every trip
(hardware.py [while]); counted at the trips the plan expects (gpu_program.expected_trips).
"""

from __future__ import annotations

import re
from typing import Callable

from europa_jax.plan.program import hlo_report
from europa_jax.plan.program.hlo_program import Module

PHASES = ("update_exchange", "fill", "drain", "in_layer_exchange")
EXCHANGES = ("all-to-all", "ragged-all-to-all")


def phase(c: hlo_report.Collective, first_layers: str, weight_axis: str = "data"
          ) -> tuple[str, bool] | None:
    """(phase, whether one execution per step of it counts) of a collective, or None for
    one the overlap model may hide (the layers' weight gathers and gradient
    reduce-scatters past the first). A gather or reduce-scatter in the forward or backward
    that is not over the weights' FSDP axis moves activations (context parallelism's
    keys and values, their gradients): an in-layer exchange."""
    name = c.op_name
    if c.op == "ragged-all-to-all":
        return "in_layer_exchange", False
    if "jvp(" not in name:
        return "update_exchange", False
    if c.op not in ("all-gather", "reduce-scatter"):
        return ("in_layer_exchange", False) if c.op in EXCHANGES else None
    if not any(a.split(":")[0] == weight_axis for a in c.axes):
        return "in_layer_exchange", False
    backward = "transpose(" in name
    wanted = "drain" if c.op == "reduce-scatter" else "fill"
    if backward != (wanted == "drain"):
        return None
    if "/while/body/" not in name:
        return wanted, False
    return (wanted, True) if first_layers in name else None


def phase_bytes(found: list[hlo_report.Collective], first_layers: str,
                fill: Callable[[hlo_report.Collective], float] = lambda c: 1.0
                ) -> dict[str, dict[str, float]]:
    """Per phase of the module docstring: NVLink and InfiniBand bytes per GPU per step of
    a program's collectives (hlo_report.collectives; `fill(c)`: the share of a ragged
    exchange's buffers routing is expected to fill)."""
    out = {p: {"nvlink_bytes": 0.0, "infiniband_bytes": 0.0} for p in PHASES}
    for c in found:
        where = phase(c, first_layers)
        if not where:
            continue
        name, once = where
        share = (1.0 / c.count if once and c.count else 1.0) * (
            fill(c) if c.op == "ragged-all-to-all" else 1.0)
        between = c.infiniband_bytes * share
        out[name]["infiniband_bytes"] += between
        out[name]["nvlink_bytes"] += c.bytes_per_device * share - between
    return out


def covered_exchange_bytes(mod: Module, collectives_of: Callable[[str, float], list],
                           seconds_of: Callable[[str], float],
                           link_seconds: Callable[[hlo_report.Collective], float],
                           first_layers: str, dynamic_trips: Callable[[str], float] | None = None
                           ) -> tuple[float, float]:
    """(NVLink, InfiniBand) bytes per step of the in-layer exchanges that kernels run while
    they are in flight: for each exchange's start, the kernels scheduled in the same
    computation before its done — `seconds_of(instruction)`, one run's time at the peak
    of what bounds it — against the exchange's own time at its links' peak
    (`link_seconds` of `collectives_of(start line, executions per step)`), the covered
    share of its bytes: min(1, kernels' seconds / exchange's), both sides timed at their
    peaks. The kernels of a loop or call between the two count nothing."""
    nvlink = between = 0.0
    for comp, times in hlo_report.execution_counts(mod.comps, mod.entry, dynamic_trips).items():
        open_starts: dict[str, list] = {}  # start → [its collectives, kernels' seconds]
        for name, _, opcode, rest, line in mod.parsed.get(comp, []):
            if opcode.endswith("-done"):
                start = (mod.operands(rest) or [""])[0]
                found, covering = open_starts.pop(start, ([], 0.0))
                for c in found:
                    exchange = link_seconds(c)
                    share = min(1.0, covering * times / exchange) if exchange > 0 else 0.0
                    nvlink += (c.bytes_per_device - c.infiniband_bytes) * share
                    between += c.infiniband_bytes * share
                continue
            found = [c for c in collectives_of(line, times)
                     if (phase(c, first_layers) or ("",))[0] == "in_layer_exchange"]
            if found:  # an in-layer exchange's start (a `-done` is none of these)
                open_starts[name] = [found, 0.0]
                continue
            run = seconds_of(name)  # 0 for what is no kernel (other collectives)
            for window in open_starts.values():
                window[1] += run
    return nvlink, between


def loop_trips(mod: Module, dynamic_trips: Callable[[str], float] | None = None) -> float:
    """Predicate evaluations per step of the loops whose trip count is data: trips + 1 per
    execution of each such loop, at `dynamic_trips(its op name)` expected trips (each
    computation's executions counted as the collectives' are, hlo_report.execution_counts)."""
    total = 0.0
    for name, times in hlo_report.execution_counts(mod.comps, mod.entry, dynamic_trips).items():
        for line in mod.comps[name]:
            loop = re.search(r"condition=([\w.\-]+), body=", line)
            if loop and hlo_report._trip_count(line, mod.comps) is None:
                trips = dynamic_trips(hlo_report._op_name(line)) if dynamic_trips else 1.0
                total += times * (trips + 1)
    return total
