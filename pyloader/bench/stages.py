"""``pyloader bench``: stage-by-stage measurement and the accelerator-utilization mode.

Stages are measured apart (storage read, LZ4 decode, the memcpy limit of collation) and
together (the end-to-end loader), with torch's DataLoader on the same data in the same
run. The AU mode follows MLPerf Storage: simulated accelerators each take a batch, then
"compute" for a fixed time; AU = compute time / wall time.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..format.spec import CODEC_LZ4, INDEX_DTYPE, unpack_header
from ..loader.dataloader import DataLoader
from ..read.shards import ShardDataset
from . import measure as B

SCHEMA_VERSION = 1


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


def lz4_blocks(paths: list[str], limit_bytes: int = 32 << 20) -> list[tuple[bytes, int]]:
    """The dataset's own LZ4-compressed values (up to limit_bytes decoded), for the decode stage."""
    out: list[tuple[bytes, int]] = []
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        header = unpack_header(data)
        index = np.frombuffer(data, INDEX_DTYPE, count=header.index_size // INDEX_DTYPE.itemsize,
                              offset=header.index_offset)
        for e in index[index["codec"] == CODEC_LZ4]:
            start = header.payload_offset + int(e["offset"])
            out.append((data[start : start + int(e["stored"])], int(e["decoded"])))
            total += int(e["decoded"])
            if total >= limit_bytes:
                return out
    return out


class PadCollate:
    """Torch's side of the comparison: collates samples into pyloader's batch layout.

    Variable fields are zero-padded to the longest sample, with ``<name>_lengths`` beside them.
    """

    def __init__(self, ds: ShardDataset) -> None:
        self.fields = [(f.name, f.variable, f.dtype == "bytes") for f in ds.fields]

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Returns the batch of ``samples``: one tensor per field (and per variable field's lengths)."""
        out: dict[str, torch.Tensor] = {}
        for name, variable, is_bytes in self.fields:
            vals = [s[name] for s in samples]
            if is_bytes:
                vals = [torch.frombuffer(bytearray(v), dtype=torch.uint8) if v else torch.zeros(0, dtype=torch.uint8)
                        for v in vals]
            if variable:
                out[name] = torch.nn.utils.rnn.pad_sequence(vals, batch_first=True)
                out[f"{name}_lengths"] = torch.tensor([len(v) for v in vals], dtype=torch.int64)
            else:
                out[name] = torch.stack(vals)
        return out


def _best_epoch(make_loader: Callable[[], Any], epochs: int) -> dict[str, Any]:
    loader = make_loader()
    best: dict[str, Any] | None = None
    for _ in range(epochs):
        samples, nbytes, t = B.loader_epoch(loader)
        r: dict[str, Any] = {"samples": samples, "bytes": nbytes, "wall_s": t.wall, "cpu_s": t.cpu,
                             "samples_per_s": samples / t.wall, "gbps": nbytes / t.wall / 1e9}
        if isinstance(loader, DataLoader):
            r["stats"] = loader.stats()
        if best is None or r["samples_per_s"] > best["samples_per_s"]:
            best = r
    assert best is not None
    return best


def run_stages(ds: ShardDataset, *, batch_size: int, threads: int, epochs: int, torch_workers: int,
               progress: Callable[[str], None]) -> dict[str, Any]:
    """Measures each stage of the data path on ``ds``, then the whole; returns the figures by stage.

    Stages: remote fetch (remote datasets only), storage read, LZ4 decode (when the dataset
    holds compressed values), the memcpy limit of collation, pyloader end to end, torch's
    DataLoader on the same data and, with CUDA, the host-to-device copy. A stage that does
    not apply is ``None``. ``progress`` receives one line per stage.
    """
    stages: dict[str, Any] = {}
    stages["remote_fetch"] = None
    if ds.is_remote:
        progress("stage 0/5: remote fetch into the node cache")
        with B.CpuTimer() as t:
            got = ds.fetch_all()
        stages["remote_fetch"] = {"gbps": got["bytes"] / t.wall / 1e9 if got["bytes"] else None,
                                  "bytes": got["bytes"], "shards_downloaded": got["downloaded"],
                                  "shards_cached": len(ds.shard_paths) - got["downloaded"],
                                  "wall_s": t.wall, "cpu_s": t.cpu}
    local = ds.local_files()
    progress("stage 1/5: storage read")
    with B.CpuTimer() as t:
        gbps = B.read_gbps(local)
    stages["storage_read"] = {"gbps": gbps, "cpu_s": t.cpu, "wall_s": t.wall}

    progress("stage 2/5: LZ4 decode")
    blocks = lz4_blocks(local)
    if blocks:
        with B.CpuTimer() as t:
            one = B.native_decode_gbps(blocks, 1, seconds=0.5)
            many = B.native_decode_gbps(blocks, threads, seconds=0.5)
        stages["decode"] = {"gbps_1_thread": one, "gbps": many, "threads": threads, "cpu_s": t.cpu}
    else:
        stages["decode"] = None  # nothing in this dataset is compressed

    progress("stage 3/5: collation limit (memcpy)")
    with B.CpuTimer() as t:
        stages["collate_limit"] = {"memcpy_gbps": B.memcpy_gbps(threads, nbytes=32 << 20, repeat=4),
                                   "threads": threads}
    stages["collate_limit"]["cpu_s"] = t.cpu

    progress(f"stage 4/5: pyloader end to end ({threads} threads)")
    e2e = _best_epoch(lambda: DataLoader(ds, batch_size=batch_size, num_workers=threads), epochs)
    st = e2e.pop("stats")
    stages["pyloader"] = {**e2e, "threads": threads, "wait_fraction": st["wait_fraction"],
                          "stored_bytes": st["stored_bytes"], "decoded_bytes": st["decoded_bytes"],
                          "lz4_stored_bytes": st["lz4_stored_bytes"], "collate_s": st["collate_s"],
                          "shard_wait_s": st["shard_wait_s"]}

    progress(f"stage 5/5: torch DataLoader on the same data (num_workers={torch_workers})")
    stages["torch_dataloader"] = {
        **_best_epoch(lambda: torch.utils.data.DataLoader(
            ds, batch_size=batch_size, num_workers=torch_workers, collate_fn=PadCollate(ds),
            prefetch_factor=4 if torch_workers else None), epochs),
        "num_workers": torch_workers,
    }
    if torch.cuda.is_available():
        progress("stage: host-to-device copy")
        x = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
        y = torch.empty_like(x, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            y.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        stages["h2d"] = {"gbps": 10 * x.numel() / (time.perf_counter() - t0) / 1e9, "method": "torch pinned"}
    else:
        stages["h2d"] = None
    return stages


def diagnose(st: dict[str, Any]) -> dict[str, Any]:
    """Which stage bounds the loader, and what to change. Uses only measured numbers."""
    py = st["pyloader"]
    e2e_stored = py["gbps"] * (py["stored_bytes"] / py["decoded_bytes"] if py["decoded_bytes"] else 1.0)
    read = st["storage_read"]["gbps"]
    dec = st["decode"]
    lz4_share = py["lz4_stored_bytes"] / py["stored_bytes"] if py["stored_bytes"] else 0.0
    fetch = st.get("remote_fetch")
    limits = {"storage": read / max(e2e_stored, 1e-12),
              "collate": st["collate_limit"]["memcpy_gbps"] / max(py["gbps"], 1e-12)}
    if dec and lz4_share > 0.05:
        limits["decode"] = dec["gbps"] / max(py["gbps"] * lz4_share, 1e-12)
    if fetch and fetch["gbps"]:
        limits["network"] = fetch["gbps"] / max(e2e_stored, 1e-12)
    bound = min(limits, key=lambda k: limits[k])
    advice = {
        "network": "the network bounds a cold epoch: run `pyloader cache warm URL` on each node before "
                   "training, raise fetch_jobs, or compress the dataset (fewer bytes to move)",
        "storage": "storage bounds the loader: warm the node cache (pyloader cache warm), use faster "
                   "storage, or compress (LZ4 pays when storage is the bottleneck)",
        "decode": "LZ4 decode bounds the loader: add threads (--threads / num_workers), or write the "
                  "dataset with compression='none' if storage is fast (decode is ~5x slower than memcpy)",
        "collate": "copying into batch buffers bounds the loader: it is near the memory-bandwidth limit; "
                   "only fewer bytes per sample (smaller dtype, cropping) or more memory channels help",
    }
    notes = [advice[bound]]
    if py["wait_fraction"] > 0.5:
        notes.append("the consumer waited most of the time: this loop does no work, so any loader waits; "
                     "in training, watch loader.stats()['wait_fraction']")
    if py["samples"] and py["bytes"] / py["samples"] < 4096:
        notes.append("records are small (< 4 KB): per-record overhead dominates; larger records or "
                     "batching several samples per record raise throughput")
    torch_ratio = py["samples_per_s"] / max(st["torch_dataloader"]["samples_per_s"], 1e-12)
    return {"bound": bound, "headroom": {k: round(v, 2) for k, v in limits.items()},
            "speedup_vs_torch": torch_ratio, "notes": notes}


# -- accelerator utilization ------------------------------------------------------------
def _accelerator(make_iter: Callable[[], Iterator[Any]], compute_s: float, batches: int,
                 out: list[dict[str, float]], barrier: threading.Barrier) -> None:
    it = make_iter()
    first = time.perf_counter()
    next(it)  # startup (first batch) is reported apart from the steady state
    startup = time.perf_counter() - first
    barrier.wait()
    waited = 0.0
    t0 = time.perf_counter()
    for _ in range(batches):
        w = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            it = make_iter()
            next(it)
        waited += time.perf_counter() - w
        time.sleep(compute_s)  # the simulated accelerator computes; releases the GIL
    wall = time.perf_counter() - t0
    out.append({"au": batches * compute_s / wall, "wait_s": waited, "wall_s": wall, "startup_s": startup})


def _measure_au(factory: Callable[[int, int], Callable[[], Iterator[Any]]], n: int, compute_s: float,
               batches: int) -> dict[str, float]:
    results: list[dict[str, float]] = []
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            _accelerator(factory(rank, n), compute_s, batches, results, barrier)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
            errors.append(e)
            barrier.abort()

    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    au = [r["au"] for r in results]
    return {"accelerators": n, "au": float(np.mean(au)), "au_min": float(np.min(au)),
            "startup_s": float(np.max([r["startup_s"] for r in results]))}


def max_accelerators(factory: Callable[[int, int], Callable[[], Iterator[Any]]], compute_s: float, *,
                     batches: int, threshold: float, cap: int,
                     progress: Callable[[str], None], label: str) -> dict[str, Any]:
    """Largest accelerator count with AU >= threshold: doubling, then bisection."""
    trials: dict[int, dict[str, float]] = {}

    def trial(n: int) -> bool:
        if n not in trials:
            trials[n] = _measure_au(factory, n, compute_s, batches)
            progress(f"{label}: {n} accelerators -> AU {100 * trials[n]['au']:.1f}%")
        return trials[n]["au"] >= threshold

    good, bad = 0, None
    n = 1
    while n <= cap:
        if trial(n):
            good, n = n, n * 2
        else:
            bad = n
            break
    if bad is None and good < cap:
        bad = cap + 1 if not trial(cap) else None
        if bad is None:
            good = cap
    if bad is not None:
        lo, hi = good, bad
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if trial(mid):
                lo = mid
            else:
                hi = mid
        good = lo
    return {"max_accelerators": good, "threshold": threshold, "cap": cap,
            "trials": [trials[k] for k in sorted(trials)]}


def run_au(path: str, w: Workload, *, cache_dir: str | None = None, threads: int, torch_workers: int,
           batches: int, threshold: float, cap: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Largest number of simulated accelerators pyloader and torch's DataLoader each keep busy.

    Each accelerator reads its rank's part of the dataset at ``path`` with its own loader
    and computes ``w.compute_s`` per batch; the count that keeps AU >= ``threshold`` is
    searched up to ``cap``, lowered further so that the loaders' batches fit in 40% of
    free memory.
    """
    batch_bytes = w.record_bytes * w.batch_size
    try:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        avail = 8 << 30
    # Each accelerator's loader holds about (prefetch + 2) batches; stay within 40% of free RAM.
    mem_cap = max(1, int(0.4 * avail / (batch_bytes * (2 * threads + 3))))
    cap = min(cap, mem_cap)

    def py_factory(rank: int, n: int) -> Callable[[], Iterator[Any]]:
        ds = ShardDataset(path, rank=rank, world_size=n, cache_dir=cache_dir)
        loader = DataLoader(ds, batch_size=w.batch_size, num_workers=threads)
        return lambda: iter(loader)

    def torch_factory(rank: int, n: int) -> Callable[[], Iterator[Any]]:
        ds = ShardDataset(path, rank=rank, world_size=n, cache_dir=cache_dir)
        loader = torch.utils.data.DataLoader(ds, batch_size=w.batch_size, num_workers=torch_workers,
                                             collate_fn=PadCollate(ds),
                                             prefetch_factor=2 if torch_workers else None)
        return lambda: iter(loader)

    out: dict[str, Any] = {"workload": w.__dict__, "cap": cap}
    out["pyloader"] = max_accelerators(py_factory, w.compute_s, batches=batches, threshold=threshold, cap=cap,
                                       progress=progress, label="pyloader")
    out["torch_dataloader"] = max_accelerators(torch_factory, w.compute_s, batches=batches, threshold=threshold,
                                               cap=cap, progress=progress, label="torch DataLoader")
    out["torch_dataloader"]["num_workers"] = torch_workers
    return out


def au_batches(w: Workload, seconds: float) -> int:
    """Batches per AU trial: enough for ``seconds`` of simulated compute, and at least 4."""
    return max(4, math.ceil(seconds / w.compute_s))
