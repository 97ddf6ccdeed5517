"""Where a step's time goes: a jax.profiler trace of the CPU step, split by what each HLO
op belongs to (attention, expert matmuls, MoE dispatch, optimizer, collectives, ...).

    from profile_breakdown import breakdown
    shares = breakdown(trace_dir, compiled_hlo_text)

XLA:CPU's trace has one event per executed HLO op (thunk) on the threads that run the
devices, named by the op (`hlo_op`); loops and conditionals contain their bodies' ops.
Each op's *exclusive* time (its duration minus its children's) is credited to a category
read from the op's `op_name` metadata in the compiled HLO — the jax name stack, which
holds the Flax module path (`.../moe_layers/moe/...`) and the transformations (`jvp`,
`transpose`, `vmap`). Shares are of device-thread time summed over the devices; with 8
devices on 2 cores they are shares of the work, not of wall time.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

# Collectives by what they carry; the rest by the module path in the op's name stack.
FSDP = ("all-gather", "reduce-scatter", "all-reduce")
def category(op: str, name: str) -> str:
    """The category of HLO op `op` (e.g. 'fusion.12') whose name stack is `name`. The
    model marks its kernels with named scopes (`attention_kernel`, `expert_matmuls`)."""
    kind = op.split(".")[0].replace("_", "-")  # thunks say all_gather, HLO all-gather
    if kind.startswith(FSDP):
        return "collective: FSDP gathers, reductions"
    if "jvp(" not in name:  # not the forward/backward pass: the optimizer update
        if kind.startswith("all-to-all"):
            return "optimizer: Muon re-layout (all-to-all)"
        if "vmap(" in name:  # Newton–Schulz runs vmapped over a device's matrices
            return "optimizer: Newton-Schulz"
        return "optimizer: moments, clip, apply"
    if kind.startswith("all-to-all"):
        return "collective: MoE exchange"
    if "/attention_kernel/" in name or name.endswith("/attention_kernel"):
        return "attention: kernel"
    if "/expert_matmuls/" in name or name.endswith("/expert_matmuls"):
        return "MoE: expert matmuls"
    if "_norm/" in name:
        return "norms"
    if "/moe/shared/" in name or "/mlp/" in name:
        return "dense MLP, shared expert"
    if "/attention/" in name:
        return "attention: projections, RoPE"
    if "/moe/" in name:
        return "MoE: routing, dispatch, combine"
    if "Transformer._stack" not in name:
        return "embedding, LM head, loss"
    return "other"


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO op name → its `op_name` metadata, from compiled HLO text."""
    names = {}
    for m in re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', hlo_text, re.M):
        names.setdefault(m.group(1), m.group(2))
    return names


def trace_events(trace_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*",
                                          "perfetto_trace.json.gz")))
    if not paths:
        raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz (jax.profiler trace "
                                "with create_perfetto_trace=True)")
    with gzip.open(paths[-1]) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def breakdown(trace_dir: str, hlo_text: str) -> dict[str, float]:
    """Seconds of device-thread time per category, largest first."""
    names = op_names(hlo_text)
    by_thread = collections.defaultdict(list)
    for e in trace_events(trace_dir):
        by_thread[e["tid"]].append(e)
    seconds: collections.Counter = collections.Counter()
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_events, child_time = [], collections.Counter()
        for i, e in enumerate(events):  # nesting by time on one thread
            while open_events and events[open_events[-1]]["ts"] + events[open_events[-1]]["dur"] \
                    <= e["ts"]:
                open_events.pop()
            if open_events:
                child_time[open_events[-1]] += e["dur"]
            open_events.append(i)
        for i, e in enumerate(events):
            exclusive = (e["dur"] - child_time[i]) / 1e6
            op = e.get("args", {}).get("hlo_op")
            if op:
                name = names.get(op)
                seconds[category(op, name) if name else "copies, layout"] += exclusive
            elif e["name"] == "Rendezvous":  # a device waiting for its peers in a collective
                seconds["collective: waiting"] += exclusive
    return dict(seconds.most_common())
