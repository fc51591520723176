"""GPU-side measurements for benchmarks/gpu_check.sh, printed as one short table.

(a) Host-to-device GB/s, 64 MB segments, interleaved rounds (median):
      raw torch  ``dst.copy_(src, non_blocking=True)`` from a pinned source, and from a
                 pageable one;
      engine     pyloader's copy engine driven directly (``_C.CopyEngine``; sources are
                 batches collated into a pinned ``_C.SlotPool(pinned=True)``, destinations
                 preallocated), and through ``_transfer.DeviceStage.submit_host`` (fresh
                 destinations from torch's caching allocator, as the loader does);
      loader     ``pyloader.DataLoader(ShardDataset, device="cuda", num_workers=cores)``
                 over 1 MB records, 64 MB batches: bytes delivered / wall time (reading
                 the page cache and collating into pinned slots included);
    and each pyloader figure over raw pinned (target >= 0.9 for the engine).
(b) GPU busy fraction of a synthetic step (a fixed chain of bf16 matmuls calibrated to
    ~5 ms) fed by pyloader (device="cuda", num_workers = cores) vs torch's DataLoader
    (pin_memory=True, the best of a few num_workers, batches moved with
    ``.to(non_blocking=True)``), on 12 KB and 150 KB record datasets, batch 256:
    busy = sum of the steps' GPU times (CUDA events) / wall time of the loop.

    python benchmarks/gpu_bench.py [--device cuda|cpu] [--quick] [--json FILE] [--budget-s S]
    python benchmarks/gpu_bench.py --report FILE      # the table of a (partial) JSON

Results come out as they are measured, so a run stopped at its time limit still leaves
them: each H2D round and each busy-fraction run is printed (stderr) and written to the JSON
(replaced atomically) at once, and each table row is printed as soon as its figures exist;
the short table at the end repeats them. ``--budget-s`` makes the script itself skip what
would start after that many seconds (keeping what it has) and still print the table.
Exit status: 0 all measured; 1 a stage failed or was cut short by the budget; 2 no CUDA
device for ``--device cuda`` (checked first, before anything is written).

``--device cpu`` runs the same code paths without a GPU (pyloader with device="cpu", the
engine's CPU backend, pageable memory, perf_counter instead of CUDA events) to check the
script; its figures mean nothing for a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

import pyloader
from pyloader import _C
from pyloader.bench import measure as B
from pyloader.loader import transfer as _transfer


class Ctx:
    """The target device and how to time on it."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        if self.cuda:
            dev = torch.device(device)
            self.dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
            torch.cuda.set_device(self.dev)
        else:
            self.dev = torch.device("cpu")
        self.index = (self.dev.index or 0) if self.cuda else 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def stream_handle(self) -> int:
        return int(torch.cuda.current_stream(self.dev).cuda_stream) if self.cuda else 0

    def host_pool(self, num_fields: int) -> Any:
        """Pinned slots on a GPU machine; pageable (no warning) for --device cpu."""
        if self.cuda:
            return _C.SlotPool(num_fields=num_fields, pinned=True, device=self.index)
        return _C.SlotPool(num_fields=num_fields)


class Recorder:
    """The results so far, rewritten to the JSON file after every measurement, and the time budget."""

    def __init__(self, res: dict[str, Any], path: str | None, budget_s: float | None, t_start: float) -> None:
        self.res = res
        self.path = path
        self.t_start = t_start
        self.deadline = None if budget_s is None else t_start + budget_s

    def save(self) -> None:
        self.res["wall_s"] = time.perf_counter() - self.t_start
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.res, f, indent=1, default=str)
        os.replace(tmp, self.path)  # a reader (or a kill) never sees half a file

    def out_of_time(self, need_s: float = 0.0) -> bool:
        """Whether less than need_s seconds of the budget are left."""
        return self.deadline is not None and time.perf_counter() + need_s > self.deadline


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- (a) host-to-device bandwidth ----------------------------------------------------------
def write_big_dataset(path: str, record_bytes: int, records: int) -> None:
    base = (np.arange(record_bytes, dtype=np.uint32) % 251).astype(np.uint8)
    with pyloader.ShardWriter(path, {"payload": ("uint8", (record_bytes,)), "label": ("int64", ())},
                              compression="none", shard_bytes=256 << 20, overwrite=True) as w:
        for i in range(records):
            base[:8] = i % 256
            w.write({"payload": base, "label": i})


def h2d(ctx: Ctx, args: argparse.Namespace, tmp: str, rec: Recorder) -> dict[str, Any]:
    rbytes = args.record_bytes
    per_batch = max(1, args.segment_bytes // rbytes)
    seg = per_batch * rbytes
    reps = max(4, int(args.h2d_bytes // seg))
    total = reps * seg
    path = os.path.join(tmp, "big")
    write_big_dataset(path, rbytes, args.big_records)
    ds = pyloader.ShardDataset(path)
    threads = os.cpu_count() or 1

    # Sources for the engine: batches collated by the native pipeline into a pinned slot pool.
    src_pool = ctx.host_pool(len(ds.fields))
    it = ds.batches(per_batch, num_threads=min(4, threads), pool=src_pool)
    nsrc = 3
    srcs = [it.next_host() for _ in range(nsrc)]
    it.close()
    assert all(t["payload"].nbytes == seg for _, t in srcs)

    def torch_copy(pinned: bool) -> Callable[[], float]:
        src = torch.empty(seg, dtype=torch.uint8, pin_memory=pinned and ctx.cuda)
        src.fill_(7)
        dst = torch.empty(seg, dtype=torch.uint8, device=ctx.dev)

        def run() -> float:
            ctx.sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            ctx.sync()
            return time.perf_counter() - t0
        return run

    depth = args.depth
    staging = ctx.host_pool(1)

    def engine_direct() -> float:
        eng = _C.CopyEngine(backend="cuda" if ctx.cuda else "cpu", device=ctx.index, depth=depth, staging=staging)
        dsts = [torch.empty(seg, dtype=torch.uint8, device=ctx.dev) for _ in range(depth)]
        stream = ctx.stream_handle()
        tickets: collections.deque[int] = collections.deque()
        ctx.sync()
        t0 = time.perf_counter()
        for j in range(reps):
            if len(tickets) == depth:
                eng.take(tickets.popleft(), stream=stream)
            host, tensors = srcs[j % nsrc]
            x = tensors["payload"]
            tickets.append(eng.submit([(x.data_ptr(), dsts[j % depth].data_ptr(), x.nbytes)], stream=stream,
                                      source=host))
        while tickets:
            eng.take(tickets.popleft(), stream=stream)
        ctx.sync()
        dt = time.perf_counter() - t0
        eng.close()
        return dt

    def engine_stage() -> float:
        stage = _transfer.DeviceStage(ctx.dev, pin=ctx.cuda, depth=depth, staging_pool=staging)
        items = ((h, {"payload": t["payload"]}) for h, t in (srcs[j % nsrc] for j in range(reps)))
        ctx.sync()
        t0 = time.perf_counter()
        for b in _transfer.Staged(items, stage, lambda item: stage.submit_host(*item), go_on_after_error=False):
            assert b["payload"].device == ctx.dev
        ctx.sync()
        return time.perf_counter() - t0

    loader = pyloader.DataLoader(ds, batch_size=per_batch, num_workers=threads, device=ctx.dev)
    epoch_bytes = len(ds) * (rbytes + 8)
    epochs = max(1, int(round(args.h2d_bytes / epoch_bytes)))
    loader_bytes = [0]

    def run_loader() -> float:
        n = 0
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(epochs):
            for b in loader:
                n += b["payload"].nbytes + b["label"].nbytes
        ctx.sync()
        loader_bytes[0] = n
        return time.perf_counter() - t0

    variants = {"raw_pinned": torch_copy(True), "raw_pageable": torch_copy(False), "engine_direct": engine_direct,
                "engine_stage": engine_stage, "loader": run_loader}
    for name, fn in variants.items():  # warm-up: pools, contexts, checksums, caching allocator
        t0 = time.perf_counter()
        fn()
        log(f"  warm-up {name}: {time.perf_counter() - t0:.2f} s")
    out: dict[str, Any] = {"segment_bytes": seg, "reps": reps, "record_bytes": rbytes, "records": len(ds),
                           "loader_epochs": epochs, "loader_threads": threads, "sources_pinned": bool(src_pool.pinned),
                           "rounds_done": 0}
    rec.res["h2d"] = out
    # Interleaved rounds (the order rotates each round, as B.interleaved does), each one
    # recorded as soon as it ran; a round that would not fit in the budget is not started.
    names = list(variants)
    raw: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        t0 = time.perf_counter()
        k = r % len(names)
        for name in names[k:] + names[:k]:
            raw[name].append(variants[name]())
        bytes_of = {k: (loader_bytes[0] if k == "loader" else total) for k in raw}
        gbps = {k: bytes_of[k] / statistics.median(v) / 1e9 for k, v in raw.items()}
        ratios = {k: statistics.median([bytes_of[k] / a / (total / b) for a, b in zip(raw[k], raw["raw_pinned"])])
                  for k in ("engine_direct", "engine_stage", "loader", "raw_pageable")}
        out.update(rounds_done=r + 1, seconds=raw, bytes=bytes_of, gbps=gbps, over_raw_pinned=ratios)
        rec.save()
        dt = time.perf_counter() - t0
        log(f"  round {r + 1}/{args.rounds} ({dt:.1f} s): " + ", ".join(f"{k} {bytes_of[k] / v[-1] / 1e9:.2f}"
                                                                       for k, v in raw.items()) + " GB/s")
        if r + 1 < args.rounds and rec.out_of_time(2 * dt):
            log(f"  (stopping after {r + 1} rounds: time budget)")
            out["cut_short"] = True
            break
    out.update(loader_pool_slots=loader._pool.created, loader_stats=loader.stats())
    rec.save()
    return out


# -- (b) busy fraction of a synthetic step -------------------------------------------------
def make_step(ctx: Ctx, target_ms: float) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, Any]]:
    """A fixed chain of k matmuls (bf16 4096^2 on a GPU) with k calibrated to ~target_ms."""
    n, dtype = (4096, torch.bfloat16) if ctx.cuda else (256, torch.float32)
    g = torch.Generator(device=ctx.dev).manual_seed(0)
    w = (torch.randn(n, n, device=ctx.dev, generator=g) / n ** 0.5).to(dtype)

    def chain(k: int) -> torch.Tensor:
        y = w
        for _ in range(k):
            y = y @ w
        return y

    def gpu_ms(fn: Callable[[], Any], reps: int) -> float:
        times = []
        for _ in range(reps):
            if ctx.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    # Warm up first (clocks ramp from idle, cuBLAS picks its kernels), then refine k until
    # the chain takes target_ms within 10%.
    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end:
        chain(8)
        ctx.sync()
    probe = 32 if ctx.cuda else 8
    per_mm = gpu_ms(lambda: chain(probe), 5) / probe
    k = max(1, int(round(target_ms / per_mm)))
    for _ in range(4):
        ms = gpu_ms(lambda: chain(k), 5)
        if abs(ms - target_ms) <= 0.1 * target_ms:
            break
        k = max(1, int(round(k * target_ms / ms)))

    def step(x: torch.Tensor) -> torch.Tensor:
        # The step reads its whole batch on a GPU (~0.1 ms for 40 MB); on the CPU that would
        # swamp the 5 ms chain, so --device cpu reads a slice.
        xs = x if ctx.cuda else x.reshape(-1)[:65536]
        return chain(k).float().mean() + xs.float().mean()

    info = {"matmul_n": n, "dtype": str(dtype), "k": k, "matmul_ms_probe": per_mm,
            "chain_ms": gpu_ms(lambda: chain(k), 5)}
    return step, info


def payload(batch: Any) -> Any:
    return next(iter(batch.values())) if isinstance(batch, dict) else batch[0]


def busy_fraction(ctx: Ctx, loader: Any, step: Callable[[torch.Tensor], torch.Tensor], steps: int, warm: int,
                  move: bool) -> dict[str, float]:
    """Runs warm + steps training steps over the loader (a new epoch whenever one ends);
    busy = GPU time of the timed steps / their wall time."""
    state: dict[str, Iterator[Any]] = {"it": iter(loader)}
    epochs = [1]

    def next_batch() -> Any:
        try:
            return next(state["it"])
        except StopIteration:
            state["it"] = iter(loader)
            epochs[0] += 1
            return next(state["it"])

    def to_device(batch: Any) -> Any:
        if not move:
            return batch
        if isinstance(batch, dict):
            return {k: v.to(ctx.dev, non_blocking=True) for k, v in batch.items()}
        return [v.to(ctx.dev, non_blocking=True) for v in batch]

    for _ in range(warm):
        step(payload(to_device(next_batch())))
    ctx.sync()
    events = []
    busy_cpu = 0.0
    samples = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = to_device(next_batch())
        x = payload(batch)
        samples += int(x.shape[0])
        if ctx.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step(x)
            e.record()
            events.append((s, e))
        else:
            c0 = time.perf_counter()
            step(x)
            busy_cpu += time.perf_counter() - c0
    ctx.sync()
    wall = time.perf_counter() - t0
    busy = sum(s.elapsed_time(e) for s, e in events) / 1e3 if ctx.cuda else busy_cpu
    close = getattr(state["it"], "close", None)
    if close is not None:
        close()
    return {"busy": busy / wall, "wall_s": wall, "busy_s": busy, "samples_per_s": samples / wall,
            "epochs": epochs[0]}


def shm_free() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def busy(ctx: Ctx, args: argparse.Namespace, tmp: str, step: Callable[[torch.Tensor], torch.Tensor],
         rec: Recorder) -> dict:
    out: dict[str, Any] = rec.res.setdefault("busy", {})
    threads = os.cpu_count() or 1
    for pname, n in args.busy_profiles:
        if rec.out_of_time(10):
            out[pname] = {"skipped": "time budget"}
            log(f"  {pname}: skipped (time budget)")
            rec.save()
            continue
        p = B.PROFILES[pname]
        path = os.path.join(tmp, pname)
        recs = B.write_profile_dataset(path, p, n, compression="none")
        npy = path + ".npy"
        np.save(npy, recs)
        shape, dtype = recs.shape, str(recs.dtype)
        del recs
        ds = pyloader.ShardDataset(path, shuffle=True)
        ldr = pyloader.DataLoader(ds, batch_size=args.batch, num_workers=threads, device=ctx.dev)
        r: dict[str, Any] = {"records": n, "record_bytes": p.record_bytes, "batch_size": args.batch}
        out[pname] = r
        try:
            r["pyloader"] = busy_fraction(ctx, ldr, step, args.steps, args.warm, move=False)
            r["pyloader"].update(num_workers=threads, pool_slots=ldr._pool.created)
            log(f"  {pname} pyloader: busy {100 * r['pyloader']['busy']:.1f}%")
        except Exception as e:  # noqa: BLE001 - reported; torch's side still runs
            traceback.print_exc()
            r["pyloader"] = {"error": repr(e)}
        del ldr
        rec.save()
        best: dict[str, Any] | None = None
        r["torch"] = {}
        batch_bytes = args.batch * (p.record_bytes + 8)
        r["torch_best"] = None
        for w in args.torch_workers:
            if rec.out_of_time(5):
                r["torch"][f"w{w}"] = {"skipped": "time budget"}
                log(f"  {pname} torch w={w}: skipped (time budget)")
                continue
            # Worker batches travel through /dev/shm: skip what would not fit there.
            need = 2 * w * 2 * batch_bytes  # workers x prefetch_factor 2, with room to spare
            if w > 0 and need > shm_free():
                r["torch"][f"w{w}"] = {"skipped": f"/dev/shm has {shm_free() >> 20} MB free, needs ~{need >> 20} MB"}
                print(f"  {pname} torch w={w}: skipped ({r['torch'][f'w{w}']['skipped']})", file=sys.stderr)
                continue
            try:
                dl = torch.utils.data.DataLoader(
                    B.MemmapDataset(npy, shape, dtype), batch_size=args.batch, shuffle=True, num_workers=w,
                    pin_memory=ctx.cuda, persistent_workers=w > 0, generator=torch.Generator().manual_seed(0))
                b = busy_fraction(ctx, dl, step, args.steps, args.warm, move=True)
                del dl
            except Exception as e:  # noqa: BLE001 - a failed configuration is reported, the rest still runs
                r["torch"][f"w{w}"] = {"error": repr(e)}
                log(f"  {pname} torch w={w}: FAILED {e!r}")
                rec.save()
                continue
            b["num_workers"] = w
            r["torch"][f"w{w}"] = b
            log(f"  {pname} torch w={w}: busy {100 * b['busy']:.1f}%")
            if best is None or b["busy"] > best["busy"]:
                best = b
            r["torch_best"] = best
            rec.save()
        print_busy_row(pname, r)
    return out


# -- report ----------------------------------------------------------------------------------
# Each part of the table is printed (stdout) as soon as its figures exist, and once more,
# all together, at the end; print_table also reads a partial JSON (--report).
H2D_LABELS = {"raw_pinned": "torch copy_, pinned src", "raw_pageable": "torch copy_, pageable src",
              "engine_direct": "pyloader engine (_C.CopyEngine)", "engine_stage": "pyloader DeviceStage.submit_host",
              "loader": "pyloader DataLoader"}


def print_h2d(a: dict[str, Any]) -> None:
    if "gbps" not in a:
        print("\n(a) H2D: no round completed")
        return
    cut = f", {a['rounds_done']} rounds" if a.get("cut_short") else ""
    title = f"(a) H2D, {a['segment_bytes'] >> 20} MB segments{cut}"
    print(f"\n{title:<42}{'GB/s':>8}{'/raw pinned':>13}")
    for k, label in H2D_LABELS.items():
        if k not in a["gbps"]:
            continue
        if k == "loader":
            label += f"({a['loader_threads']} thr)"
        r = a["over_raw_pinned"].get(k)
        print(f"  {label:<40}{a['gbps'][k]:>8.2f}{'' if r is None else f'{r:>12.2f}x'}")
    print("  (target: engine / raw pinned >= 0.9)", flush=True)


def print_busy_header(s: dict[str, Any], batch: int) -> None:
    print(f"\n(b) busy fraction, step = {s['k']} x {s['matmul_n']}^2 {s['dtype'].split('.')[-1]} matmuls "
          f"= {s['chain_ms']:.1f} ms, batch {batch}")
    print(f"  {'records':<10}{'pyloader':>10}{'torch DL':>10}{'  (best num_workers)':<22}{'samples/s py/torch':>19}",
          flush=True)


def print_busy_row(name: str, v: dict[str, Any]) -> None:
    if "skipped" in v:
        print(f"  {name:<10}{'skipped':>10}  ({v['skipped']})", flush=True)
        return
    py, tb = v.get("pyloader", {}), v.get("torch_best")
    py_s = f"{100 * py['busy']:>9.1f}%" if "busy" in py else f"{'FAILED' if py else 'not run':>10}"
    tb_s = f"{100 * tb['busy']:>9.1f}%  (w={tb['num_workers']:<3})" if tb else f"{'n/a':>10}  (none ran)"
    ratio = f"{py['samples_per_s'] / tb['samples_per_s']:>10.2f}x" if tb and "busy" in py else ""
    print(f"  {name:<10}{py_s}{tb_s:<22}{'':<2}{ratio:>17}", flush=True)


def print_table(res: dict[str, Any]) -> None:
    where = res.get("gpu", "cpu (script check only)")
    print(f"\n== summary: {where}; torch {res['environment']['torch']}, {res['environment']['cpus']} cpus; "
          f"medians of {res['config']['rounds']} interleaved rounds")
    if res.get("h2d"):
        print_h2d(res["h2d"])
    s = res.get("step")
    if s and res.get("busy"):
        print_busy_header(s, res["config"]["batch"])
        for k, v in res["busy"].items():
            print_busy_row(k, v)
    for name, err in res.get("errors", {}).items():
        print(f"\n({name} FAILED: {err})")
    print(f"\n({res.get('wall_s', 0):.0f} s{'' if res.get('finished') else ', UNFINISHED'})", flush=True)


def failed(res: dict[str, Any]) -> bool:
    busy_parts = res.get("busy", {}).values()
    return (bool(res.get("errors")) or not res.get("finished") or bool(res.get("h2d", {}).get("cut_short"))
            or any("error" in v.get("pyloader", {}) or "skipped" in v for v in busy_parts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller rounds (about a minute on a GPU)")
    ap.add_argument("--steps", type=int, help="timed steps per busy-fraction run")
    ap.add_argument("--rounds", type=int, help="interleaved rounds for the H2D figures")
    ap.add_argument("--json", help="results, rewritten after every measurement")
    ap.add_argument("--budget-s", type=float, help="start nothing after this many seconds; print what was measured")
    ap.add_argument("--report", metavar="JSON", help="only print the table of a (partial) results file")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            res = json.load(f)
        print_table(res)
        return 1 if failed(res) else 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log(f"gpu_bench.py: no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda}); "
            "use --device cpu to check the script")
        return 2
    t_start = time.perf_counter()
    ctx = Ctx(args.device)
    q = args.quick or not ctx.cuda
    args.segment_bytes = 64 << 20 if ctx.cuda else 16 << 20
    args.record_bytes = 1 << 20 if ctx.cuda else 256 << 10
    args.big_records = (512 if args.quick else 1024) if ctx.cuda else 256  # 0.5 or 1 GB (64 MB on the CPU)
    args.h2d_bytes = ((1 << 30) if args.quick else (4 << 30)) if ctx.cuda else (256 << 20)
    args.depth = 2
    args.rounds = args.rounds or ((3 if args.quick else 5) if ctx.cuda else 2)
    args.batch = 256
    if args.steps is None:
        args.steps = (50 if args.quick else 200) if ctx.cuda else 10
    args.warm = 5 if q else 20
    if ctx.cuda:
        args.busy_profiles = [("image12k", 4000), ("blob150k", 1000)] if args.quick else [("image12k", 20000),
                                                                                            ("blob150k", 4000)]
        args.torch_workers = [4, 8] if args.quick else [4, 8, 16]
    else:
        args.busy_profiles = [("image12k", 1500), ("blob150k", 300)]
        args.torch_workers = [0, 2]
    env = B.environment()
    env["dev_shm_free_mb"] = shm_free() >> 20
    res: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "environment": env,
                           "device": str(ctx.dev), "errors": {}, "finished": False}
    if ctx.cuda:
        res["gpu"] = torch.cuda.get_device_name(ctx.dev)
    rec = Recorder(res, args.json, args.budget_s, t_start)
    rec.save()
    with warnings.catch_warnings(record=True) as caught, tempfile.TemporaryDirectory(prefix="pyloader-gpu-") as tmp:
        warnings.simplefilter("always")
        log("== (a) H2D")
        try:
            print_h2d(h2d(ctx, args, tmp, rec))
        except Exception as e:  # noqa: BLE001 - one device call: report it and still run (b)
            traceback.print_exc()
            res["errors"]["h2d"] = repr(e)
            rec.save()
        log("== (b) busy fraction")
        if rec.out_of_time(20):
            res["errors"]["busy"] = "not started: time budget"
            log("  not started: time budget")
        else:
            try:
                step, res["step"] = make_step(ctx, 5.0)
                log(f"  step: {res['step']}")
                rec.save()
                print_busy_header(res["step"], args.batch)
                busy(ctx, args, tmp, step, rec)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res["errors"]["busy"] = repr(e)
        res["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    res["finished"] = True
    rec.save()
    print_table(res)
    if res["warnings"]:
        print("warnings: " + "; ".join(res["warnings"]))
    return 1 if failed(res) else 0


if __name__ == "__main__":
    sys.exit(main())
