"""``pyloader bench``: stage-by-stage measurement and the accelerator-utilization mode.

Stages are measured apart (storage read, LZ4 decode, the memcpy limit of collation) and
together (the end-to-end loader), with torch's DataLoader on the same data in the same
run; ``diagnosis.py`` reads the figures. The AU mode follows MLPerf Storage: simulated
accelerators each take a batch, then "compute" for a fixed time; AU = compute time /
(compute time + time waiting for batches) (the search over counts is ``au.py``'s).
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import pyloader._C as _C

from ..errors import ShardCorruptError, ShardFormatError
from ..format.spec import (
    CHECKSUM_NAMES,
    CODEC_LZ4,
    HEADER_SIZE,
    INDEX_DTYPE,
    shard_checksum,
    shard_columns,
    unpack_header,
)
from ..loader import autotune
from ..loader.dataloader import DataLoader
from ..read.shards import ShardDataset
from ..transform.stage import collate_samples
from . import measure as B
from .au import AU_CEILING, Workload, max_accelerators
from .diagnosis import MIN_BATCHES, pack_verdict, transform_hint

SCHEMA_VERSION = 2


def _corrupt(path: str, what: str, record: int | None = None, field: str | None = None) -> ShardCorruptError:
    where = f"shard {path!r}" + (f" record {record} field {field!r}" if record is not None else "")
    e = ShardCorruptError(f"{where}: {what}")
    e.shard, e.record, e.field = path, record, field
    return e


def lz4_blocks(paths: list[str], limit_bytes: int = 32 << 20,
               field_names: list[str] | None = None) -> list[tuple[bytes, int]]:
    """The dataset's own LZ4-compressed values (up to limit_bytes decoded), for the decode stage.

    Each shard's header and index checksums, and each value's, are verified (with the
    function of the shard's version), and each value is decoded once, here on the calling thread: a corrupt shard raises a
    ``ShardCorruptError`` naming it (and the record and field) before any timed run.
    """
    out: list[tuple[bytes, int]] = []
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        try:
            header = unpack_header(data)
            checksum = shard_checksum(header.version)
        except ShardFormatError as e:
            raise _corrupt(path, str(e)) from None
        (stored_header_hash,) = struct.unpack_from("<Q", data, HEADER_SIZE - 8)
        if checksum(data[: HEADER_SIZE - 8]) != stored_header_hash:
            raise _corrupt(path, "header checksum mismatch (corrupt data)")
        if header.file_size != len(data) or header.index_offset + header.index_size > len(data):
            raise _corrupt(path, f"the header says {header.file_size} bytes, the file has {len(data)}")
        index_bytes = data[header.index_offset : header.index_offset + header.index_size]
        if checksum(index_bytes) != header.index_checksum:
            raise _corrupt(path, "index checksum mismatch (corrupt data)")
        index = np.frombuffer(index_bytes, INDEX_DTYPE)
        try:  # version 3: column fields have no index entries (NOTE [column layout] in format/spec.py)
            in_columns = {c.field for c in shard_columns(data, header)}
        except ShardFormatError as e:
            raise _corrupt(path, str(e)) from None
        indexed = [f for f in range(header.num_fields) if f not in in_columns]
        for i in np.flatnonzero(index["codec"] == CODEC_LZ4):
            entry = index[i]
            record, slot = divmod(int(i), max(len(indexed), 1))
            f_i = indexed[slot]
            field = field_names[f_i] if field_names and f_i < len(field_names) else f"#{f_i}"
            start = header.payload_offset + int(entry["offset"])
            size, decoded = int(entry["stored"]), int(entry["decoded"])
            if start + size > len(data):
                raise _corrupt(path, "value runs past the end of the shard", record, field)
            block = data[start : start + size]
            got = checksum(block)
            if got != int(entry["checksum"]):
                raise _corrupt(path, f"payload checksum mismatch (corrupt data): {CHECKSUM_NAMES[header.version]} "
                                     f"{got:016x}, index says {int(entry['checksum']):016x}", record, field)
            try:
                _C.lz4_decode_block(block, decoded)
            except ValueError as err:
                raise _corrupt(path, f"LZ4 block does not decode: {err}", record, field) from None
            out.append((block, decoded))
            total += decoded
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


_STAT_SUMS = ("batches", "records", "stored_bytes", "decoded_bytes", "lz4_stored_bytes", "collate_s",
              "shard_wait_s", "consumer_wait_s", "wall_s")


def _first_epoch_after_pause(make_loader: Callable[[], Any], steady: float, pause: float = 1.0) -> dict[str, Any]:
    """A new loader's first epoch timed from ``iter()``, ``pause`` seconds after it was built.

    As a training script sees it: the loader built, the model built (here: a pause), then the
    first epoch -- which the loader may have begun in the pause (NOTE [first epoch ahead] in
    pyloader/loader/native_epoch.py). ``steady``: the steady rate (samples/s) it is held to.

    Then the same loader, its first epoch done, pauses as long again and reads one more epoch
    (``paused_warm_*``): what the pause alone costs a loader with nothing left to start. On a
    machine whose other work evicts an idle process's memory from the CPU caches (a virtual
    machine on a shared host) that epoch too runs below the steady rate: the first epoch
    after a pause is held to it (``paused_first_vs_warm``).
    """
    def epoch(loader: Any) -> tuple[int, float, float]:
        time.sleep(pause)
        samples, first_batch = 0, None
        t0 = time.perf_counter()
        for batch in loader:
            if first_batch is None:
                first_batch = time.perf_counter() - t0
            samples += B.batch_payload(batch)[0]
            del batch
        return samples, time.perf_counter() - t0, first_batch or 0.0

    loader = make_loader()
    samples, wall, first_batch = epoch(loader)
    warm_samples, warm_wall, _ = epoch(loader)
    del loader
    rate = samples / wall if wall > 0 else 0.0
    warm_rate = warm_samples / warm_wall if warm_wall > 0 else 0.0
    return {"pause_s": pause, "paused_first_epoch_s": wall, "paused_first_batch_s": first_batch,
            "paused_first_epoch_vs_steady": rate / max(steady, 1e-12),
            "paused_warm_epoch_s": warm_wall, "paused_warm_epoch_vs_steady": warm_rate / max(steady, 1e-12),
            "paused_first_vs_warm": rate / max(warm_rate, 1e-12)}


def _measure_loader(make_loader: Callable[[], Any], *, rounds: int, batch_size: int,
                    min_seconds: float, max_epochs: int = 100_000, min_batches: int = 0) -> dict[str, Any]:
    """The best of ``rounds`` timed rounds of one loader, after its first epoch, timed apart.

    The first epoch (torch starts its worker processes; pyloader maps the shards, verifies
    every record's checksum and faults in its batch buffers) is reported apart: from
    ``make_loader()`` to the end of that epoch as ``startup_s``, to its first batch as
    ``first_batch_s``, and its rate as ``first_epoch_samples_per_s``. A round runs whole
    epochs back to back until it spans ``min_seconds`` (at most ``max_epochs``), so that a
    small dataset is still timed over enough time, and ``min_batches`` batches; the round
    with the highest rate is kept (the steady state), and ``first_epoch_vs_steady`` is the
    first epoch's rate over it. A pyloader loader's round also keeps each epoch's
    ``stats()`` and wall time (``epoch_stats``, after the untimed first epoch's with wall time
    0: what the transform stage's figures sum).
    """
    t_make = time.perf_counter()
    loader = make_loader()
    samples = 0
    first_batch = None
    for batch in loader:
        if first_batch is None:
            first_batch = time.perf_counter() - t_make
        samples += B.batch_payload(batch)[0]
        del batch  # as the timed epochs do: the slot goes back to the pool
    startup = time.perf_counter() - t_make
    # New batch memory in the first epoch: the kernel populating (and zeroing) fresh pages,
    # on the collating threads (thread time, summed over them).
    first_alloc = loader.host_memory() if isinstance(loader, DataLoader) else None
    first_stats = loader.stats() if isinstance(loader, DataLoader) else None
    best: dict[str, Any] | None = None
    for _ in range(rounds):
        n = nbytes = epochs = 0
        stats: dict[str, float] = {k: 0 for k in _STAT_SUMS}
        per_epoch: list[tuple[dict[str, Any], float]] = []
        with B.CpuTimer() as t:
            while True:
                t_epoch = t.elapsed()
                s, nb = B.epoch_samples(loader)
                n, nbytes, epochs = n + s, nbytes + nb, epochs + 1
                if isinstance(loader, DataLoader):
                    st = loader.stats()
                    per_epoch.append((st, t.elapsed() - t_epoch))
                    for k in _STAT_SUMS:
                        stats[k] += st.get(k, 0)  # (the process executor reads in its workers)
                # The timer's own clock: the round's wall time is then never below min_seconds.
                enough = t.elapsed() >= min_seconds and epochs * math.ceil(samples / batch_size) >= min_batches
                if enough or epochs >= max_epochs:
                    break
        r: dict[str, Any] = {"samples": n // epochs, "bytes": nbytes // epochs, "epochs": epochs,
                             "wall_s": t.wall, "epoch_s": t.wall / epochs, "cpu_s": t.cpu,
                             "samples_per_s": n / t.wall, "gbps": nbytes / t.wall / 1e9,
                             "batches_per_epoch": math.ceil(samples / batch_size), "startup_s": startup,
                             "first_batch_s": first_batch or 0.0,
                             "first_epoch_samples_per_s": samples / startup if startup > 0 else 0.0}
        if isinstance(loader, DataLoader):
            r["stats"], r["epoch_stats"] = stats, [(first_stats, 0.0), *per_epoch]
        if best is None or r["samples_per_s"] > best["samples_per_s"]:
            best = r
    assert best is not None
    if isinstance(loader, DataLoader) and "autotune" in loader.stats():
        best["autotune"] = loader.stats()["autotune"]  # where the tuner ended (NOTE [autotune])
    best["first_epoch_vs_steady"] = best["first_epoch_samples_per_s"] / max(best["samples_per_s"], 1e-12)
    if first_alloc is not None:
        best["first_epoch_alloc_bytes"] = first_alloc["driver_alloc_bytes"]
        best["first_epoch_alloc_s"] = first_alloc["driver_alloc_s"]
    return best


def run_stages(ds: ShardDataset, *, batch_size: int, threads: int | str, epochs: int, torch_workers: int,
               progress: Callable[[str], None], min_seconds: float = 0.5) -> dict[str, Any]:
    """Measures each stage of the data path on ``ds``, then the whole; returns the figures by stage.

    Stages: remote fetch (remote datasets only), storage read, LZ4 decode (when the dataset
    holds compressed values), the copy capacity of collation, pyloader end to end, torch's
    DataLoader on the same data and, with CUDA, the host-to-device copy. Storage, decode
    and copy run on ``threads`` threads, as the loader does. A stage that does not apply is
    ``None``. ``progress`` receives one line per stage; ``epochs`` timed rounds of at least
    ``min_seconds`` each are run per loader (the best is kept).
    """
    auto = threads == "auto"  # See NOTE [autotune]: the loader tunes its threads; stages use every CPU
    n: int = autotune.cpu_budget() if auto else int(threads)
    stages: dict[str, Any] = {}
    stages["remote_fetch"] = None
    if ds.is_remote:
        progress("stage 0/5: remote fetch into the node cache")
        with B.CpuTimer() as t:
            got = ds.fetch_all()
        stages["remote_fetch"] = {"gbps": got["bytes"] / t.wall / 1e9 if got["bytes"] else None,
                                  "bytes": got["bytes"], "shards_downloaded": got["downloaded"],
                                  "shards_cached": len(ds.shard_paths) - got["downloaded"],
                                  "wall_s": t.wall, "cpu_s": t.cpu, "transport": ds._remote.transport().name,
                                  "jobs": ds.fetch_jobs,
                                  "cpu_s_per_gb": t.cpu / (got["bytes"] / 1e9) if got["bytes"] else None}
    local = ds.local_files()
    progress(f"stage 1/5: storage read ({n} threads)")
    with B.CpuTimer() as t:
        gbps = B.read_gbps(local, n, min_seconds=0.2)
    stages["storage_read"] = {"gbps": gbps, "threads": n, "cpu_s": t.cpu, "wall_s": t.wall}

    stages["cold_read"] = cold_read_stage(ds, batch_size=batch_size, threads=n, progress=progress)

    progress("stage 2/5: LZ4 decode")
    blocks = lz4_blocks(local, field_names=[f.name for f in ds.fields])
    if blocks:
        with B.CpuTimer() as t:
            one = B.native_decode_gbps(blocks, 1, seconds=0.5)
            many = B.native_decode_gbps(blocks, n, seconds=0.5)
        stages["decode"] = {"gbps_1_thread": one, "gbps": many, "threads": n, "cpu_s": t.cpu}
    else:
        stages["decode"] = None  # nothing in this dataset is compressed

    progress("stage 3/5: collation copy capacity")
    batch_bytes = max(1, sum(ds.shard_bytes)) // max(1, ds.num_records) * batch_size
    with B.CpuTimer() as t:
        stages["collate_limit"] = {"memcpy_gbps": B.collate_copy_gbps(n, batch_bytes), "threads": n,
                                   "copy_bytes": batch_bytes}
    stages["collate_limit"]["cpu_s"] = t.cpu

    progress(f"stage 4/5: pyloader end to end ({'auto-tuned' if auto else threads} threads)")
    e2e = _measure_loader(lambda: DataLoader(ds, batch_size=batch_size, num_workers="auto" if auto else n),
                          rounds=epochs, batch_size=batch_size, min_seconds=min_seconds)
    st = e2e.pop("stats")
    e2e.pop("epoch_stats")
    e2e.update(_first_epoch_after_pause(
        lambda: DataLoader(ds, batch_size=batch_size, num_workers="auto" if auto else n), e2e["samples_per_s"]))
    tuned = e2e.pop("autotune", None)
    used = tuned["threads"] if auto and tuned else n
    stages["pyloader"] = {**e2e, "threads": used,
                          **({"autotune": tuned} if auto else {}),
                          "wait_fraction": st["consumer_wait_s"] / max(st["wall_s"], 1e-12),
                          "workers_busy": st["collate_s"] / max(used * st["wall_s"], 1e-12),
                          **{k: st[k] // e2e["epochs"] for k in ("stored_bytes", "decoded_bytes",
                                                                  "lz4_stored_bytes")},
                          "collate_s": st["collate_s"], "shard_wait_s": st["shard_wait_s"]}

    progress(f"stage 5/5: torch DataLoader on the same data (num_workers={torch_workers})")
    stages["torch_dataloader"] = {
        **_measure_loader(lambda: torch.utils.data.DataLoader(
            ds, batch_size=batch_size, num_workers=torch_workers, collate_fn=PadCollate(ds),
            persistent_workers=torch_workers > 0, prefetch_factor=4 if torch_workers else None),
            rounds=epochs, batch_size=batch_size, min_seconds=min_seconds),
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


def cold_read_stage(ds: ShardDataset, *, batch_size: int, threads: int,
                    progress: Callable[[str], None]) -> dict[str, Any] | None:
    """Cold epochs, in order and shuffled, against the sequential read of the same files, cold too.

    Before each read the dataset's pages are dropped (``measure.drop_pages``: fsync and
    ``POSIX_FADV_DONTNEED`` on its files, no root needed). The files are read start to end in
    8 MiB reads on one thread (what the storage gives a sequential reader); then
    one epoch of a new ``ShardDataset`` over them in order (``in_order``: ``shuffle=False``,
    the first epoch of most jobs), then one globally shuffled (``shuffled``); each with its
    ``gbps`` (stored bytes over its wall time, from the loader's construction), ``of_seq``
    (``gbps / seq_gbps``) and ``first_batch_s``; ``warm_gbps``, the same loader's next epoch
    (its files in memory); ``limit_gbps``, what the machine allows the cold epoch: in order
    the slower of ``seq_gbps`` and ``warm_gbps`` (reading and making batches overlap),
    shuffled the two one after the other (a global shuffle's batches need records from all
    over the dataset, so with batch memory bounded almost none is finished before the last
    read); and ``of_limit`` (``gbps / limit_gbps``). The files are read again last as ``cat``
    reads them (``measure.stream_read_gbps``: 128 KiB reads, the kernel's read-ahead ahead of
    them), and ``seq_gbps`` is the faster of the two (``seq_gbps_runs``): the device's speed
    drifts, the 8 MiB reads alone read 0.6-2.0 GB/s run to run where ``cat`` read 2.1 here,
    and the slower read would flatter the epochs. ``of_seq`` is the lower epoch's ratio, ``gbps``
    and the other top-level figures the shuffled epoch's; ``resident`` the largest share of
    the files still in memory after a drop (pages another process maps stay). None for a
    remote dataset, whose cold read is the fetch stage.
    """
    if ds.is_remote:
        return None
    progress(f"stage 1b/5: cold read (page cache dropped before each: sequential read, one epoch in order and "
             f"one shuffled on {threads} threads, sequential read as cat reads)")
    files = ds.local_files()
    size = sum(os.path.getsize(f) for f in files)
    # Every read gets page-cache pages the machine has backed (measure.pretouch): on a VM that
    # backs memory at first touch, whichever read came first would pay for it.
    warm = min(2 * size, B.available_memory() // 2)
    resident: list[float] = []

    def cold() -> None:
        B.drop_pages(files)
        resident.append(B.resident_fraction(files))
        B.pretouch(warm)

    def epoch(shuffle: bool) -> dict[str, Any]:
        cold()
        with B.CpuTimer() as t:
            # Encoded fields (images) as the bytes they are, as every I/O stage reads them.
            cold_ds = ShardDataset(ds.url, shuffle=shuffle, seed=0, max_value_bytes=ds.max_value_bytes,
                                   decode=False)
            loader = DataLoader(cold_ds, batch_size=batch_size, num_workers=threads)
            samples = 0
            first_batch_s = None
            for batch in loader:
                if first_batch_s is None:
                    first_batch_s = t.elapsed()
                samples += B.batch_payload(batch)[0]
        stored = loader.stats()["stored_bytes"]
        t0 = time.perf_counter()
        for _ in loader:  # the same loader's next epoch, warm: what it makes of bytes in memory
            pass
        warm_s = time.perf_counter() - t0
        return {"gbps": stored / max(t.wall, 1e-9) / 1e9, "stored_bytes": stored, "samples": samples,
                "wall_s": t.wall, "first_batch_s": first_batch_s, "cpu_s": t.cpu,
                "warm_gbps": stored / max(warm_s, 1e-9) / 1e9}

    cold()
    seq_runs = [B.read_gbps(files, 1)]
    in_order = epoch(False)
    shuffled = epoch(True)
    cold()
    seq_runs.append(B.stream_read_gbps(files))
    seq = max(seq_runs)
    for e in (in_order, shuffled):
        e["of_seq"] = e["gbps"] / seq if seq > 0 else None
    # What the machine allows each: in order, reading and making batches overlap, so the slower
    # of the two; shuffled, every batch needs records from all over the dataset, so with batch
    # memory bounded almost none is finished before the last read: the two one after the other.
    in_order["limit_gbps"] = min(seq, in_order["warm_gbps"])
    shuffled["limit_gbps"] = 1 / (1 / seq + 1 / shuffled["warm_gbps"]) if seq > 0 else 0.0
    for e in (in_order, shuffled):
        e["of_limit"] = e["gbps"] / e["limit_gbps"] if e["limit_gbps"] > 0 else None
    ratios = [e["of_seq"] for e in (in_order, shuffled) if e["of_seq"] is not None]
    return {"seq_gbps": seq, "seq_gbps_runs": seq_runs, "bytes": size, "threads": threads,
            "resident": max(resident), "in_order": in_order, "shuffled": shuffled,
            "of_seq": min(ratios) if ratios else None,
            **{k: shuffled[k] for k in ("gbps", "stored_bytes", "samples", "wall_s", "cpu_s")}}


CEILING_SAMPLES = 1024  # the most samples the ceiling's processes cycle over (the same records the loaders read)
CEILING_BYTES = 64 << 20  # and the most stored bytes of them held in memory


def transform_ceiling(ds: ShardDataset, *, batch_size: int, processes: int, rounds: int,
                      seconds: float) -> dict[str, Any]:
    """The most the transform can give on ``processes`` CPUs: that many processes running it alone.

    The first records of ``ds``'s epoch 0 (at most ``CEILING_SAMPLES`` and ``CEILING_BYTES``)
    are read once into memory as batches; forked processes then run on them, sample by
    sample, what a transform worker runs on a sample (``run_batch``: the dataset's image
    decoding, then ``ds.transform`` with its seeds and context), with no reading, queue,
    collation or hand-off, for ``seconds`` (``measure.forked_rate``), ``rounds`` times; the
    best rate is kept, as benchmarks/bench_user_transforms.py measures its ceiling. No loader
    running the same code on as many workers passes it.
    """
    from ..transform.stage import run_batch

    spec = ds._sample_spec(0)
    units, records = ds.plan(epoch=0, worker=0, num_workers=1)
    held: list[tuple[dict[str, torch.Tensor], Any, Any, Any]] = []
    count = nbytes = 0
    it = ds.batches(batch_size, plan=(units, records), num_threads=1)
    try:
        for batch in it:
            rows = int(next(iter(batch.values())).shape[0])
            sl = slice(count, count + rows)
            held.append(({k: v.clone() for k, v in batch.items()}, units[sl], records[sl],
                         ds.global_index(units[sl], records[sl])))
            count += rows
            nbytes += sum(v.numel() * v.element_size() for v in batch.values())
            del batch
            if count >= CEILING_SAMPLES or nbytes >= CEILING_BYTES:
                break
    finally:
        it.close()

    def work(i: int) -> int:
        raw, u, r, g = held[i % len(held)]
        return run_batch(spec, ds, raw, u, r, g, 0).samples if spec is not None else len(u)

    runs = [B.forked_rate(work, processes, seconds) for _ in range(rounds)]
    return {"samples_per_s": max(runs), "runs_samples_per_s": runs, "processes": processes, "samples": count,
            "seconds": seconds}


def run_transform_stage(make_ds: Callable[..., ShardDataset], fn: Callable[..., Any] | None, *, executor: str,
                        decode: Any, batch_size: int, threads: int, epochs: int, torch_workers: int,
                        min_seconds: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """The per-sample transform stage: pyloader with and without it, and torch's DataLoader running it.

    ``make_ds(**kw)`` builds the dataset (``transform``, ``decode`` given here). Reports the
    rates, the transform's cost per sample on the workers, its share of each sample's time
    in the loader, the workers' busy share and the consumer's wait, and the loader's
    ``transform_hint`` (whether more workers would help).
    """
    progress(f"transform stage: pyloader with the transform ({threads} {executor} workers)")
    # Its figures come from the same epochs as its rate: at least MIN_BATCHES batches of them.
    with_tr = _measure_loader(lambda: DataLoader(make_ds(decode=decode), batch_size=batch_size, num_workers=threads,
                                                 transform=fn, executor=executor),
                              rounds=epochs, batch_size=batch_size, min_seconds=min_seconds, min_batches=MIN_BATCHES)
    progress("transform stage: pyloader without it (the same records, encoded fields as bytes)")
    without = _measure_loader(lambda: DataLoader(make_ds(decode=False), batch_size=batch_size, num_workers=threads),
                              rounds=epochs, batch_size=batch_size, min_seconds=min_seconds)
    progress(f"transform stage: torch DataLoader running it in its workers (num_workers={torch_workers})")
    # Collated as pyloader's transform stage collates (variable fields padded, with their
    # lengths): torch's default_collate cannot stack the sequences of a variable field.
    torch_r = _measure_loader(lambda: torch.utils.data.DataLoader(
        make_ds(decode=decode, transform=fn), batch_size=batch_size, num_workers=torch_workers,
        collate_fn=collate_samples, persistent_workers=torch_workers > 0,
        prefetch_factor=4 if torch_workers else None),
        rounds=epochs, batch_size=batch_size, min_seconds=min_seconds)
    progress(f"transform stage: the ceiling ({threads} processes running it alone)")
    ceiling = transform_ceiling(make_ds(decode=decode, transform=fn), batch_size=batch_size, processes=threads,
                                rounds=min(epochs, 3), seconds=min_seconds)
    with_tr.pop("stats", None)
    st = _transform_figures(with_tr.pop("epoch_stats"), batch_size)
    without.pop("stats", None)
    without.pop("epoch_stats", None)
    per_sample_s = st["per_sample_us"] / 1e6
    sample_s = threads / max(with_tr["samples_per_s"], 1e-12)  # worker time each sample took in the loader
    used = st["executor"] or executor
    return {
        # The executor that ran (executor="auto" chooses it: NOTE [executor choice]), what was asked, and why.
        "executor": used, "executor_asked": executor,
        "executor_choice": st["executor_choice"], "workers": threads,
        "with_transform": with_tr, "without_transform": without, "torch_dataloader": {**torch_r,
                                                                                       "num_workers": torch_workers},
        "per_sample_us": st["per_sample_us"], "decode_s": st["decode_s"], "transform_s": st["transform_s"],
        "share_of_sample_time": min(1.0, per_sample_s / sample_s) if sample_s > 0 else 0.0,
        "workers_busy": st["workers_busy"], "wait_fraction": st["wait_fraction"],
        "skipped_samples": st["skipped_samples"], "measured": st["measured"],
        "hint": transform_hint(wait_fraction=st["wait_fraction"], workers_busy=st["workers_busy"], workers=threads,
                               cpus=autotune.cpu_budget(), executor=used,
                               with_rate=with_tr["samples_per_s"], without_rate=without["samples_per_s"],
                               shard_wait_s=st["shard_wait_s"], wall_s=st["measured"]["wall_s"],
                               batches=st["measured"]["batches"],
                               gil_held=(st["executor_choice"] or {}).get("gil_held")),
        "limit_samples_per_s": threads / per_sample_s if per_sample_s > 0 else None,
        "speedup_vs_torch": with_tr["samples_per_s"] / max(torch_r["samples_per_s"], 1e-12),
        "ceiling": ceiling, "of_ceiling": with_tr["samples_per_s"] / max(ceiling["samples_per_s"], 1e-12),
        # The first epoch, from building the loader (its executor's choice and worker processes included).
        "first_epoch_samples_per_s": with_tr["first_epoch_samples_per_s"],
        "torch_first_epoch_samples_per_s": torch_r["first_epoch_samples_per_s"],
        "first_epoch_vs_torch": with_tr["first_epoch_samples_per_s"] / max(torch_r["first_epoch_samples_per_s"],
                                                                            1e-12),
        "first_epoch_vs_steady": with_tr["first_epoch_vs_steady"],
    }


def _transform_figures(epochs: list[tuple[dict[str, Any], float]], batch_size: int) -> dict[str, Any]:
    """The transform stage's counters summed over the timed epochs (``stats()`` and wall time of each).

    ``epochs[0]`` is the untimed first epoch's (wall time 0): it only says which executor
    ran before the first timed epoch. The workers' busy share and the consumer's wait are
    weighted by each epoch's wall time; the cost per sample is the summed transform and
    decode time over the samples. An epoch in which executor="auto" swapped executors is
    left out (``left_out`` counts them): its stats add up both parts' counts, but its busy
    share is the new part's alone (``AutoTransformStream.stats``); so is one with no
    transformed sample.
    """
    kept: list[tuple[dict[str, Any], float]] = []
    before = epochs[0][0].get("transform_executor") if epochs else None
    for s, w in epochs[1:]:
        swapped = s.get("transform_executor") != before
        before = s.get("transform_executor")
        if not swapped and s.get("transformed_samples", 0) + s.get("skipped_samples", 0) > 0:
            kept.append((s, w))
    if not kept:  # every timed epoch swapped (or none transformed): their counts, as they are
        kept = [(s, w) for s, w in epochs[1:] if s.get("transformed_samples", 0) + s.get("skipped_samples", 0) > 0]
    stats = [s for s, _ in kept]
    wall = max(sum(w for _, w in kept), 1e-12)
    samples = sum(s["transformed_samples"] + s["skipped_samples"] for s in stats)
    work = sum(s["transform_s"] + s["decode_s"] for s in stats)
    last = stats[-1] if stats else {}
    return {"executor": last.get("transform_executor"), "executor_choice": last.get("executor_choice"),
            "per_sample_us": 1e6 * work / max(samples, 1), "transform_s": sum(s["transform_s"] for s in stats),
            "decode_s": sum(s["decode_s"] for s in stats), "skipped_samples": sum(s["skipped_samples"] for s in stats),
            "workers_busy": sum(s["transform_busy_fraction"] * w for s, w in kept) / wall,
            "wait_fraction": sum(s["wait_fraction"] * w for s, w in kept) / wall,
            "shard_wait_s": sum(s.get("shard_wait_s", 0.0) for s in stats),
            "measured": {"epochs": len(kept), "left_out": len(epochs) - 1 - len(kept), "batches": sum(math.ceil(s["transformed_samples"] / batch_size)
                                                              for s in stats),
                         "samples": samples, "wall_s": sum(w for _, w in kept)}}


def _token_epochs(loader: Any, count: Callable[[dict[str, torch.Tensor]], int], rounds: int,
                  min_seconds: float) -> tuple[float, dict[str, Any]]:
    """(best tokens/s over ``rounds`` timed rounds, the stats of that round's last epoch).

    The tokens of an epoch are counted in a first, untimed epoch (``count`` per batch); the
    timed epochs only take the batches, as a training loop would.
    """
    per_epoch = sum(count(b) for b in loader)
    best, best_stats = 0.0, {}
    for _ in range(rounds):
        epochs, t0 = 0, time.perf_counter()
        while True:
            for _b in loader:
                pass
            epochs += 1
            if time.perf_counter() - t0 >= min_seconds or epochs >= 1000:
                break
        rate = per_epoch * epochs / (time.perf_counter() - t0)
        if rate > best:
            best, best_stats = rate, loader.stats()
    return best, best_stats


def run_pack_stage(make_ds: Callable[[], ShardDataset], spec: Any, *, rows: int, threads: int, epochs: int,
                   min_seconds: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """Sequence packing (``DataLoader(pack=spec)``) against reading the same documents unpacked.

    Reports document tokens per second packed and read unpacked (``spec.doc_batch``
    documents per batch, their lengths summed), the padding, and where the packed loader
    waits: the packer thread's time building rows and waiting for documents.
    """
    ds = make_ds()
    field = ds.fields[spec.resolve_field(ds.fields)].name
    progress(f"packing stage: packing {field!r} into rows of {spec.seq_len} tokens ({spec.mode}, {rows} rows per "
             f"batch, {threads} threads)")
    packed = DataLoader(ds, batch_size=rows, num_workers=threads, pack=spec)
    packed_rate, st = _token_epochs(packed, lambda b: int((b["document_ids"] >= 0).sum()), epochs, min_seconds)
    progress(f"packing stage: the same documents read unpacked ({spec.doc_batch} per batch)")
    plain = DataLoader(make_ds(), batch_size=spec.doc_batch, num_workers=threads)
    plain_rate, _ = _token_epochs(plain, lambda b: int(b[f"{field}_lengths"].sum()), epochs, min_seconds)
    pk = st["packing"]
    wall = max(st["wall_s"], 1e-12)
    busy, starved = pk["pack_s"] / wall, pk["input_wait_s"] / wall
    greedy_padding = None
    if spec.mode == "first_fit" and st["wait_fraction"] >= 0.5 and busy > 0.5 >= starved:
        # The advice would be greedy: one epoch of it on the same documents gives the padding it costs.
        progress("packing stage: one greedy epoch, for the padding it costs")
        greedy = DataLoader(make_ds(), batch_size=rows, num_workers=threads,
                            pack=dataclasses.replace(spec, mode="greedy", lookahead=None))
        for _b in greedy:
            pass
        greedy_padding = greedy.stats()["packing"]["padding_fraction"]
    bound = pack_verdict(busy=busy, starved=starved, wait_fraction=st["wait_fraction"], mode=spec.mode,
                         padding=pk["padding_fraction"], greedy_padding=greedy_padding, threads=threads,
                         cpus=autotune.cpu_budget())
    return {"field": field, "seq_len": spec.seq_len, "mode": spec.mode, "lookahead": spec.window,
            "rows_per_batch": rows, "threads": threads, "tokens_per_s": packed_rate,
            "unpacked_tokens_per_s": plain_rate, "packed_vs_unpacked": packed_rate / max(plain_rate, 1e-12),
            "padding_fraction": pk["padding_fraction"], "split_documents": pk["split_documents"],
            "truncated_tokens": pk["truncated_tokens"], "packer_busy": busy, "packer_waiting": starved,
            "wait_fraction": st["wait_fraction"], "bound": bound, "greedy_padding_fraction": greedy_padding}


# -- accelerator utilization ------------------------------------------------------------
def _accelerator(take: Callable[[], Any], compute_s: float, batches: int, out: list[dict[str, float]],
                 barrier: threading.Barrier) -> None:
    first = time.perf_counter()
    take()  # startup (first batch) is reported apart from the steady state
    startup = time.perf_counter() - first
    barrier.wait()
    waited = 0.0
    t0 = time.perf_counter()
    for _ in range(batches):
        w = time.perf_counter()
        take()  # the batch is dropped at once: its copy to the device is not simulated
        waited += time.perf_counter() - w
        time.sleep(compute_s)  # the simulated accelerator computes; releases the GIL
    wall = time.perf_counter() - t0
    # AU = compute / (compute + the time spent waiting for data): a sleep that overran (the
    # simulation's own thread not scheduled on a loaded machine) is not the loader's stall.
    busy = batches * compute_s
    out.append({"au": busy / (busy + waited), "wait_s": waited, "wall_s": wall, "startup_s": startup})


def _measure_au(loader: Any, n: int, compute_s: float, batches: int) -> dict[str, float]:
    """AU of ``n`` simulated accelerators taking their batches from one ``loader``, in turn.

    Each accelerator is a thread: it takes the next batch (the loader starts a new epoch when
    one ends), then "computes" for ``compute_s``.
    """
    results: list[dict[str, float]] = []
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    lock = threading.Lock()
    current: list[Iterator[Any]] = [iter(loader)]

    def take() -> None:
        with lock:
            try:
                next(current[0])
            except StopIteration:
                current[0] = iter(loader)
                next(current[0])

    def run() -> None:
        try:
            _accelerator(take, compute_s, batches, results, barrier)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
            errors.append(e)
            barrier.abort()

    ts = [threading.Thread(target=run, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    current.clear()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    au = [r["au"] for r in results]
    return {"accelerators": n, "au": float(np.mean(au)), "au_min": float(np.min(au)),
            "startup_s": float(np.max([r["startup_s"] for r in results]))}


# NOTE [one loader for the accelerators]: the N simulated accelerators of an AU trial share
# one loader, as the processes of one node's job share its CPUs and memory: N loaders of
# their own (the bench did that before) each hold their read-ahead batches, so the search
# stopped where N times that no longer fit in memory (24 to 48 resnet50 accelerators on a
# machine with a few GB free), well below what the CPUs could feed. The shared loader runs
# N x --au-threads threads (torch: N x --au-torch-workers worker processes), at most the
# CPUs this process may use (more would only share them), and holds up to N batches ahead
# (each accelerator one, so a batch is ready when it asks; at least a lone loader's default;
# torch's workers persistent, as a training job keeps them), at most what fits in 40% of
# free memory: ``prefetch`` and ``prefetch_limit`` ("memory" when that bound applied) in
# each trial. Memory then bounds the read-ahead, not the count, and the search goes on to
# where AU falls.
def _au_memory_batches(batch_bytes: int) -> int:
    """Batches that fit in 40% of free memory (at least 2)."""
    try:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        avail = 8 << 30
    return max(2, int(0.4 * avail / max(batch_bytes, 1)))


def run_au(path: str, w: Workload, *, cache_dir: str | None = None, threads: int, torch_workers: int,
           batches: int, threshold: float, cap: int | None, budget_s: float,
           progress: Callable[[str], None]) -> dict[str, Any]:
    """Largest number of simulated accelerators pyloader and torch's DataLoader each keep busy.

    The accelerators of a trial share one loader over the dataset at ``path`` (See NOTE
    [one loader for the accelerators]) and compute ``w.compute_s`` per batch; the count
    that keeps AU >= ``threshold`` is searched up to ``cap`` (None: ``AU_CEILING``), for at
    most ``budget_s`` of trials per loader, with repeated trials near the boundary (See NOTE
    [AU search]). Each loader's result has its ``cap`` and ``cap_reason``; the top level's
    are pyloader's. ``w.record_bytes`` is the size of the records at ``path`` (what sizes
    the read-ahead's memory bound).
    """
    mem_batches = _au_memory_batches(w.record_bytes * w.batch_size)
    given, given_reason = (AU_CEILING, "ceiling") if cap is None else (cap, "max_accelerators")
    cpus = autotune.cpu_budget()
    ds = ShardDataset(path, cache_dir=cache_dir, decode=False)  # encoded fields as bytes, as the I/O stages read them

    def ahead(n: int) -> tuple[int, str]:
        return (n, "accelerators") if n <= mem_batches else (mem_batches, "memory")

    def py_trial(n: int) -> dict[str, Any]:
        workers = min(n * threads, cpus)
        depth, why = ahead(max(n, 4 * workers))  # at least a lone loader's read-ahead
        loader = DataLoader(ds, batch_size=w.batch_size, num_workers=workers, prefetch=depth)
        return {**_measure_au(loader, n, w.compute_s, batches), "threads": workers, "prefetch": depth,
                "prefetch_limit": why}

    def torch_trial(n: int) -> dict[str, Any]:
        workers = min(n * torch_workers, cpus)
        depth, why = ahead(max(n, 2 * workers))  # at least torch's default read-ahead
        loader = torch.utils.data.DataLoader(ds, batch_size=w.batch_size, num_workers=workers,
                                             collate_fn=PadCollate(ds), persistent_workers=workers > 0,
                                             prefetch_factor=max(2, math.ceil(depth / workers)) if workers else None)
        r = _measure_au(loader, n, w.compute_s, batches)
        del loader  # its worker processes end before the next trial starts its own
        return {**r, "workers": workers, "prefetch": depth if workers else 0, "prefetch_limit": why}

    out: dict[str, Any] = {"workload": dict(w.__dict__), "cap": given, "cap_reason": given_reason,
                           "shared_loader": True, "memory_batches": mem_batches}
    out["pyloader"] = max_accelerators(py_trial, threshold=threshold, cap=given, budget_s=budget_s,
                                       progress=progress, label="pyloader")
    out["pyloader"]["cap_reason"] = given_reason
    out["torch_dataloader"] = max_accelerators(torch_trial, threshold=threshold, cap=given, budget_s=budget_s,
                                               progress=progress, label="torch DataLoader")
    out["torch_dataloader"].update(cap_reason=given_reason, num_workers=torch_workers)
    return out


__all__ = ["SCHEMA_VERSION", "lz4_blocks", "PadCollate", "run_stages", "cold_read_stage", "CEILING_SAMPLES", "CEILING_BYTES", "transform_ceiling", "run_transform_stage", "run_pack_stage",
           "run_au"]
