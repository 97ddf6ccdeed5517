"""The report's PNG plots (report.py): one figure per file of `PLOTS`, each None when the
run has none of its data.

matplotlib's `Figure` + Agg canvas directly: no pyplot global state, no display; imported
only when a report draws (the summary and `last_validation` need none of it).
"""

from __future__ import annotations

from typing import Callable

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from europa_jax.records.report import (_config_section, _layer_lines, _layer_name, _line,
                                       _moe_layer_name, _num, _task_scores, _timed,
                                       Panel, Run, TASK_PREFIX)


def _figure(title: str, panels: list[Panel]) -> Figure | None:
    """One panel per entry with data; None when no panel has any."""
    panels = [(ylabel, kept, log) for ylabel, lines, log in panels
              if (kept := [line for line in lines if line[1]])]
    if not panels:
        return None
    fig = Figure(figsize=(8, 1.2 + 2.6 * len(panels)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (ylabel, lines, log) in zip(axes, panels):
        for label, steps, values in lines:
            # A lone point draws no line segment: give it a marker.
            ax.plot(steps, values, label=label, lw=1.2, marker="o" if len(steps) < 3 else None)
        if log and all(v > 0 for _, _, values in lines for v in values):
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if 1 < len(lines) <= 16:  # beyond that a legend hides the plot
            ax.legend(fontsize="small", ncol=min(len(lines), 4))
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    return fig


def _plot_loss(run: Run) -> Figure | None:
    train = _line(run.train, "loss", "train loss")
    val = _line(run.validation, "val_loss", "validation loss")
    fig = _figure("Loss", [("loss", [train if train[1] else val], False),
                           # model.mtp_layers > 0 only: the panel is left out otherwise
                           ("multi-token prediction loss", [_line(run.train, "mtp_loss")],
                            False)])
    if train[1] and val[1]:  # validation is sparse: markers, not a line
        fig.axes[0].plot(val[1], val[2], "o", label=val[0])
        fig.axes[0].legend(fontsize="small")
    return fig


def _plot_experts(run: Run) -> Figure | None:
    moe = _moe_layer_name(run)
    load = (_layer_lines(run.train, "expert_load_max_over_mean_per_layer", moe)
            or [_line(run.train, "expert_load_max_over_mean", "all layers")])
    return _figure("MoE expert load and router bias", [
        ("expert load max/mean", load, False),
        ("router bias spread", _layer_lines(run.train, "router_bias_spread_per_layer", moe),
         False),
        # model.seq_aux_loss_weight > 0 only: the panel is left out otherwise
        ("sequence-wise balance loss", [_line(run.train, "seq_aux_loss")], False)])


def _plot_attention_logits(run: Run) -> Figure | None:
    """The step's largest attention logit per layer (QK-clip's S_max) and heads clipped."""
    per_layer = (_layer_lines(run.train, "attention_logit_max_per_layer",
                              _layer_name(_config_section(run, "model"), 0))
                 or [_line(run.train, "attention_logit_max", "all layers")])
    # without a threshold nothing is clipped: an all-zero panel would only say that
    clipping = (not run.config
                or _config_section(run, "optim").get("qk_clip_threshold") is not None)
    return _figure("Attention max logit (before the step's QK-clip)" if clipping
                   else "Attention max logit (QK-clip off)", [
        ("max logit", per_layer, False),
        ("heads clipped", [_line(run.train, "qk_clip_heads_clipped")] if clipping else [],
         False)])


def _plot_tasks(run: Run) -> Figure | None:
    """One panel per downstream task, a line per metric, over the steps evaluated."""
    metrics: dict[str, list[str]] = {}
    for record in run.tasks:
        for name in _task_scores(record):
            task, _, metric = name.partition("/")
            if metric not in metrics.setdefault(task, []):
                metrics[task].append(metric)
    return _figure("Downstream tasks (train.eval_tasks)", [
        (task if len(names) > 1 else f"{task}\n{names[0]}",
         [_line(run.tasks, f"{TASK_PREFIX}{task}/{m}", m) for m in names], False)
        for task, names in metrics.items()])


PLOTS: dict[str, Callable[[Run], Figure | None]] = {
    "loss.png": _plot_loss,
    "lr.png": lambda run: _figure("Learning rate", [("lr", [_line(run.train, "lr")], False)]),
    "grad_norm.png": lambda run: _figure(
        "Gradient norm", [("grad norm", [_line(run.train, "grad_norm")], True)]),
    "throughput.png": lambda run: _figure("Throughput (compiled steps excluded)", [
        ("tokens/s/device", [_line(_timed(run), "tokens_per_s_per_device")], False),
        # in percent, as the summary gives it
        ("MFU (%)", [_line(_timed(run), "mfu", "MFU",
                           lambda r: 100 * r["mfu"] if _num(r.get("mfu")) is not None
                           else None)], False)]),
    "experts.png": _plot_experts,
    "attention_logits.png": _plot_attention_logits,
    "attention_balance.png": lambda run: _figure("Attention cost balance", [
        ("attention cost max/mean", [
            _line(run.train, "attention_cost_max_over_mean", "per rank"),
            _line(run.train, "node_attention_cost_max_over_mean", "per node")], False)]),
    "eval_tasks.png": _plot_tasks,
}
