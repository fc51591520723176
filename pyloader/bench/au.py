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
# above the threshold, with the range its trials leave open, and says when it is only a
# lower bound. It doubles N from 1 while AU holds, then bisects between the last count that
# held and the first that did not. One trial's AU moves by several percent with the load
# of the moment (the run: 133 -> 97.0%, 134 -> 80.9%, 144 -> 86.1%), so a single
# boundary would move from run to run: the counts around it (``REFINE`` of the last count
# that held and of the first that failed) are then measured ``repeats`` times each,
# round-robin, and each count's AU is the median of its trials. Before that, while
# doubling and bisecting, a count that failed or held by less than ``CONFIRM`` is measured
# again up to ``repeats`` times, so that one trial that dipped does not end the doubling. Near the boundary AU falls
# about linearly with the count, so a line is fitted through every trial there: where it
# crosses the threshold (``crossing``) is the estimate, ``max_accelerators`` its floor (kept
# between the largest count up to which every trial held and the largest at which some
# trial held), and ``range`` the crossing +- 2 standard errors of it (95%), within the
# counts measured; without a falling line the maximum is the largest count whose median
# holds below the smallest whose median fails, and the range reaches from it to the largest
# count whose median held.
# ``fails_at`` is the smallest count above the maximum whose median failed. Another run
# under the same load is expected to land inside the range; load that changes between runs
# (other jobs on the machine) moves the maximum by more than one run's trials can show. Only the measurement should end the
# search, so it goes on past any round number while AU holds; it stops short at ``cap``
# (--max-accelerators or AU_CEILING) or when its time budget is spent: a trial starts only
# when the time spent so far plus the last trial's time fits in the budget (the repeated
# trials too: cut short, the range rests on fewer). A search that stopped short is
# ``capped`` (a lower bound, printed "at least N") and ``stopped_by`` says why.
REFINE = (0.9, 0.95, 1.0, 1.05, 1.1)
# A count whose AU is below the threshold plus this is measured again (up to ``repeats``
# trials) before the doubling or bisection turns on it.
CONFIRM = 0.05
AU_REPEATS = 3


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    k = len(ys) // 2
    return ys[k] if len(ys) % 2 else (ys[k - 1] + ys[k]) / 2


def max_accelerators(measure: Callable[[int], dict[str, float]], *, threshold: float, cap: int,
                     budget_s: float = AU_BUDGET_S, progress: Callable[[str], None], label: str,
                     clock: Callable[[], float] = time.perf_counter, repeats: int = AU_REPEATS) -> dict[str, Any]:
    """Largest accelerator count with AU >= ``threshold``, by ``measure(n)`` (See NOTE [AU search]).

    ``measure(n)`` runs ``n`` simulated accelerators and returns at least ``{"au": ...}``.
    Returns ``max_accelerators``, ``range`` ([low, high], 95%), ``crossing`` (with a fitted
    line), ``repeats``,
    ``capped`` (a lower bound), ``stopped_by`` (None, "cap" or "time"), ``fails_at``,
    ``threshold``, ``cap``, ``budget_s`` and the ``trials`` in order of count, each with its
    median ``au``, every trial's AU (``au_trials``) and their summed ``trial_s``.
    """
    trials: dict[int, dict[str, Any]] = {}
    start = clock()
    last_s = 0.0

    def affordable() -> bool:
        return not trials or clock() - start + last_s <= budget_s

    def run(n: int) -> None:
        nonlocal last_s
        t0 = clock()
        got = measure(n)
        last_s = clock() - t0
        t = trials.setdefault(n, {**got, "accelerators": n, "au_trials": [], "trial_s": 0.0})
        t["au_trials"].append(float(got["au"]))
        t["trial_s"] += last_s
        t["au"] = _median(t["au_trials"])
        progress(f"{label}: {n} accelerators -> AU {100 * got['au']:.1f}%"
                 + (f" (trial {len(t['au_trials'])}, median {100 * t['au']:.1f}%)" if len(t["au_trials"]) > 1 else ""))

    def holds(n: int) -> bool:
        if n not in trials:
            run(n)
        # A count that failed, or held by less than CONFIRM, is measured again before the
        # search turns on it: one trial dipped 15% below its neighbours on a loaded machine.
        while len(trials[n]["au_trials"]) < repeats and trials[n]["au"] < threshold + CONFIRM and affordable():
            run(n)
        return bool(trials[n]["au"] >= threshold)

    good, bad, stopped_by = 0, None, None
    around: list[int] = []
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
        if stopped_by is None:
            around = _around(good, bad, cap)
            _refine(trials, around, repeats, run, affordable)
    return {**_verdict(trials, threshold, around), "capped": stopped_by is not None, "stopped_by": stopped_by,
            "threshold": threshold, "cap": cap, "budget_s": budget_s, "repeats": repeats,
            "trials": [trials[k] for k in sorted(trials)]}


def _around(good: int, bad: int, cap: int) -> list[int]:
    """The counts measured again near the boundary: ``REFINE`` of the last count that held and the first that failed."""
    return sorted({min(cap, max(1, round(base * f))) for base in (good, bad) for f in REFINE} - {0})


def _refine(trials: dict[int, dict[str, Any]], around: list[int], repeats: int, run: Callable[[int], None],
            affordable: Callable[[], bool]) -> None:
    """Trials round-robin at the counts ``around`` the boundary until each has ``repeats`` or the budget is spent."""
    for _ in range(repeats):
        for n in around:
            if len(trials.get(n, {}).get("au_trials", ())) < repeats:
                if not affordable():
                    return
                run(n)


def _verdict(trials: dict[int, dict[str, Any]], threshold: float, around: list[int]) -> dict[str, Any]:
    """``max_accelerators``, ``fails_at`` and ``range`` from each count's trials (See NOTE [AU search])."""
    counts = sorted(trials)
    failing = [n for n in counts if trials[n]["au"] < threshold]
    fails_at = failing[0] if failing else None
    held = [n for n in counts if trials[n]["au"] >= threshold and (fails_at is None or n < fails_at)]
    best = held[-1] if held else 0
    # What the trials alone settle: every trial held up to ``sure``; some held up to ``maybe``.
    sure = 0
    for n in counts:
        if min(trials[n]["au_trials"]) < threshold:
            break
        sure = n
    none_held = [n for n in counts if max(trials[n]["au_trials"]) < threshold]
    maybe = max([n for n in counts if max(trials[n]["au_trials"]) >= threshold
                 and (not none_held or n < none_held[0])] or [0])
    fit = _crossing(trials, threshold, around)
    if fit is None:  # the medians alone: from the maximum to the largest count whose median held
        last = max([n for n in counts if trials[n]["au"] >= threshold] or [0])
        return {"max_accelerators": best, "fails_at": fails_at, "range": [best, max(last, best)]}
    cross, se = fit
    best = min(max(math.floor(cross), sure), maybe)
    above = [n for n in failing if n > best]
    fails_at = above[0] if above else None
    lo = max(around[0], math.floor(cross - 2 * se))
    hi = min(around[-1], math.ceil(cross + 2 * se))
    return {"max_accelerators": best, "fails_at": fails_at, "range": [min(lo, best), max(hi, best)],
            "crossing": round(cross, 1)}


def _crossing(trials: dict[int, dict[str, Any]], threshold: float,
              around: list[int]) -> tuple[float, float] | None:
    """Where AU crosses the threshold and its standard error, from a line through every trial ``around`` it.

    Over the counts near the boundary AU falls about linearly with the count; the standard
    error comes from the trials' scatter about the line. None without a falling line that
    crosses the threshold within the counts ``around`` (too few trials, noise larger than
    the trend).
    """
    if not around:
        return None
    pts = [(float(n), au) for n in trials if around[0] <= n <= around[-1] for au in trials[n]["au_trials"]]
    k = len(pts)
    if k < 4:
        return None
    mean_n, mean_y = sum(x for x, _ in pts) / k, sum(y for _, y in pts) / k
    sxx = sum((x - mean_n) ** 2 for x, _ in pts)
    slope = sum((x - mean_n) * (y - mean_y) for x, y in pts) / sxx if sxx > 0 else 0.0
    if slope >= 0:
        return None
    icpt = mean_y - slope * mean_n
    resid = math.sqrt(sum((y - icpt - slope * x) ** 2 for x, y in pts) / (k - 2))
    cross = (threshold - icpt) / slope
    if not around[0] <= cross <= around[-1]:
        return None  # a line too flat for the noise about it: it crosses outside the counts measured
    return cross, resid * math.sqrt(1 / k + (cross - mean_n) ** 2 / sxx) / -slope


__all__ = ["AU_BUDGET_S", "AU_CEILING", "AU_REPEATS", "CONFIRM", "REFINE", "WORKLOADS", "Workload", "au_batches",
           "max_accelerators"]
