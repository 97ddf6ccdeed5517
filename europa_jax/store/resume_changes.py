"""What a resume changes: the settings that differ from those the checkpoint was saved
with, one line each before the first step, and the learning rate's move.

The same command with `train.steps` 50 → 80 resumes from step 50 — and the learning-rate
schedule, a function of `train.steps`, is re-shaped under it (at step 50 the rate jumps
from the decay's 5.7e-4 back to the plateau's 3.0e-3). That may be intended (a longer run)
or not; either way the user should see it, with the rate before and after.
"""

from __future__ import annotations

from typing import Any

from europa_jax.config import Config, ConfigError
from europa_jax.config_loader import from_dict, to_dict
from europa_jax.train import optim


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): list(tree) if isinstance(tree, tuple) else tree}


def changed_keys(saved: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every setting that differs, in key order."""
    before, now = _flat(saved), _flat(to_dict(cfg))
    return [(k, before.get(k), now.get(k)) for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k)]


def learning_rates(saved: dict, cfg: Config, step: int) -> tuple[float, float] | None:
    """The learning rate at `step` under the saved settings and the current ones; None
    when the saved settings no longer load (an older version's keys)."""
    try:
        old = from_dict(Config, saved)
    except (ConfigError, TypeError):
        return None
    rate = lambda c: float(optim.schedule(c.optim, c.train.steps)(step))
    return rate(old), rate(cfg)


def describe(saved: dict, cfg: Config, step: int) -> list[str]:
    """The lines to print on resuming at `step`: one per changed setting, then the
    learning rate's move if the schedule moved; none when nothing changed."""
    lines = [f"resuming step {step} with {k} changed since it was saved: {before!r} → {now!r}"
             for k, before, now in changed_keys(saved, cfg)]
    rates = learning_rates(saved, cfg, step) if lines else None
    if rates and abs(rates[0] - rates[1]) > 1e-12 * max(abs(rates[0]), 1e-30):
        lines.append(f"resuming step {step}: the learning rate there moves from "
                     f"{rates[0]:.3g} to {rates[1]:.3g} (the schedule follows optim.* and "
                     "train.steps)")
    return lines
