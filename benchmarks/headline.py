"""europa-952b's headline figures, printed as the README's table, from a plan's JSON.

    europa-jax plan configs/europa-952b.yaml --devices 384 --documents long-tail --json > plan.json
    python benchmarks/headline.py [plan.json] [--classes]

Without an argument it reads the plan stored in the repository,
tests/data/europa-952b-plan-long-tail.json (that command's output). It prints the README's
headline table (markdown); `--classes` prints docs/plan.md's two tables instead: the step
by class of kernel, and the lines the overlap model leaves out. tests/test_docs.py fails when the README or docs/plan.md holds a table
other than what this prints for the stored plan, so the current figures have one source.
Standard library only: no jax.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORED_PLAN = ROOT / "tests" / "data" / "europa-952b-plan-long-tail.json"
COMMAND = "europa-jax plan configs/europa-952b.yaml --devices 384 --documents long-tail --json"


def load(path: str | Path = STORED_PLAN) -> dict:
    return json.loads(Path(path).read_text())


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _s(x: float) -> str:
    return f"{x:.1f} s"


def _tok(x: float) -> str:
    return f"{x:,.0f}"


def headline_table(plan: dict) -> str:
    """The README's table: fits, HBM and host against their budgets, tokens/s/GPU with its
    range, the step against its two largest parts, and the ceilings with links free."""
    est, per, budget = plan["estimate"], plan["per_device"], plan["budget"]
    rng, ac, ceil = est["range"], est["as_compiled"], est["ceilings"]
    sm = ac["compute_s"] + ac["memory_s"]
    rows = [
        ("fits one GH200", "yes" if plan["fits"] else "no", "`fits`"),
        ("HBM peak / budget per GPU",
         f"{_gb(per['hbm_peak_bytes'])} / {_gb(budget['hbm_bytes'])}",
         "`per_device.hbm_peak_bytes`, `budget.hbm_bytes`"),
        ("host (Grace) memory peak / budget per GPU",
         f"{_gb(per['host_peak_bytes'])} / {_gb(budget['host_bytes'])}",
         "`per_device.host_peak_bytes`, `budget.host_bytes`"),
        ("tokens/s/GPU, expected (low–high)",
         f"**{_tok(est['tokens_per_s_per_gpu'])}** ({_tok(rng['low']['tokens_per_s_per_gpu'])}"
         f"–{_tok(rng['high']['tokens_per_s_per_gpu'])})",
         "`estimate.tokens_per_s_per_gpu`, `estimate.range`"),
        ("step, expected",
         f"{_s(rng['expected']['step_s'])}: {_s(sm)} of GEMMs, attention and memory-bound "
         f"kernels on the SMs, {_s(ac['infiniband_s'])} of InfiniBand beside them",
         "`estimate.as_compiled`"),
        ("tokens/s/GPU with InfiniBand free / with both links free",
         f"{_tok(ceil['infiniband_free']['expected']['tokens_per_s_per_gpu'])} / "
         f"{_tok(ceil['links_free']['expected']['tokens_per_s_per_gpu'])}",
         "`estimate.ceilings`"),
    ]
    lines = ["| europa-952b, 384 GH200, long-tail documents | | `--json` key |",
             "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


CLASSES = (  # estimate.by_class keys on the SMs, in the order the step table lists them
    ("grouped_gemm", "the routed experts' grouped GEMMs"),
    ("memory_bound", "memory-bound kernels (fusions, copies, sorts)"),
    ("attention_backward", "flash attention backward"),
    ("dense_gemm", "dense GEMMs"),
    ("attention_forward", "flash attention forward"),
)
OTHERS = (
    ("optimizer_update", "the optimizer update (also on the SMs)"),
    ("infiniband", "InfiniBand collectives"),
    ("nvlink", "NVLink collectives"),
    ("host_copy", "host copies over NVLink-C2C"),
)


def classes_table(plan: dict) -> str:
    """docs/plan.md's table: each class's seconds per step at the low / expected / high end
    of its efficiency range (`estimate.by_class`): the GEMMs, attention and memory-bound
    kernels and their sum (the README's SM time), then the update, the links, the host."""
    by_class = plan["estimate"]["by_class"]

    def row(key: str, label: str) -> str:
        s = by_class[key]["seconds"]
        return f"| {label} | {s['low']:.2f} | **{s['expected']:.2f}** | {s['high']:.2f} |"

    lines = ["| class (`estimate.by_class`), seconds per GPU per step | low | expected | high |",
             "|---|---|---|---|"]
    lines += [row(k, label) for k, label in CLASSES]
    sm = {end: sum(by_class[k]["seconds"][end] for k, _ in CLASSES)
          for end in ("low", "expected", "high")}
    lines.append(f"| GEMMs, attention and memory-bound kernels, one after another | "
                 f"{sm['low']:.2f} | **{sm['expected']:.2f}** | {sm['high']:.2f} |")
    lines += [row(k, label) for k, label in OTHERS]
    return "\n".join(lines)


LINES = (  # estimate.lines: (key, the line, where the step pays it)
    ("tf32_gemms", "float32 GEMMs in TF32", "in dense GEMMs"),
    ("mla_backward_ratio", "MLA's attention backward ratio", "in the attention backward"),
    ("kernel_launches", "kernel launches", "waits on the compute stream"),
    ("loop_trip_syncs", "data-dependent loop trips", "waits on the compute stream"),
    ("in_layer_exchange", "in-layer exchanges", "waits on the compute stream"),
    ("update_exchange", "the optimizer's collectives", "serial phase"),
    ("fill_drain", "the step's first gathers, last reduce-scatters", "serial phase"),
)
WAITS = ("kernel_launches", "loop_trip_syncs", "in_layer_exchange")
SERIAL = ("update_exchange", "fill_drain")


def _amount(line: dict) -> str:
    if "count" in line:
        return f"{line['count']:,.0f}"
    parts = []
    if line.get("covered_nvlink_bytes"):
        parts.append(f"{line['nvlink_bytes'] / 1e9:,.0f} GB NVLink waited for, "
                     f"{line['covered_nvlink_bytes'] / 1e9:,.0f} GB covered by kernels")
    elif "nvlink_bytes" in line:
        parts.append(f"{line['nvlink_bytes'] / 1e9:,.1f} GB NVLink, "
                     f"{line['infiniband_bytes'] / 1e9:,.1f} GB InfiniBand")
    return "; ".join(parts) or "—"


def lines_table(plan: dict) -> str:
    """docs/plan.md's table of the lines the overlap model leaves out (`estimate.lines`):
    each line's amount and seconds, then the waits and serial phases they add up to."""
    lines_ = plan["estimate"]["lines"]
    out = ["| line (`estimate.lines`) | where the step pays it | amount | low | expected | high |",
           "|---|---|---|---|---|---|"]
    for key, label, where in LINES:
        s = lines_[key]["seconds"]
        out.append(f"| {label} | {where} | {_amount(lines_[key])} | {s['low']:.2f} | "
                   f"{s['expected']:.2f} | {s['high']:.2f} |")
    for keys, label in ((WAITS, "waits on the compute stream"), (SERIAL, "serial phases")):
        t = {end: sum(lines_[k]["seconds"][end] for k in keys) for end in ("low", "expected", "high")}
        out.append(f"| {label}, together | | | {t['low']:.2f} | **{t['expected']:.2f}** | "
                   f"{t['high']:.2f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plan_json", nargs="?", default=str(STORED_PLAN),
                        help=f"the output of `{COMMAND}` (default: the stored one)")
    parser.add_argument("--classes", action="store_true",
                        help="docs/plan.md's tables: the step by class of kernel, and the "
                        "lines the overlap model leaves out")
    args = parser.parse_args()
    plan = load(args.plan_json)
    if args.classes:
        print(classes_table(plan) + "\n\n" + lines_table(plan))
    else:
        print(headline_table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
