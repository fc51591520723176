"""Sequence packing: documents of a token field concatenated into rows of ``seq_len`` tokens.

``DataLoader(dataset, batch_size=B, pack=PackSpec(seq_len=4096))`` yields batches of ``B``
packed rows. The rows are made on a native thread (``_C.Packer``, NOTE [packing rule] in
csrc/core/packer.h) from the documents the dataset's native pipeline reads in plan order;
Python only plans which documents (and which token ranges of them) the packer reads.

NOTE [packing resume]: packed rows are a pure function of the sequence of documents a rank
reads and their lengths, so resuming needs only where the packer stood: its *cursor* (the
document it splits next and the token it resumes at) and its *window* (the pieces of
documents taken but not yet placed) after the last batch the caller received
(NOTE [packing state]). A state keeps, per epoch, a list of *phases*; phase 0 is the
epoch's order at its world size ``W0`` (each rank's ``epoch_plan``). Each phase's entry for
rank ``r`` is that packer state, in positions of the rank's *base* sequence (the items it
was to read in that phase):

* resuming at the same world size continues each rank's packer exactly: the window's
  pieces, then the cursor's document from its token, then the rest of the base sequence
  (the same rows, bit for bit, as the uninterrupted run);
* resuming at another world size needs every rank's entry of the last phase
  (``state_dict()`` gathers them under torch.distributed; ``merge_states`` combines
  states saved per rank). What no rank consumed -- each rank's window pieces, its cursor
  document's remaining tokens, and its unread base items -- is interleaved rank by rank
  (item ``j`` of rank ``r`` at key ``(j, r)``) and dealt to the new ranks by stride: a new
  phase. Every token not yet delivered is then delivered once, and none twice.

A rank that received its epoch's last batch has a ``done`` entry (nothing left to read);
once every rank's entry is done, the state names the next epoch. A state's rank entries are small (at most ``lookahead`` pieces), and a phase's base
sequence is recomputed from the epoch order and the phases before it, never stored.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..contract import check_int
from ..errors import LoaderStateError, LoaderTimeoutError
from ..format.spec import Field
from .state import ResumeError

PACK_MODES = ("greedy", "first_fit")
_DEFAULT_LOOKAHEAD = 64
_STATES_BEHIND = 1  # packing states kept before the caller's count (NOTE [batches Lightning holds])
_INT_DTYPES = {"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"}


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """How a loader packs documents into rows (NOTE [packing rule] in csrc/core/packer.h).

    Args:
        seq_len: tokens per row.
        field: the token field (a variable-length field of one integer per token);
            default: the dataset's only such field.
        mode: ``"first_fit"`` (the default: it wastes least) places, after the oldest
            waiting piece, the first of the next ``lookahead`` pieces that fits;
            ``"greedy"`` packs in plan order (a row closes at the first piece that does not
            fit). Both are deterministic and resume exactly, at the same or another world
            size; on log-normal document lengths greedy leaves several times the padding
            (docs/llm-pretraining.md). Greedy keeps the plan's document order in the rows.
        lookahead: the first-fit window in pieces (default 64; greedy: 1).
        split: documents longer than ``seq_len`` are cut into pieces of ``seq_len`` tokens
            from their start, each its own document for attention (True), or keep only
            their first ``seq_len`` tokens (False; the rest is counted as truncated).
        pad_id: the token value of padding.
        doc_batch: documents the native pipeline collates per batch for the packer.
    """

    seq_len: int
    field: str | None = None
    mode: str = "first_fit"
    lookahead: int | None = None
    split: bool = True
    pad_id: int = 0
    doc_batch: int = 256

    def __post_init__(self) -> None:
        def rule(name: str) -> None:  # See NOTE [one rule per setting]
            try:
                object.__setattr__(self, name, check_int(name, getattr(self, name)))
            except ValueError as e:
                raise ValueError(f"PackSpec {e}") from None

        rule("seq_len")
        rule("doc_batch")
        if self.mode not in PACK_MODES:
            raise ValueError(f"PackSpec mode must be one of {PACK_MODES}, got {self.mode!r}")
        if self.lookahead is not None:
            rule("lookahead")
            if self.mode == "greedy" and self.lookahead != 1:
                raise ValueError("PackSpec lookahead is the first-fit window; mode='greedy' packs in plan order "
                                 "(lookahead 1): use mode='first_fit'")
        if not isinstance(self.split, (bool, np.bool_)):
            raise ValueError(f"PackSpec split must be True or False, got {self.split!r}")
        object.__setattr__(self, "split", bool(self.split))
        rule("pad_id")
        if self.field is not None and not isinstance(self.field, str):
            raise ValueError(f"PackSpec field must be a field name, got {self.field!r}")

    @property
    def window(self) -> int:
        """The packer's window in pieces (1: greedy)."""
        if self.mode == "greedy":
            return 1
        return _DEFAULT_LOOKAHEAD if self.lookahead is None else self.lookahead

    def settings(self, field: str) -> dict[str, Any]:
        """What the rows depend on (kept in a state, checked when it is loaded); ``field``: the token field used."""
        return {"seq_len": self.seq_len, "field": field, "lookahead": self.window, "split": self.split}

    def resolve_field(self, fields: Sequence[Field]) -> int:
        """The index of the token field among ``fields``; ValueError naming the candidates."""
        def token_field(f: Field) -> bool:
            return f.variable and len(f.shape) == 1 and f.dtype in _INT_DTYPES

        if self.field is None:
            cands = [i for i, f in enumerate(fields) if token_field(f)]
            if len(cands) != 1:
                names = [fields[i].name for i in cands]
                raise ValueError(f"packing needs a token field (variable length, one integer per token): the dataset "
                                 f"has {len(cands)} ({names}); name one with PackSpec(field=...)")
            idx = cands[0]
        else:
            names = [f.name for f in fields]
            if self.field not in names:
                raise ValueError(f"PackSpec field {self.field!r} is not a field of the dataset ({names})")
            idx = names.index(self.field)
            if not token_field(fields[idx]):
                f = fields[idx]
                raise ValueError(f"PackSpec field {f.name!r} ({f.dtype}, shape {list(f.shape)}) is not a token field: "
                                 "packing needs a variable-length field of one integer per token")
        dt = np.dtype(fields[idx].dtype)
        info = np.iinfo(dt)
        if not info.min <= self.pad_id <= info.max:
            raise ValueError(f"PackSpec pad_id={self.pad_id} does not fit the token field's {dt.name}")
        return idx


# -- plans: which items a rank's packer reads (NOTE [packing resume]) ------------------------

@dataclasses.dataclass
class Items:
    """A packer's input: documents (unit, record) with token ranges [start, end) (end -1: to the end).

    ``pos``: each item's position in its phase's base sequence (what a state names).
    """

    units: np.ndarray
    records: np.ndarray
    start: np.ndarray
    end: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return len(self.units)

    @staticmethod
    def base(units: np.ndarray, records: np.ndarray, start: np.ndarray | None = None,
             end: np.ndarray | None = None) -> Items:
        """Items numbered 0..n-1 (a base sequence): whole documents unless ``start``/``end`` say otherwise."""
        n = len(units)
        return Items(np.ascontiguousarray(units, dtype=np.int32), np.ascontiguousarray(records, dtype=np.int64),
                     np.zeros(n, np.int64) if start is None else np.asarray(start, np.int64),
                     np.full(n, -1, np.int64) if end is None else np.asarray(end, np.int64),
                     np.arange(n, dtype=np.int64))


PlanFn = Callable[[int, int], tuple[np.ndarray, np.ndarray]]
"""(rank, world) -> that rank's plan (units, records) of the epoch, from its start."""


def _rank_entry(phase: Mapping[str, Any], rank: int) -> Mapping[str, Any] | None:
    entry = phase["ranks"].get(str(rank))
    return entry if isinstance(entry, Mapping) else None


def _unread(base: Items, entry: Mapping[str, Any] | None) -> Items:
    """What a rank with base sequence ``base`` has not consumed, per its state entry (None: nothing consumed).

    Window pieces first, then the cursor item from its token, then the items after it; ``pos``
    stays the base position.
    """
    if entry is None:
        return base
    n = len(base)
    if entry.get("done"):  # the rank read its whole epoch (with drop_last, its last rows were dropped)
        return Items.base(base.units[:0], base.records[:0])
    win = np.asarray(entry["window"], dtype=np.int64).reshape(-1, 3)
    cpos, ctok = (int(x) for x in entry["cursor"])
    if cpos == -1:
        cpos = n
    if (win.size and (win[:, 0].min() < 0 or win[:, 0].max() >= n)) or not 0 <= cpos <= n:
        raise ResumeError(f"inconsistent packing state: positions outside the rank's {n} items ({entry!r})")
    if ctok < 0 or (win.size and (win[:, 1].min() < 0 or win[:, 2].min() < 1)):
        raise ResumeError(f"inconsistent packing state: negative token offsets or empty pieces ({entry!r})")
    p = win[:, 0]
    parts = [Items(base.units[p], base.records[p], win[:, 1], win[:, 1] + win[:, 2], p)]
    if cpos < n:
        rest = np.arange(cpos, n)
        start = base.start[rest].copy()
        start[0] = ctok
        parts.append(Items(base.units[rest], base.records[rest], start, base.end[rest], rest))
    return Items(*(np.concatenate([getattr(x, k) for x in parts]) for k in ("units", "records", "start", "end",
                                                                              "pos")))


def _deal(unread: list[Items], world: int, rank: int) -> Items:
    """Rank ``rank`` of ``world``'s share of the ranks' unread items: interleaved rank by rank, dealt by stride."""
    j = np.concatenate([np.arange(len(u)) for u in unread]) if unread else np.zeros(0, np.int64)
    r = np.concatenate([np.full(len(u), i) for i, u in enumerate(unread)]) if unread else np.zeros(0, np.int64)
    order = np.lexsort((r, j))[rank::world]
    cat = {k: np.concatenate([getattr(u, k) for u in unread]) for k in ("units", "records", "start", "end")}
    return Items.base(cat["units"][order], cat["records"][order], cat["start"][order], cat["end"][order])


class PhasePlans:
    """The base sequences of a packed epoch's phases (NOTE [packing resume]), computed on demand."""

    def __init__(self, plan: PlanFn, phases: Sequence[Mapping[str, Any]]) -> None:
        self._plan = plan
        self._phases = phases
        self._memo: dict[tuple[int, int], Items] = {}

    def base(self, k: int, rank: int) -> Items:
        """The base sequence of ``rank`` in phase ``k``."""
        key = (k, rank)
        if key not in self._memo:
            if k == 0:
                units, records = self._plan(rank, int(self._phases[0]["world"]))
                self._memo[key] = Items.base(units, records)
            else:
                prev = self._phases[k - 1]
                w = int(prev["world"])
                missing = [r for r in range(w) if _rank_entry(prev, r) is None]
                if missing:
                    raise ResumeError(f"packing phase {k - 1} (world size {w}) lacks the state of ranks {missing}")
                unread = [_unread(self.base(k - 1, r), _rank_entry(prev, r)) for r in range(w)]
                self._memo[key] = _deal(unread, int(self._phases[k]["world"]), rank)
        return self._memo[key]

    def resume_items(self, rank: int, world: int) -> tuple[list[dict[str, Any]], Items, int]:
        """(phases to continue, this rank's packer input, rows made before) for a loader of ``world`` ranks."""
        phases = [dict(p) for p in self._phases]
        if not phases:
            phases = [{"world": world, "ranks": {}}]
            return phases, PhasePlans(self._plan, phases).base(0, rank), 0
        last = phases[-1]
        if int(last["world"]) == world:
            entry = _rank_entry(last, rank)
            items = _unread(self.base(len(phases) - 1, rank), entry)
            return phases, items, int(entry["rows"]) if entry is not None else 0
        w = int(last["world"])
        missing = [r for r in range(w) if _rank_entry(last, r) is None]
        if missing:
            raise ResumeError(
                f"resuming a packed epoch at world size {world} needs the packing state of every rank of the "
                f"{w} it was saved at; ranks {missing} are missing (call state_dict() on every rank under "
                f"torch.distributed, or combine the ranks' states with pyloader.merge_states)")
        phases.append({"world": world, "ranks": {}})
        return phases, PhasePlans(self._plan, phases).base(len(phases) - 1, rank), 0


def check_packing(state: Mapping[str, Any], spec: PackSpec, field: str) -> list[dict[str, Any]]:
    """The phases of a state's ``"packing"`` entry, checked against ``spec`` over token field ``field``.

    ResumeError if they do not fit.
    """
    pk = state.get("packing")
    if not isinstance(pk, Mapping):
        raise ResumeError("the state was saved by a loader without packing; this loader packs (pack=PackSpec): "
                          "the rows would differ")
    if pk.get("spec") != spec.settings(field):
        raise ResumeError(f"the state was saved with packing {pk.get('spec')!r}, this loader packs with "
                          f"{spec.settings(field)!r}: the rows would differ")
    phases = pk.get("phases")
    if not isinstance(phases, list):
        raise ResumeError("packing state phases must be a list")
    out = []
    for i, ph in enumerate(phases):
        ok = isinstance(ph, Mapping) and isinstance(ph.get("world"), int) and ph["world"] >= 1 \
            and isinstance(ph.get("ranks"), Mapping)
        if ok:
            for r, e in ph["ranks"].items():
                ok = ok and str(r).isdigit() and int(r) < ph["world"] and isinstance(e, Mapping) \
                    and isinstance(e.get("cursor"), (list, tuple)) and len(e["cursor"]) == 2 \
                    and isinstance(e.get("window"), (list, tuple)) and isinstance(e.get("rows"), int) \
                    and all(isinstance(w, (list, tuple)) and len(w) == 3 for w in e["window"]) \
                    and isinstance(e.get("done", False), bool)
        if not ok:
            raise ResumeError(f"packing state phase {i} is malformed: {ph!r}")
        out.append({"world": ph["world"], "ranks": {str(r): e for r, e in ph["ranks"].items()}})
    return out


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One loader state from the states of a packed loader's ranks (NOTE [packing resume]).

    Each rank's ``state_dict()`` holds its own packing entry; resuming at another world size
    needs them all. The states must agree on everything else (ValueError otherwise).
    """
    if not states:
        raise ValueError("merge_states needs at least one state")
    first = dict(states[0])
    base = {k: v for k, v in first.items() if k != "packing"}
    merged = {k: v for k, v in first.items()}
    pk = first.get("packing")
    if not isinstance(pk, Mapping):
        raise ValueError("merge_states combines states of packed loaders (pack=PackSpec)")
    phases = [{"world": p["world"], "ranks": dict(p["ranks"])} for p in pk["phases"]]
    for s in states[1:]:
        other = {k: v for k, v in s.items() if k != "packing"}
        if other != base:
            diff = sorted(k for k in set(other) | set(base) if other.get(k) != base.get(k))
            raise ValueError(f"the states differ in {diff}: they are not states of one loader's ranks at one step")
        opk = s.get("packing")
        if not isinstance(opk, Mapping) or opk.get("spec") != pk["spec"] or len(opk["phases"]) != len(phases):
            raise ValueError("the states' packing settings or phases differ")
        for mine, theirs in zip(phases, opk["phases"], strict=True):
            if mine["world"] != theirs["world"]:
                raise ValueError("the states' packing phases differ in world size")
            for r, e in theirs["ranks"].items():
                if r in mine["ranks"] and mine["ranks"][r] != e:
                    raise ValueError(f"two states hold different packing states for rank {r}")
                mine["ranks"][r] = e
    merged["packing"] = {"spec": pk["spec"], "phases": phases}
    last = phases[-1] if phases else None
    if last is not None and len(last["ranks"]) == last["world"] and all(e.get("done") for e in last["ranks"].values()):
        merged["epoch"] = first["epoch"] + 1  # every rank read its whole epoch: the next one starts
        merged["packing"]["phases"] = []
    return merged


# -- the packed stream ---------------------------------------------------------------------

def _entry(cursor_pos: int, cursor_tok: int, window: np.ndarray, rows: int) -> dict[str, Any]:
    return {"cursor": [int(cursor_pos), int(cursor_tok)], "window": np.asarray(window, np.int64).tolist(),
            "rows": int(rows)}


class PackedStream:
    """Packed batches of a rank's epoch: the ``BatchStream`` a packing loader reads (NOTE [packing rule]).

    ``docs`` is the dataset's native stream over the packer's items (its pipeline feeds the
    packer); batches are dicts with the token field ``[rows, seq_len]``, ``position_ids``
    (int64, restarting at 0 in every document piece), ``document_ids`` (int32, the piece's
    number within the batch, -1 for padding) and ``cu_seqlens`` (int32, the boundaries of
    every piece and padding run in the batch's ``rows * seq_len`` tokens, flattened).
    """

    def __init__(self, docs: Any, packer: Any, spec: PackSpec, initial: dict[str, Any], rows_before: int) -> None:
        self._docs = docs
        self._packer = packer
        self._names: list[str] = list(packer.names)
        self._spec = spec
        self._pid = os.getpid()
        self._rows_before = rows_before
        # After k batches handed out: the native state tuple, made a dict only when asked for.
        self._states: dict[int, Any] = {0: initial}
        self._handed = 0
        self._ended = False
        self._start = time.perf_counter()
        self._end: float | None = None
        self.consumed: Any = None  # the loader's ConsumedCount: states before it are dropped
        self.timeout = 0.0
        self.on_finish: Callable[[dict[str, Any]], None] | None = None

    def __iter__(self) -> PackedStream:
        return self

    def __len__(self) -> int:
        raise TypeError("a packed epoch's number of batches depends on its documents' lengths; it is known at its end")

    def _take(self, fn: Callable[[float], Any]) -> Any:
        if os.getpid() != self._pid:
            raise LoaderStateError("iterator used in a forked child; create a new iterator after fork")
        try:
            item = fn(self.timeout)
        except LoaderTimeoutError as e:
            raise self._docs._timeout_error(e, self.timeout, "no packed batch arrived") from None
        if item is None:
            self._ended = True
            if self._end is None:
                self._end = time.perf_counter()
                self._finish()
            raise StopIteration
        self._handed += 1
        self._states[self._handed] = item[-1]
        # States from one batch before the caller's count on: a framework may hold the caller's
        # last batch untrained (NOTE [batches Lightning holds] in lightning_loop.py).
        keep = self.consumed.batches - _STATES_BEHIND if self.consumed is not None else 0
        for k in [k for k in self._states if k < keep]:
            del self._states[k]
        return item

    def _tensors(self, arrays: list[Any]) -> dict[str, torch.Tensor]:
        return {n: torch.from_dlpack(a) for n, a in zip(self._names, arrays, strict=True)}

    def __next__(self) -> dict[str, torch.Tensor]:
        _, _, arrays, _ = self._take(self._packer.next)
        return self._tensors(arrays)

    def next_host(self) -> tuple[Any, dict[str, torch.Tensor]]:
        """The next batch as (HostBatch, tensors), for the copy engine."""
        host, arrays, _, _ = self._take(self._packer.next_host)
        return host, self._tensors(arrays)

    @property
    def ended(self) -> bool:
        """Whether the caller was told the epoch ended (StopIteration)."""
        return self._ended

    def state_after(self, batches: int) -> dict[str, Any]:
        """This rank's packing entry after ``batches`` batches of this stream (NOTE [packing state]).

        Kept from ``_STATES_BEHIND`` batches before the caller's count on; LoaderStateError for earlier ones.
        """
        st = self._states.get(batches)
        if st is None:
            raise LoaderStateError(f"the packing state after {batches} batches is no longer kept (the caller has "
                                   f"received {self._handed if self.consumed is None else self.consumed.batches}; "
                                   f"states are kept from {_STATES_BEHIND} batch before that on)")
        if isinstance(st, dict):
            return st
        cpos, ctok, window, rows = st
        return _entry(cpos, ctok, window, rows + self._rows_before)

    def finished_after(self, batches: int) -> bool:
        """Whether the epoch is complete once ``batches`` batches were received."""
        if self._ended and batches >= self._handed:
            return True
        st = self.state_after(batches) if batches in self._states else None
        return st is not None and (bool(st.get("done")) or (st["cursor"][0] < 0 and not st["window"]))

    def close(self) -> None:
        """Stops the packer and the document pipeline. Idempotent."""
        if os.getpid() == self._pid:
            self._packer.close()
            self._docs.close()
            self._finish()

    def _finish(self) -> None:
        cb, self.on_finish = self.on_finish, None
        if cb is not None and os.getpid() == self._pid:
            cb(self.stats())

    def stats(self) -> dict[str, Any]:
        """The document pipeline's counters (``BatchIterator.stats``) with the packer's under ``"packing"``.

        ``padding_fraction``: padding tokens over all row tokens; ``tokens_per_s``: document
        tokens placed per second of wall time; ``pack_s``: the packer thread's time building
        rows; ``consumer_wait_s`` / ``wait_fraction``: the caller's time blocked on packed batches.
        """
        if os.getpid() != self._pid:
            raise LoaderStateError("iterator used in a forked child; create a new iterator after fork")
        s = dict(self._docs.stats())
        c = self._packer.counters()
        wall = (self._end or time.perf_counter()) - self._start
        slots = c["tokens"] + c["pad_tokens"]
        waited = c["wait_ns"] / 1e9
        s["documents"] = s.pop("records")
        s["doc_batches"] = s.pop("batches")
        s.update(batches=c["batches"], consumer_wait_s=waited, wall_s=wall,
                 wait_fraction=waited / wall if wall > 0 else 0.0, finished=self._end is not None)
        s["packing"] = {
            "seq_len": self._spec.seq_len, "mode": self._spec.mode, "lookahead": self._spec.window,
            "rows": c["rows"], "documents": c["items"], "pieces": c["pieces"], "split_documents": c["split_items"],
            "tokens": c["tokens"], "pad_tokens": c["pad_tokens"], "truncated_tokens": c["truncated_tokens"],
            "padding_fraction": c["pad_tokens"] / slots if slots else 0.0,
            "tokens_per_s": c["tokens"] / wall if wall > 0 else 0.0,
            "pack_s": c["pack_ns"] / 1e9, "input_wait_s": c["input_wait_ns"] / 1e9,
        }
        return s

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


__all__ = ["PACK_MODES", "Items", "PackSpec", "PackedStream", "PhasePlans", "PlanFn", "check_packing", "merge_states"]
