"""Twin training runs: the same config, data and seeds under two or more settings ("arms"),
each trained by `europa-jax train`, compared on their loss curves and validation losses.
The spread between seeds of one arm is the noise the gap between arms is read against.

    python benchmarks/twin_runs.py --out runs/twins-fp8 --steps 300 --seeds 0 1 \
        --arm bf16 execution.compute_dtype=bfloat16 \
        --arm fp8-blocks execution.compute_dtype=bfloat16 execution.fp8_gemms=block \
        [--config configs/small-cpu.yaml] [--set KEY=VALUE ...] [--plot docs/x.png] \
        [--title TEXT] [--also METRIC ...] [--json OUT]

`train.seed` is what the seeds change (the initial weights); the batches are the same in
every run. A run whose directory already holds its last step is read, not retrained, so
an interrupted comparison continues where it stopped. Prints (and writes to --json) per
run: its validation losses and its mean training loss over the last `--tail` steps; per
arm: their means and the seed-to-seed spread; per arm against the first: the gap and
whether it is outside the spread of both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def read_records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) of a run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return ([r for r in records if "loss" in r and "val_loss" not in r],
            [r for r in records if "val_loss" in r])


def train(run_dir: Path, config: str, sets: list[str], steps: int) -> None:
    train_records, _ = read_records(run_dir)
    if train_records and train_records[-1]["step"] >= steps:
        return
    command = [sys.executable, "-m", "europa_jax.cli", "train", str(REPO / config),
               "--run-dir", str(run_dir), "--quiet"]
    for item in sets + [f"train.steps={steps}"]:
        command += ["--set", item]
    subprocess.run(command, cwd=REPO, check=True)


def summarize(runs: dict[str, dict[int, Path]], tail: int, also: list[str]) -> dict:
    per_run, per_arm = {}, {}
    for arm, by_seed in runs.items():
        finals, tails = [], []
        for seed, run_dir in by_seed.items():
            train_records, val_records = read_records(run_dir)
            tail_loss = statistics.fmean(r["loss"] for r in train_records[-tail:])
            val = {r["step"]: r["val_loss"] for r in val_records}
            per_run[f"{arm}/seed{seed}"] = {
                "tail_train_loss": tail_loss, "val_loss": val,
                "steps": train_records[-1]["step"],
                **{f"tail_{key}": statistics.fmean(r[key] for r in train_records[-tail:])
                   for key in also}}
            tails.append(tail_loss)
            if val:
                finals.append(val[max(val)])
        per_arm[arm] = {"final_val_loss_mean": statistics.fmean(finals) if finals else None,
                        "final_val_loss_spread": (max(finals) - min(finals)) if finals else None,
                        "tail_train_loss_mean": statistics.fmean(tails),
                        "tail_train_loss_spread": max(tails) - min(tails)}
    arms = list(runs)
    gaps = {}
    for arm in arms[1:]:
        a, b = per_arm[arms[0]], per_arm[arm]
        gap = {}
        for field in ("final_val_loss", "tail_train_loss"):
            if a[f"{field}_mean"] is None or b[f"{field}_mean"] is None:
                continue
            diff = b[f"{field}_mean"] - a[f"{field}_mean"]
            spread = max(a[f"{field}_spread"], b[f"{field}_spread"])
            gap[field] = {"gap": diff, "largest_seed_spread": spread,
                          "outside_spread": abs(diff) > spread}
        gaps[f"{arm} - {arms[0]}"] = gap
    return {"runs": per_run, "arms": per_arm, "gaps": gaps}


def plot(runs: dict[str, dict[int, Path]], out: Path, title: str, smooth: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_train, ax_val = fig.subplots(1, 2)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for color, (arm, by_seed) in zip(colors, runs.items()):
        for n, (seed, run_dir) in enumerate(by_seed.items()):
            train_records, val_records = read_records(run_dir)
            losses = [r["loss"] for r in train_records]
            # a trailing mean over `smooth` steps: single steps' noise hides a small gap
            smoothed = [statistics.fmean(losses[max(0, i - smooth + 1):i + 1])
                        for i in range(len(losses))]
            style = dict(color=color, lw=1.2, ls="-" if n == 0 else "--",
                         label=f"{arm}, seed {seed}")
            ax_train.plot([r["step"] for r in train_records], smoothed, **style)
            ax_val.plot([r["step"] for r in val_records], [r["val_loss"] for r in val_records],
                        marker="o", ms=3, **style)
    ax_train.set_title(f"training loss (mean of the last {smooth} steps)")
    ax_val.set_title("validation loss")
    for ax in (ax_train, ax_val):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_train.set_ylim(top=min(ax_train.get_ylim()[1], 3.0))
    ax_val.legend(fontsize=8)
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="a directory for the runs")
    parser.add_argument("--config", default="configs/small-cpu.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--arm", nargs="+", action="append", required=True,
                        metavar=("NAME", "KEY=VALUE"), help="an arm's name and its settings")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every run")
    parser.add_argument("--tail", type=int, default=50,
                        help="training steps averaged at the end of each run")
    parser.add_argument("--also", nargs="*", default=[], metavar="METRIC",
                        help="metrics.jsonl keys whose mean over the last --tail steps each "
                             "run reports (e.g. expert_load_max_over_mean)")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--title", default="")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if len(args.arm) < 2:
        parser.error("give at least two --arm")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    runs: dict[str, dict[int, Path]] = {}
    for name, *sets in args.arm:
        runs[name] = {}
        for seed in args.seeds:
            run_dir = args.out / f"{name}-seed{seed}"
            train(run_dir, args.config, args.set + sets + [f"train.seed={seed}"], args.steps)
            runs[name][seed] = run_dir
    summary = summarize(runs, args.tail, args.also)
    summary["command"] = " ".join(["python", "benchmarks/twin_runs.py", *sys.argv[1:]])
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    if args.plot:
        plot(runs, args.plot, args.title, smooth=args.tail // 2 or 1)


if __name__ == "__main__":
    main()
