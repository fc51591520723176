"""Loader state for exact, elastic resumption: what ``DataLoader.state_dict()`` returns.

NOTE [resume state]: a state is a small JSON-able dict that names a position in the
epoch, never the samples themselves::

    {"version": 1,
     "dataset": "<16 hex digits>",   # the dataset's fingerprint (ShardDataset: its manifest's)
     ["dataset_parts": {name: "<16 hex digits>", ...},]   # only for datasets with fingerprint_parts
     "records": N,                    # samples in the dataset
     "shuffle": bool, "seed": int, "shuffle_mode": "global"|"window", "window": int,
     "partition": "pad"|"drop",       # the loader's OrderSpec: the epoch order and pad/drop rule
     ["window_units": "files",]       # a window shuffle that orders files first (ParquetDataset)
     "epoch": e,                      # the epoch in progress (or the next one)
     "segments": [[world_size, batch_size, steps], ...]}   # how epoch e was consumed

Its size grows only with the number of times the epoch was resumed at another world
size or batch size (consecutive segments with equal (world_size, batch_size) merge).
From the epoch order and the segments, ``pyloader.read.order.resume_partition`` recomputes
which samples are still unread and gives them to the new world size
(NOTE [resume segments]). ``steps`` counts batches the caller *received*: batches the
native threads prefetched but the caller never saw are not consumed, so they are read
again after a resume.

A rank's loader only knows its own count; the state describes the global position
because DDP ranks take the same number of batches per step (every rank's plan has the
same length, NOTE [resume segments]), so any rank's state, e.g. rank 0's, is *the*
state. Check that with ``all_gather_object`` when in doubt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ResumeError

STATE_VERSION = 1
_UNITS = "units"  # window_units of a state without the key: the window shuffle of units alone
_KEYS = ("version", "dataset", "records", "shuffle", "seed", "shuffle_mode", "window", "partition",
         "epoch", "segments")


def make_state(fingerprint: str, records: int, settings: Mapping[str, Any], epoch: int,
               segments: Sequence[Sequence[int]], parts: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The state (NOTE [resume state]) of ``epoch`` consumed as ``segments``.

    ``fingerprint`` and ``records`` name the dataset, ``parts`` (if any) its
    ``fingerprint_parts``; ``settings`` are the order keys (``OrderSpec.settings()``).
    """
    state: dict[str, Any] = {"version": STATE_VERSION, "dataset": fingerprint}
    if parts:
        state["dataset_parts"] = dict(parts)
    state["records"] = records
    state.update(settings)
    state["epoch"] = epoch
    state["segments"] = [list(s) for s in segments]
    return state


def add_segment(segments: Sequence[Sequence[int]], world_size: int, batch_size: int,
                steps: int) -> list[list[int]]:
    """``segments`` followed by one more; merged into the last one when (world, batch) match.

    Merging is exact: at an unchanged world size a resumed segment continues each rank's
    block where it stopped (NOTE [resume segments]). A segment of 0 steps reads nothing
    and is left out.
    """
    out = [list(s) for s in segments]
    if steps == 0:
        return out
    if out and out[-1][0] == world_size and out[-1][1] == batch_size:
        out[-1][2] += steps
    else:
        out.append([world_size, batch_size, steps])
    return out


def _relevant(settings: Mapping[str, Any]) -> list[str]:
    """The settings that change the epoch order or the partition."""
    keys = ["shuffle", "partition"]
    if settings["shuffle"]:
        keys += ["seed", "shuffle_mode"]
        if settings["shuffle_mode"] == "window":
            keys += ["window", "window_units"]
    return keys


def _differing_parts(saved: object, parts: Mapping[str, str] | None) -> str:
    """`` (differing in: a, b)`` when both sides have fingerprint parts and some differ, else ``""``."""
    if not isinstance(saved, Mapping) or not parts:
        return ""
    names = [k for k in parts if saved.get(k) != parts[k]] + [k for k in saved if k not in parts]
    return f" (differing in: {', '.join(names)})" if names else ""


def check_state(state: object, *, fingerprint: str, records: int, settings: Mapping[str, Any],
                parts: Mapping[str, str] | None = None) -> tuple[int, list[list[int]]]:
    """(epoch, segments) of ``state`` if it fits this dataset and order, else ResumeError.

    A state for another dataset names the ``parts`` (the dataset's ``fingerprint_parts``)
    that differ from those the state kept.
    The segments are checked against the dataset later, when the plan is computed
    (``pyloader.read.order.resume_partition`` raises ValueError for steps beyond a segment).
    """
    if not isinstance(state, Mapping):
        raise ResumeError(f"a loader state must be a dict, got {type(state).__name__}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ResumeError(f"not a pyloader loader state: missing {', '.join(missing)}")
    if state["version"] != STATE_VERSION:
        raise ResumeError(f"unsupported loader state version {state['version']!r} (this pyloader "
                          f"reads version {STATE_VERSION})")
    if state["dataset"] != fingerprint or state["records"] != records:
        raise ResumeError(
            f"the state was saved for another dataset (fingerprint {state['dataset']!r}, "
            f"{state['records']!r} records); this one is {fingerprint!r} with {records} records"
            f"{_differing_parts(state.get('dataset_parts'), parts)}. Resume with the same data the state was "
            "taken from (ShardDataset: the same manifest; ParquetDataset: the same files and columns)")
    for key in _relevant(settings):
        # A key a state may lack (window_units: absent in states of a window shuffle by units alone).
        saved, now = state.get(key, _UNITS if key == "window_units" else None), settings.get(key, _UNITS)
        if saved != now:
            raise ResumeError(
                f"the state was saved with {key}={saved!r} but this loader uses {key}={now!r}; "
                "the epoch order would differ, so the consumed samples cannot be recomputed")
    epoch = state["epoch"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ResumeError(f"state epoch must be a non-negative int, got {epoch!r}")
    segs = state["segments"]
    if not isinstance(segs, (list, tuple)):
        raise ResumeError(f"state segments must be a list, got {type(segs).__name__}")
    out: list[list[int]] = []
    for i, s in enumerate(segs):
        ok = (isinstance(s, (list, tuple)) and len(s) == 3
              and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
              and s[0] >= 1 and s[1] >= 1 and s[2] >= 0)
        if not ok:
            raise ResumeError(f"state segment {i} must be [world_size >= 1, batch_size >= 1, steps >= 0], "
                              f"got {s!r}")
        out.append([int(x) for x in s])
    return epoch, out


__all__ = ["STATE_VERSION", "make_state", "add_segment", "check_state"]
