"""Stragglers: which process makes the others wait, measured without a sync of its own.

Every step ends at the same instant on every process (the step's collectives and the
loop's fetch of its metrics), so each process's step time, taken alone, is the same on all
of them. What differs is how long each took to be ready for the step: from the end of
the previous step (the moment the processes last agreed) to its step dispatched — its
batch drawn and copied to its devices, its host work — and how long its devices then
took, which for the last process to join is their own work and for the others includes
waiting for it. So a process's **own time** for the step is

    own = its host time + the job's shortest device time (the last to join's device work)

and the straggler is the process with the largest, named with its node and its lag over
the median (the lower middle value, so that of two processes the faster is the yardstick).
The timings ride on the per-step gather the loop already does for stop requests
(preemption.py): no collective is added, and the step's program is unchanged.

A GPU slower in its own kernels stretches every process's device time alike and is not
told apart here; a profile of every process (train.profile_steps with
train.profile_all_processes) shows it.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepTimes:
    """One step's timings of every process (seconds), in process order."""

    host_s: np.ndarray  # end of the previous step → this step dispatched
    device_s: np.ndarray  # dispatched → its metrics on the host

    @property
    def own_s(self) -> np.ndarray:
        return self.host_s + float(self.device_s.min())

    def summary(self, nodes: dict[int, str]) -> dict:
        """Fields of the step's metrics record."""
        own = self.own_s
        slowest = int(own.argmax())
        median = float(statistics.median_low(own.tolist()))
        return {"own_time_s_median": median, "slowest_process": slowest,
                "slowest_node": nodes.get(slowest, str(slowest)),
                "slowest_own_time_s": float(own[slowest]),
                "slowest_lag_s": float(own[slowest]) - median}


def line(summary: dict) -> str:
    """The log line's words for it."""
    return (f"slowest p{summary['slowest_process']} ({summary['slowest_node']}) "
            f"+{summary['slowest_lag_s']:.3f} s over median")


class StragglerMonitor:
    """Counts, per process, logged steps in a row with own time above factor × median; at
    `steps` in a row, one `straggler` event (again only after the process recovers)."""

    def __init__(self, factor: float, steps: int, nodes: dict[int, str], events=None):
        self.factor, self.steps, self.nodes, self.events = factor, steps, nodes, events
        self.streak: dict[int, int] = {}

    def check(self, step: int, times: StepTimes) -> list[int]:
        """The processes reported as stragglers at this step (an event each)."""
        own = times.own_s
        median = float(statistics.median_low(own.tolist()))
        reported = []
        for p, seconds in enumerate(own.tolist()):
            slow = median > 0 and seconds > self.factor * median
            self.streak[p] = self.streak.get(p, 0) + 1 if slow else 0
            if slow and self.streak[p] == self.steps:
                reported.append(p)
                node = self.nodes.get(p, str(p))
                if self.events is not None:
                    self.events("straggler", f"straggler: process {p} on {node} took "
                                f"{seconds:.3f} s of its own per step, {seconds / median:.2f}"
                                f" × the median {median:.3f} s, {self.steps} logged steps in "
                                f"a row (train.straggler_factor={self.factor})",
                                level=logging.WARNING, step=step, process=p, node=node,
                                own_time_s=seconds, median_s=median,
                                host_time_s=float(times.host_s[p]), logged_steps=self.steps)
        return reported
