"""Accelerator utilization: the workloads and the search for the largest count a loader keeps busy.

Nothing here imports torch (``pyloader bench --help`` lists the workloads without it); the
measurement of one accelerator count, with real loaders, is ``stages.run_au``'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """A simulated accelerator workload (MLPerf Storage H100 presets, scaled-down datasets)."""

    name: str
    record_bytes: int
    batch_size: int
    compute_s: float
    records: int  # scaled-down dataset size used here


WORKLOADS: dict[str, Workload] = {
    "resnet50": Workload("resnet50", 114_700, 64, 0.103, 4096),
    "unet3d": Workload("unet3d", 146_600_000, 7, 0.323, 21),
    "cosmoflow": Workload("cosmoflow", 2_800_000, 1, 0.0035, 256),
}

# The most accelerators a search tries without --max-accelerators: each is a thread with a
# loader of its own (and torch's its worker processes), so some ceiling is needed; the
# time budget and the memory cap usually stop the search well before it.
AU_CEILING = 1024
# Seconds of trials per loader before the search stops going further (--au-budget).
AU_BUDGET_S = 60.0


def au_batches(w: Workload, seconds: float) -> int:
    """Batches per AU trial: enough for ``seconds`` of simulated compute, and at least 4."""
    return max(4, math.ceil(seconds / w.compute_s))


# NOTE [AU search]: the search reports the largest accelerator count whose AU stays at or
# above the threshold, and says when it is only a lower bound. It doubles N from 1 while AU
# holds, then bisects between the last count that held and the first that did not. Only
# the measurement should end it, so it goes on past any round number while AU holds; it
# stops short at ``cap`` (--max-accelerators, what fits in memory, or AU_CEILING) or when
# its time budget is spent: a trial starts only when the time spent so far plus the last
# trial's time fits in the budget. A search that stopped short is ``capped`` (a lower
# bound, printed "at least N"), ``stopped_by`` says why, and ``fails_at`` is the smallest
# count measured below the threshold, if any (the maximum lies below it).
def max_accelerators(measure: Callable[[int], dict[str, float]], *, threshold: float, cap: int,
                     budget_s: float = AU_BUDGET_S, progress: Callable[[str], None], label: str,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Largest accelerator count with AU >= ``threshold``, by ``measure(n)`` (See NOTE [AU search]).

    ``measure(n)`` runs ``n`` simulated accelerators and returns at least ``{"au": ...}``.
    Returns ``max_accelerators``, ``capped`` (a lower bound), ``stopped_by`` (None, "cap"
    or "time"), ``fails_at``, ``threshold``, ``cap``, ``budget_s`` and the ``trials`` in
    order of count, each with its ``trial_s``.
    """
    trials: dict[int, dict[str, float]] = {}
    start = clock()
    last_s = 0.0

    def affordable() -> bool:
        return not trials or clock() - start + last_s <= budget_s

    def holds(n: int) -> bool:
        nonlocal last_s
        if n not in trials:
            t0 = clock()
            trials[n] = {**measure(n), "accelerators": n}
            last_s = clock() - t0
            trials[n]["trial_s"] = last_s
            progress(f"{label}: {n} accelerators -> AU {100 * trials[n]['au']:.1f}%")
        return trials[n]["au"] >= threshold

    good, bad, stopped_by = 0, None, None
    n = 1
    while bad is None:  # doubling, then the cap itself
        if good >= cap:
            stopped_by = "cap"
            break
        if not affordable():
            stopped_by = "time"
            break
        n = min(max(1, 2 * good), cap)
        if holds(n):
            good = n
        else:
            bad = n
    if bad is not None:
        lo, hi = good, bad
        while hi - lo > 1:
            if not affordable():
                stopped_by = "time"
                break
            mid = (lo + hi) // 2
            if holds(mid):
                lo = mid
            else:
                hi = mid
        good, bad = lo, hi
    return {"max_accelerators": good, "capped": stopped_by is not None, "stopped_by": stopped_by,
            "fails_at": bad, "threshold": threshold, "cap": cap, "budget_s": budget_s,
            "trials": [trials[k] for k in sorted(trials)]}


__all__ = ["AU_BUDGET_S", "AU_CEILING", "WORKLOADS", "Workload", "au_batches", "max_accelerators"]
