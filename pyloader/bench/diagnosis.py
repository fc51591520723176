"""The diagnosis of ``pyloader bench``: which stage bounds the loader and what to change.

It reads only measured figures (``stages.run_stages``'s dictionary) and imports no torch,
so a test can give it any situation. See NOTE [a diagnosis true to its figures].
"""

from __future__ import annotations

from typing import Any

from ..loader.autotune import cpu_budget
from ..transform.stage import BUSY_AT, RARELY_WAITS

# A stage used at or above this share of its measured capacity is what binds the loader.
BOUND_AT = 0.8
# Measurements shorter than these are flagged as too short to trust.
MIN_EPOCH_S = 0.5
MIN_BATCHES = 20
# A stage that carries less than this share of the loader's bytes gets no row (a note says why).
MIN_SHARE = 0.01

# NOTE [a diagnosis true to its figures]: nothing the diagnosis prints may contradict
# another of its figures or the machine it ran on.
# - No stage is used above 100%, and none has a capacity below what the loader's own epochs
#   show it carries: the rate the loader drew from it and, for the work its threads do
#   (decode, collate), that rate over the threads' busy share (they did it in at most that
#   share of their time). So a worker stage is never used more than the workers were busy,
#   and the table never shows decode "100% used" beside a verdict that no stage is near its
#   limit. A stage measured apart below that floor (another moment of a shared machine, a
#   different way to move the bytes) is raised to it (``clamped``, its own figure kept as
#   ``measured_gbps``) and a note says so and why.
# - ``bound`` is None exactly when every row is used below ``BOUND_AT``; else it names a row
#   used at least that much, and ``bound_utilization`` is that row's share.
# - Advice is what this machine and this dataset can take: "add threads" only while the
#   loader runs fewer threads than the CPUs this process may use (``cpus``, from its
#   affinity); `pyloader cache warm` only for a remote dataset (it refuses local paths);
#   "compress" only when some bytes are stored uncompressed.
# - Every row carries a share of the loader's bytes: a stage that carried under
#   ``MIN_SHARE`` of them (collation when the values are LZ4 blocks decoded straight into
#   the batch) has no row; a note says what carried the bytes instead.
# - A warning never blames the options a run was given for what they cannot change.
# - The transform and packing stages' verdicts follow from the figures printed beside them
#   (``transform_hint``, ``pack_verdict``): "enough" only when the consumer rarely waited,
#   "reading limits" only when reading alone is not much faster, "builds rows most of the
#   time" only above half the time, and advice that costs padding says how much.

_HOW = {
    "network": "every shard downloaded once into the node cache",
    "storage": "the shard files read with read() on {t} threads",
    "decode": "the dataset's own LZ4 blocks decoded on {t} threads",
    "collate": "uncompressed values: batch-sized copies from memory on {t} threads",
    "workers": "the loader's {t} threads, by its own counters: delivered rate / share of time busy",
}
# Why a stage can measure below what the loader drew from it.
_BELOW = {
    "network": "the download ran once, cold; the loader also read shards that were already cached",
    "storage": "read() copies every byte out of the page cache into a buffer, while the loader maps "
               "the shards and copies each byte once, straight into its batch",
    "decode": "the stage and the loader ran at different moments of a shared machine: the spread "
              "between runs is that large here",
    "collate": "the stage and the loader ran at different moments of a shared machine: the spread "
               "between runs is that large here",
    "workers": "the workers' capacity is derived from their busy share, which the load of the moment moves",
}


def diagnose(st: dict[str, Any], *, cpus: int | None = None) -> dict[str, Any]:
    """Which stage bounds the loader, by how much, and what to change. Uses only measured numbers.

    For each stage: its measured ``capacity_gbps``, the rate the loader drew from it
    (``demand_gbps``, in the same bytes: stored bytes for network and storage, decoded LZ4
    bytes for decode, bytes copied raw for collation) and ``utilization`` = demand /
    capacity. Row ``workers`` is the loader's own threads, from its counters in the timed
    epochs: utilization = the share of time they were busy. The stage with the highest
    utilization binds the loader when it is at least ``BOUND_AT`` (decode and collate only
    when the workers were that busy too); ``workers`` binds when they were busy and no
    separate stage explains it; else ``bound`` is None. ``cpus``: the CPUs the loader may
    use (default: this process's affinity). See NOTE [a diagnosis true to its figures].
    """
    py = st["pyloader"]
    cpus = cpu_budget() if cpus is None else max(1, int(cpus))
    rows, notes = _stage_rows(st)
    busy = py.get("workers_busy")
    clamped = _clamp_to_the_loaders_rate(rows, busy)
    candidates = [k for k in rows if k != "workers"]
    bound, use = _bound_stage(rows, candidates, busy)
    notes = [_headline(bound, rows, candidates, st, cpus)] + _stage_notes(rows, clamped, busy) + notes
    notes += _loader_notes(py)
    return {"bound": bound, "bound_utilization": use, "loader_gbps": py["gbps"], "cpus": cpus,
            "stages": rows,
            "headroom": {k: round(v["capacity_gbps"] / max(v["demand_gbps"], 1e-12), 2) for k, v in rows.items()},
            "speedup_vs_torch": py["samples_per_s"] / max(st["torch_dataloader"]["samples_per_s"], 1e-12),
            "notes": notes, "warnings": _warnings(st)}


def _stage_rows(st: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each stage's capacity against what the loader drew from it, and notes on stages left out."""
    py = st["pyloader"]
    threads = py["threads"]
    wall = max(py["epoch_s"], 1e-12)
    stored, decoded, lz4_stored = py["stored_bytes"], py["decoded_bytes"], py["lz4_stored_bytes"]
    raw = max(stored - lz4_stored, 0)  # raw values: stored == decoded, copied into the batch
    lz4_decoded = max(decoded - raw, 0)
    rows: dict[str, dict[str, Any]] = {}
    notes: list[str] = []

    def add(name: str, capacity: float | None, demand_bytes: int) -> None:
        if capacity is None or demand_bytes <= 0:
            return
        if demand_bytes < MIN_SHARE * max(decoded, 1):
            if name == "collate":
                notes.append(f"collate has no row: only {100 * demand_bytes / max(decoded, 1):.1f}% of the bytes "
                             "are uncompressed values copied into the batch; the LZ4 values are decoded straight "
                             "into it (row decode)")
            return
        demand = demand_bytes / wall / 1e9
        rows[name] = {"capacity_gbps": capacity, "demand_gbps": demand,
                      "utilization": demand / max(capacity, 1e-12), "how": _HOW[name].format(t=threads)}

    fetch = st.get("remote_fetch")
    if fetch and fetch["gbps"]:
        add("network", fetch["gbps"], stored)
    add("storage", st["storage_read"]["gbps"], stored)
    if st["decode"]:
        add("decode", st["decode"]["gbps"], lz4_decoded)
    add("collate", st["collate_limit"]["memcpy_gbps"], raw)
    busy = py.get("workers_busy")
    if busy:
        # The loader's own threads, timed by its own counters in the same epochs: the capacity
        # of its verify/decode/copy work is what it delivered over the share of time it worked.
        busy = min(busy, 1.0)
        rows["workers"] = {"capacity_gbps": py["gbps"] / busy, "demand_gbps": py["gbps"], "utilization": busy,
                           "how": _HOW["workers"].format(t=threads)}
    return rows, notes


# The stages whose work the loader's own threads do (the workers row times them).
_WORKER_STAGES = ("decode", "collate")


def _clamp_to_the_loaders_rate(rows: dict[str, dict[str, Any]], busy: float | None) -> list[str]:
    """Raises each capacity measured below what the loader's epochs show to that floor; returns those names.

    The floor is the rate the loader drew from the stage, over the workers' busy share for
    the work its threads do. See NOTE [a diagnosis true to its figures].
    """
    clamped = []
    share = min(max(busy, 1e-3), 1.0) if busy else 1.0
    for name, row in rows.items():
        floor = row["demand_gbps"] / (share if name in _WORKER_STAGES else 1.0)
        if floor > row["capacity_gbps"]:
            row.update(measured_gbps=row["capacity_gbps"], capacity_gbps=floor,
                       utilization=row["demand_gbps"] / max(floor, 1e-12), clamped=True)
            clamped.append(name)
    return clamped


def _bound_stage(rows: dict[str, dict[str, Any]], candidates: list[str],
                 busy: float | None) -> tuple[str | None, float]:
    """(the stage that binds the loader or None, its utilization)."""
    top = max(candidates or list(rows), key=lambda k: rows[k]["utilization"])
    use = rows[top]["utilization"]
    if use < BOUND_AT and busy is not None and busy >= BOUND_AT:
        # The threads are saturated by work the separate stages do not capture (verifying, overhead).
        top, use = "workers", rows["workers"]["utilization"]
    return (top if use >= BOUND_AT else None), use


def _headline(bound: str | None, rows: dict[str, dict[str, Any]], candidates: list[str], st: dict[str, Any],
              cpus: int) -> str:
    """The first note: what to change to go faster, or that no stage is near its limit."""
    if bound:
        return f"to go faster: {_advice(bound, st, cpus)}"
    busiest = max([*candidates, *(["workers"] if "workers" in rows else [])], key=lambda k: rows[k]["utilization"])
    return (f"no stage is near its limit (the busiest, {busiest}, at {100 * rows[busiest]['utilization']:.0f}% of "
            "its capacity): the rate is set by what these stages do not measure (handing batches to the "
            "consumer, per-batch overhead, the start of each epoch)")


def _advice(bound: str, st: dict[str, Any], cpus: int) -> str:
    """What to change when ``bound`` binds, as far as this machine and dataset allow."""
    py = st["pyloader"]
    threads = int(py["threads"])
    remote = st.get("remote_fetch") is not None
    uncompressed = py["stored_bytes"] > py["lz4_stored_bytes"]
    compressed = py["lz4_stored_bytes"] > 0
    more_threads = threads < cpus
    at_cpus = (f"the loader already runs {threads} threads on the {cpus} CPUs this process may use, so more "
               "threads will not help here")
    compress = ("write the dataset with LZ4 (`pyloader convert --compression lz4`, or ShardWriter's "
                "compression='lz4'): fewer bytes to move" if uncompressed else "")
    if bound == "network":
        return "; ".join(x for x in ("run `pyloader cache warm URL` on each node before training, or raise "
                                     "fetch_jobs", compress) if x)
    if bound == "storage":
        where = ("warm the node cache onto fast local storage (`pyloader cache warm URL`)" if remote
                 else "move the dataset to faster storage (local NVMe)")
        return "; ".join(x for x in (where, compress) if x)
    no_lz4 = ("write the dataset uncompressed (`pyloader convert --compression none`, or ShardWriter's "
              "compression='none') if storage is fast enough to carry the larger files" if compressed else "")
    if bound == "decode":
        first = f"add threads (--threads / num_workers; {threads} of {cpus} CPUs used)" if more_threads else at_cpus
        return "; ".join(x for x in (first, no_lz4, "" if more_threads else "or run on more CPUs") if x)
    if bound == "collate":
        first = ("add threads if the copy capacity grows with them (--threads / num_workers; "
                 f"{threads} of {cpus} CPUs used)" if more_threads else at_cpus)
        return f"{first}; otherwise only fewer bytes per sample (smaller dtype, cropping) help"
    # workers: they verify, decode and copy every batch
    first = (f"add threads (--threads / num_workers; {threads} of {cpus} CPUs used): they verify, decode and "
             "copy every batch" if more_threads else at_cpus)
    halve = ("with compression, writing the dataset uncompressed (`pyloader convert --compression none`, or "
             "compression='none') halves their work if storage keeps up" if compressed else "")
    return "; ".join(x for x in (first, halve, "" if more_threads else "or run on more CPUs") if x)


def _stage_notes(rows: dict[str, dict[str, Any]], clamped: list[str], busy: float | None) -> list[str]:
    """Why a stage's capacity was raised above what it measured apart (See NOTE [a diagnosis true to its figures])."""
    notes = []
    for name in clamped:
        row = rows[name]
        measured, demand, use = row["measured_gbps"], row["demand_gbps"], row["utilization"]
        at_limit = "read it as at its limit" if use >= 0.995 else f"{100 * use:.0f}% used"
        if measured < demand:
            why = (f"{name} measured {measured:.2f} GB/s, below the {demand:.2f} GB/s the loader drew from it "
                   f"({row['how']}): {_BELOW[name]}")
        else:
            why = (f"{name} measured apart at {measured:.2f} GB/s ({row['how']}), less than the loader's own "
                   f"workers showed: the separate run (another moment, Python threads calling the decoder or "
                   "copy) reads low")
        if name in _WORKER_STAGES and busy and busy < 1.0:
            why += (f"; the loader's workers, doing this work in the same epochs, drew {demand:.2f} GB/s from it "
                    f"while busy only {100 * busy:.0f}% of the time, so its capacity is taken as "
                    f"{row['capacity_gbps']:.2f} GB/s ({at_limit})")
        else:
            why += f"; its capacity is taken as the loader's own rate (no headroom): {at_limit}"
        notes.append(why)
    return notes


def _loader_notes(py: dict[str, Any]) -> list[str]:
    """The consumer's wait, small records and a first epoch slowed by new batch memory."""
    notes = []
    if py["wait_fraction"] > 0.5:
        notes.append(f"the consumer waited for batches {100 * py['wait_fraction']:.0f}% of the time: this "
                     "loop does no work, so the loader set the pace; in training, watch "
                     "loader.stats()['wait_fraction']")
    elif py["wait_fraction"] < 0.2:
        notes.append(f"the consumer waited for batches only {100 * py['wait_fraction']:.0f}% of the time: the "
                     "loop itself set the pace, so the loader's figure is a lower bound")
    if py["samples"] and py["bytes"] / py["samples"] < 4096:
        notes.append("records are small (< 4 KB): per-record overhead dominates; larger records or "
                     "batching several samples per record raise throughput")
    alloc_s, startup = py.get("first_epoch_alloc_s", 0.0), py.get("startup_s", 0.0)
    first_vs, nthreads = py.get("first_epoch_vs_steady", 1.0), max(int(py.get("threads") or 1), 1)
    if startup > 0 and first_vs < 0.6 and alloc_s > 0.2 * startup * nthreads:
        notes.append(f"the first epoch ran at {first_vs:.2f}x the steady state, and "
                     f"{100 * alloc_s / (startup * nthreads):.0f}% of its collating threads' time went "
                     f"to new batch memory ({py['first_epoch_alloc_bytes'] / 2**20:.0f} MiB: the kernel populating "
                     "pages for the batch buffers, paid once per process; an epoch of only a few batches "
                     "weighs it heavily)")
    return notes


def _warnings(st: dict[str, Any]) -> list[str]:
    """Figures too short to trust: epochs of few batches, timed rounds of little time."""
    warnings = []
    loaders = (("pyloader", st["pyloader"]), ("torch", st["torch_dataloader"]))
    few = [(label, s) for label, s in loaders if s["batches_per_epoch"] < MIN_BATCHES]
    if few:
        warnings.append(
            f"too short to trust: one epoch is only {few[0][1]['batches_per_epoch']} batches ("
            + ", ".join(f"{label} {1e3 * s['epoch_s']:.1f} ms" for label, s in few)
            + "), so the start of each epoch weighs on every figure and the pyloader / torch ratio is not a "
            f"steady-state one: measure at least {MIN_BATCHES} batches per epoch (a larger dataset, --records "
            "for the generated one, or a smaller --batch-size)")
    brief = [(label, s) for label, s in loaders if s["wall_s"] < MIN_EPOCH_S]
    if brief:
        warnings.append(
            "too short to trust: timed over only "
            + ", ".join(f"{label} {s['wall_s']:.2f} s" for label, s in brief)
            + f" (at least {MIN_EPOCH_S} s wanted): raise --min-seconds to {MIN_EPOCH_S} or more")
    return warnings


# The transform stage's verdicts share the loader's thresholds (pyloader/transform/stage.py):
# the consumer "rarely waits" under RARELY_WAITS of its time; the workers bind at or above
# BUSY_AT busy.
# "Reading limits" only while reading alone is at most this much faster than with the transform.
READING_AT = 1.25


def transform_hint(*, wait_fraction: float, workers_busy: float, workers: int, cpus: int, executor: str,
                   with_rate: float, without_rate: float, shard_wait_s: float, wall_s: float,
                   batches: int, gil_held: float | None = None) -> str:
    """The transform stage's verdict, drawn from the figures printed beside it.

    ``wait_fraction``/``workers_busy``: the consumer's wait and the transform workers' busy
    share over ``batches`` batches in ``wall_s``; ``with_rate``/``without_rate``: samples/s
    with and without the transform; ``shard_wait_s``: the native workers' time opening
    shards in those epochs. More workers are advised only below the CPUs this process may
    use; reading is blamed only when reading alone is not much faster. See NOTE [a
    diagnosis true to its figures]. ``gil_held``: the share of a sample's time holding the
    GIL, when executor="auto" measured it (processes are suggested only when it is high).
    """
    waits, busy = f"{100 * wait_fraction:.0f}%", f"{100 * workers_busy:.0f}%"
    if wait_fraction < RARELY_WAITS:
        return f"enough: the consumer waited only {waits} of the time for transformed batches"
    if workers_busy >= BUSY_AT:
        binds = (f"the consumer waits {waits} of the time and the {workers} transform worker(s) are busy {busy} "
                 "of it")
        gil = (", or executor='processes' for a transform that holds the GIL on threads"
               if executor == "threads" and (gil_held is None or gil_held >= 0.5) else "")
        if workers < cpus:
            return f"more workers would help: {binds} ({workers} of the {cpus} CPUs this process may use{gil})"
        return (f"the transform binds: {binds}, and the {workers} workers already match the {cpus} CPUs this "
                f"process may use, so more workers will not help here: a cheaper transform or more CPUs{gil}")
    idle = f"the consumer waits {waits} of the time but the transform workers are busy only {busy}"
    ratio = without_rate / max(with_rate, 1e-12)
    if ratio <= READING_AT:
        opening = (f"; the native workers spent {shard_wait_s:.2f} s of the {wall_s:.2f} s opening shards or "
                   "waiting for downloads" if shard_wait_s > 0.05 * wall_s else "")
        return (f"reading limits, not the transform: {idle}, and pyloader without the transform delivers "
                f"{without_rate:,.0f} samples/s, no more than {ratio:.2f}x the {with_rate:,.0f} with it{opening}")
    short = (f"; with only {batches} batches measured, the start of each epoch weighs on it"
             if batches < MIN_BATCHES else "")
    return (f"neither the transform nor reading binds: {idle}, and reading alone delivers {ratio:.1f}x this rate: "
            "the wait is in handing batches between the native pipeline, the transform workers and the "
            f"consumer{short}")


def pack_verdict(*, busy: float, starved: float, wait_fraction: float, mode: str, padding: float,
                 greedy_padding: float | None, threads: int, cpus: int) -> str:
    """What binds the packing stage, from its shares of time; advice that costs padding says how much.

    ``busy``/``starved``: the packer thread's share of time building rows and waiting for
    documents; ``wait_fraction``: the consumer's; ``padding``: this mode's padding share;
    ``greedy_padding``: greedy's on the same documents (measured when the advice needs it).
    "most of the time" means more than half. See NOTE [a diagnosis true to its figures].
    """
    shares = (f"the packer thread built rows {100 * busy:.0f}% of the time and waited for documents "
              f"{100 * starved:.0f}%")
    if wait_fraction < 0.5:
        return (f"consumer: it waited only {100 * wait_fraction:.0f}% of the time: the loop took the batches no "
                "faster than they were packed")
    if starved > 0.5:
        more = ("more --threads help when its workers are busy" if threads < cpus
                else f"its {threads} threads already use every CPU this process may use")
        return (f"documents: {shares}: it waits for the native pipeline that reads them; what binds that "
                f"pipeline is in the stages above ({more})")
    if busy > 0.5:
        if mode != "first_fit":
            return f"packer: {shares}; greedy is already the cheapest mode: a faster CPU packs faster"
        if greedy_padding is None or greedy_padding <= padding + 0.005:
            return f"packer: {shares}; greedy packs faster at no more padding on these documents"
        return (f"packer: {shares}; greedy (or a smaller --pack-lookahead) packs faster but pads more: greedy "
                f"padded {100 * greedy_padding:.1f}% of row tokens on these documents against "
                f"{100 * padding:.1f}% here, so it wastes that share of every step")
    return (f"no part most of the time: {shares}, and the consumer waited {100 * wait_fraction:.0f}%: the rest is "
            "handing rows to the consumer and per-batch overhead, which these shares do not measure")


__all__ = ["BOUND_AT", "BUSY_AT", "MIN_BATCHES", "MIN_EPOCH_S", "MIN_SHARE", "RARELY_WAITS", "READING_AT", "diagnose",
           "pack_verdict", "transform_hint"]
