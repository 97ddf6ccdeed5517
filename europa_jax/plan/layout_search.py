"""`europa-jax plan --search`: compile a grid of layouts of one config and compare them.

Each layout is the config with a few keys changed (`--vary KEY=V1,V2,…`; by default the
expert axis over 1 to 16 nodes' worth of GPUs and the MoE chunk whole or a quarter row)
and is planned in its own process — a GPU compile of europa-952b holds ~2 GB and takes
~2 min, and one that fails must not take the others with it. Widening the expert axis
derives the rest of the layout: `mesh.data` = devices / expert, cross-node expert groups
allowed, and node-limited routing — a group of experts per node, a token's copies on at
most M = min(4, nodes / 2) of them (DeepSeek-V3 §2.1.2: M = 4 of 8 nodes) — unless the
grid or `--set` names the routing itself. An expert axis inside a node keeps the
config's routing. The table says which routing each row has: it changes the model, not
only its layout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

from europa_jax.config import Config, ConfigError
from europa_jax.config_loader import load_config

ROUTING_KEYS = ("model.n_group", "model.topk_group")
MAX_NODES_PER_TOKEN = 4  # DeepSeek-V3's M


@dataclasses.dataclass
class Layout:
    """One point of the grid: the overrides that make it, on top of the user's `--set`."""

    varied: dict[str, str]  # the grid's own keys
    derived: dict[str, str]  # what follows from them (mesh.data, routing)
    error: str | None = None  # the config refuses it: reported, not compiled

    @property
    def sets(self) -> list[str]:
        return [f"{k}={v}" for k, v in {**self.derived, **self.varied}.items()]


def parse_vary(items: list[str]) -> dict[str, list[str]]:
    """`KEY=V1,V2,…` arguments → {key: values} (a one-line error for anything else)."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values or "" in values.split(","):
            raise ConfigError(f"--vary {item!r}: expected KEY=V1,V2,… (e.g. mesh.expert=4,8,16)")
        grid[key] = values.split(",")
    return grid


def default_grid(cfg: Config, devices: int) -> dict[str, list[str]]:
    """The expert axis over 1, 2, 4, 8 and 16 nodes where it divides the devices and the
    experts; the MoE dispatched a whole row at once or a quarter row at a time."""
    dpn, experts = cfg.mesh.devices_per_node, cfg.model.n_routed_experts
    widths = [dpn * n for n in (1, 2, 4, 8, 16)
              if devices % (dpn * n) == 0 and experts % (dpn * n) == 0]
    seq = cfg.data.seq_len
    chunks = [0] + ([seq // 4] if seq % 4 == 0 and seq >= 4 else [])
    return {"mesh.expert": [str(w) for w in widths or [cfg.mesh.expert]],
            "execution.moe_chunk_tokens": [str(c) for c in chunks]}


def layouts(config: str | Path, sets: list[str], devices: int,
            grid: dict[str, list[str]]) -> list[Layout]:
    """Every combination of the grid, with its derived keys, checked by the config."""
    named = {s.partition("=")[0] for s in sets} | set(grid)
    out = []
    for values in itertools.product(*grid.values()):
        varied = dict(zip(grid, values))
        layout = Layout(varied, {})
        try:
            # what the derived keys depend on: the node's size (other varied keys may
            # need the derived ones to be valid, e.g. a two-stage dispatch a wide axis)
            base = load_config(config, sets + [f"{k}={v}" for k, v in varied.items()
                                               if k == "mesh.devices_per_node"])
            layout.derived = _derived(base, devices, varied, named)
            cfg = load_config(config, sets + layout.sets)
            if cfg.mesh.n_devices != devices:
                raise ConfigError(f"mesh data×expert = {cfg.mesh.data}×{cfg.mesh.expert} is "
                                  f"not --devices {devices}")
        except ConfigError as e:
            layout.error = str(e)
        out.append(layout)
    return out


def _derived(cfg: Config, devices: int, varied: dict[str, str], named: set[str]) -> dict:
    if "mesh.expert" not in varied:
        return {}
    expert = int(varied["mesh.expert"])
    derived = {}
    if "mesh.data" not in named and expert > 0 and devices % expert == 0:
        derived["mesh.data"] = str(devices // expert)
    nodes = max(1, expert // cfg.mesh.devices_per_node)
    if nodes > 1:
        derived["mesh.allow_cross_node_experts"] = "true"
        if not named & set(ROUTING_KEYS):
            derived["model.n_group"] = str(nodes)
            derived["model.topk_group"] = str(max(1, min(MAX_NODES_PER_TOKEN, nodes // 2)))
    return derived


def plan_one(config: str | Path, sets: list[str], layout: Layout, devices: int,
             extra: list[str], timeout: float | None = None) -> dict:
    """`europa-jax plan --json` of one layout in a child process: its report, or
    {"error": …} when the child did not print one."""
    cmd = [sys.executable, "-m", "europa_jax.cli", "plan", str(config), "--devices",
           str(devices), "--json", *extra]
    for s in sets + layout.sets:
        cmd += ["--set", s]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"error": f"no report within {timeout:.0f} s"}
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        return {"error": lines[-1]}


def plan_all(layouts_: list[Layout], config: str | Path, sets: list[str], devices: int,
             extra: list[str], *, jobs: int = 1, progress: IO[str] | None = None
             ) -> list[dict]:
    """The table's rows of `layouts_`, `jobs` planned at once (a layout the config refused
    is not planned), in the grid's order; a line on `progress` as each one starts."""
    def planned(layout: Layout) -> dict:
        if progress is not None:  # one write per line: the threads print side by side
            progress.write(f"planning {' '.join(layout.sets) or 'the config as it is'} …\n")
            progress.flush()
        report = None if layout.error else plan_one(config, sets, layout, devices, extra)
        return row(layout, report)

    # the child processes do the work: the threads only wait on them
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(planned, layouts_))


def row(layout: Layout, report: dict | None) -> dict:
    """One line of the table from a layout and its report."""
    out = {"varied": layout.varied, "derived": layout.derived}
    if layout.error or report is None:
        return {**out, "error": layout.error or "not planned"}
    if report.get("error") or report.get("compiled", {}).get("error"):
        return {**out, "error": report.get("error") or report["compiled"]["error"]}
    e, per = report["estimate"]["as_compiled"], report["per_device"]
    x = report.get("exchange") or {}
    # rows of seq_len tokens each device runs per step: what one gather per layer serves
    rows = report["tokens_per_device"] / report["seq_len"]
    return {**out, "mesh": report["mesh"], "fits": report["fits"], "rows_per_device": rows,
            # layouts at different global batches compare per row, not per step
            "infiniband_s_per_row": e["infiniband_s"] / rows,
            "hbm_bytes": per["hbm_peak_bytes"], "host_bytes": per["host_peak_bytes"],
            "compute_s": e["compute_s"] + e["memory_s"] + e["update_s"],
            "nvlink_s": e["nvlink_s"], "infiniband_s": e["infiniband_s"], "c2c_s": e["c2c_s"],
            # of the InfiniBand seconds, the MoE token exchange's (the rest is FSDP's)
            "exchange_infiniband_s": sum(c.get("infiniband_s", 0.0)
                                         for c in report["collectives"]
                                         if c["op"] == "ragged-all-to-all"),
            "tokens_per_s_per_gpu": e["tokens_per_s_per_gpu_overlapped"],
            "worst_case_tokens_per_s_per_gpu":
                report["estimate"]["worst_case"]["tokens_per_s_per_gpu_overlapped"],
            # what fewer bytes could buy this layout at most (step_time.ceilings)
            "infiniband_free_tokens_per_s_per_gpu": report["estimate"]["ceilings"][
                "infiniband_free"]["expected"]["tokens_per_s_per_gpu"],
            "destinations": x.get("expected_destinations"),
            "routing": x.get("routing")}


def fastest_fitting(rows: list[dict]) -> dict | None:
    fitting = [r for r in rows if r.get("fits")]
    return max(fitting, key=lambda r: r["tokens_per_s_per_gpu"]) if fitting else None


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def format_table(rows: list[dict], best: dict | None) -> str:
    names = [" ".join(f"{k.split('.')[-1]}={v}" for k, v in r["varied"].items()) for r in rows]
    w = max([len("layout")] + [len(n) for n in names])
    head = (f"{'layout':<{w}} {'data×expert':>11} {'routing':>8} {'fits':>4} {'HBM GB':>7} "
            f"{'host GB':>7} {'rows':>4} {'compute':>8} {'NVLink':>7} {'IB':>7} {'IB/row':>7} "
            f"{'of it MoE':>9} {'C2C':>6} {'tok/s/GPU':>9} {'IB free':>9}")
    lines = [head]
    for name, r in zip(names, rows):
        if "error" in r:
            lines.append(f"{name:<{w}} not planned: {r['error']}")
            continue
        routing = r.get("routing") or {}
        routed = f"{routing.get('topk_group', 1)}/{routing.get('n_group', 1)}"
        lines.append(
            f"{name:<{w}} {r['mesh']['data']:>5}×{r['mesh']['expert']:<5} {routed:>8} "
            f"{'yes' if r['fits'] else 'NO':>4} {r['hbm_bytes'] / 1e9:>7.1f} "
            f"{r['host_bytes'] / 1e9:>7.1f} {r['rows_per_device']:>4g} {r['compute_s']:>7.1f}s "
            f"{r['nvlink_s']:>6.1f}s {r['infiniband_s']:>6.1f}s "
            f"{r['infiniband_s_per_row']:>6.1f}s {_seconds(r.get('exchange_infiniband_s')):>9} "
            f"{r['c2c_s']:>5.1f}s {r['tokens_per_s_per_gpu']:>9,.0f} "
            f"{r['infiniband_free_tokens_per_s_per_gpu']:>9,.0f}")
    lines.append("routing: topk_group/n_group (a token's copies in at most topk_group of "
                 "n_group expert groups; a group per node across nodes); rows: seq_len rows "
                 "per device per step, each layer's weights gathered once for all of them; "
                 "compute = compute + memory + update seconds; links overlap with it; IB/row: "
                 "InfiniBand per row of tokens; of it MoE: the InfiniBand "
                 "seconds of the MoE token exchange (its ragged all-to-alls: GPU targets); "
                 "IB free: tokens/s/GPU of the same step with InfiniBand free, what fewer "
                 "bytes could buy at most")
    if best:
        name = ", ".join(f"{k}={v}" for k, v in {**best["derived"], **best["varied"]}.items())
        lines.append(f"fastest that fits: {name} — {best['tokens_per_s_per_gpu']:,.0f} "
                     f"tokens/s/GPU (worst case {best['worst_case_tokens_per_s_per_gpu']:,.0f})")
    else:
        lines.append("fastest that fits: none of these layouts fits")
    return "\n".join(lines)
