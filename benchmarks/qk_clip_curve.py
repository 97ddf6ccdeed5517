"""The README's QK-clip figure: the same deliberately unstable tiny run with and without
MuonClip's QK-clip, trained by `europa-jax train`, its max-logit curves plotted.

    python benchmarks/qk_clip_curve.py [--lr 0.05] [--tau 20] [--steps 100] \
        [--out docs/qk-clip.png] [--json OUT]

The run is the README default (configs/tiny-cpu.yaml on 8 CPU devices) at a learning rate
many times its own with no warm-up, so that Muon's updates grow the attention logits.
Prints, as JSON, each run's max logit per logged step, the heads clipped and the losses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train(run_dir: Path, args, threshold: float | None) -> list[dict]:
    """Train one run through the CLI; its per-step records of metrics.jsonl."""
    sets = {"optim.learning_rate": args.lr, "optim.warmup_steps": 0,
            "optim.qk_clip_threshold": "null" if threshold is None else threshold,
            "train.steps": args.steps, "train.log_every": 1, "train.eval_every": 0,
            "checkpoint.every_steps": 0, "train.profile_steps": "[]"}
    command = [sys.executable, "-m", "europa_jax.cli", "train", str(REPO / args.config),
               "--run-dir", str(run_dir), "--quiet"]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    subprocess.run(command, cwd=REPO, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "attention_logit_max" in r]


def plot(runs: dict[str, list[dict]], tau: float, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, records in runs.items():
        ax.plot([r["step"] for r in records], [r["attention_logit_max"] for r in records],
                label=name, lw=1.4)
    ax.axhline(tau, color="grey", ls="--", lw=1, label=f"τ = {tau:g}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("max attention logit of the step")
    ax.set_title("tiny-cpu, Muon at a learning rate far above its own")
    ax.grid(alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--tau", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="docs/qk-clip.png")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: train(Path(tmp) / name, args, threshold)
                for name, threshold in (("without QK-clip", None),
                                        (f"with QK-clip (τ = {args.tau:g})", args.tau))}
    plot(runs, args.tau, REPO / args.out)
    results = {"config": args.config, "learning_rate": args.lr, "tau": args.tau,
               "steps": args.steps, "runs": {}}
    for name, records in runs.items():
        logit_max = [r["attention_logit_max"] for r in records]
        results["runs"][name] = {
            "max_logit_per_step": [round(v, 2) for v in logit_max],
            "heads_clipped_per_step": [int(r["qk_clip_heads_clipped"]) for r in records],
            "max_logit_last": logit_max[-1], "max_logit_max": max(logit_max),
            "loss_last_10_mean": sum(r["loss"] for r in records[-10:]) / len(records[-10:]),
            "all_finite": all(r.get("finite", 1.0) == 1.0 for r in records)}
    text = json.dumps(results, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
