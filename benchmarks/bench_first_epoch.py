"""First epoch vs steady state, and the cost of an epoch boundary, measured side by side.

For 12 KB image-like, 8 KB token and 150 KB raw records (no compression), each run in a
fresh process with the page cache hot (the files are read once before each run; with
``--warm-by cold-epoch`` their pages are dropped and read back by one in-order epoch of the
same build in a process of its own: the page cache as an earlier job's cold epoch leaves
it, whose folio sizes decide what mapping the files costs), as a restarted job sees them:

1. time to the first batch (from building the DataLoader), the first epoch's rate and the
   best of three later epochs (the steady state) of ``pyloader.DataLoader(num_workers=2)``,
   for the same records written as shard format version 2 (XXH3-64 checksums, what the
   writer writes) and as version 1 (XXH64: every checksum of the same files recomputed),
   so the first-read verification cost of each is seen on the same bytes;
2. the steady state against the two-thread memcpy bandwidth measured in the same process;
3. epoch boundaries: the gap between the last batch of epoch e and the first of e+1 over
   the median gap between batches inside an epoch, with the next epoch started ahead
   (NOTE [epoch ahead] in pyloader/loader/dataloader.py) and without (as before it);
4. the first epoch once more, as a training script sees it: the loader built, then the
   script builds its model (here: waits until the loader's constructor has prepared its
   batch slots, NOTE [prepared slots] in csrc/core/slot_pool.cpp, and reports how long that
   took), then the first epoch from ``iter()`` -- what is left of the first epoch's extra
   cost once the kernel no longer has to hand the process new pages for its batch buffers
   (shards still mapped afresh). Variants 1-3 time the first epoch from the constructor,
   with the preparation running alongside;
5. ``v2-pause``: the loader built, then a 1 s pause (a script building its model), then the
   first epoch timed from ``iter()``;
6. which records are hashed: every child shares one record of verified shard files (NOTE
   [verified files] in csrc/core/shard_reader.cpp; ``PYLOADER_CACHE_DIR`` set to a folder of
   this run; one untimed run per dataset fills it before the rounds), so the files are not
   hashed again -- as a restarted job sees them. ``v2-hash`` and ``v1`` run with an empty record instead: the first
   process ever to read the files, which hashes every record (XXH3-64 in v2, XXH64 in v1);
7. ``CPU``: the process's CPU time of a steady epoch over the first epoch's (from where the
   first epoch is timed): the same ratio, less moved by other work on a shared machine;
8. the measured limit, in every child after its epochs: a steady epoch plus what a fresh
   process cannot avoid -- mapping every page of the shard files (``mmap`` +
   ``MADV_POPULATE_READ`` of the same files again) and the thread time the loader spent
   populating its new batch memory -- spread over the loader's two threads:
   ``limit = steady_s / (steady_s + (map_s + alloc_s) / 2)``;
9. after a pause: the machine's own cost of an idle second. In the ``pause`` variants the
   child, after its steady epochs, pauses as long again and times one more epoch of the
   same warm loader; "first epoch / warm after pause" is the first epoch's rate over that
   epoch's. On a virtual machine of a shared host the process's memory leaves the CPU
   caches while it idles, and the first milliseconds after run several times slower
   (here: ``iter()`` of a warm loader 0.2 ms at once, 5-7 ms after 1 s idle).

Runs are interleaved (round 1 of every variant, then round 2, ...) and medians reported,
because this machine is shared and noisy. Writes JSON and prints a table of ratios.

    python benchmarks/bench_first_epoch.py [--mb 480] [--rounds 5] [--profiles image12k,tokens8k,blob150k]
        [--baseline ROOT]  (another checkout, its _C built: the same variants, interleaved, labelled "base";
                            its runs keep their own record of verified files, filled by one untimed run of it)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _to_v1(src: str, dst: str) -> None:
    """Copies the version 2 dataset at ``src`` to ``dst`` as version 1: every checksum XXH64."""
    from pyloader import _C
    from pyloader.format import spec as _format

    shutil.copytree(src, dst)
    mpath = os.path.join(dst, "manifest.json")
    with open(mpath, "rb") as fh:
        body = _format.parse_manifest(fh.read(), mpath, _C.xxh64)
    for s in body["shards"]:
        path = os.path.join(dst, s["path"])
        with open(path, "rb") as fh:
            data = bytearray(fh.read())
        nrec, nfield = struct.unpack_from("<QI", data, 16)
        schema_off, schema_size, index_off, index_size, payload_off = struct.unpack_from("<QQQQQ", data, 32)
        for k in range(nrec * nfield):
            pos = index_off + 32 * k
            off, stored = struct.unpack_from("<QI", data, pos)
            start = payload_off + off
            struct.pack_into("<Q", data, pos + 24, _C.xxh64(memoryview(data)[start:start + stored]))
        struct.pack_into("<I", data, 8, 1)
        struct.pack_into("<Q", data, 88, _C.xxh64(bytes(data[schema_off:schema_off + schema_size])))
        struct.pack_into("<Q", data, 96, _C.xxh64(bytes(data[index_off:index_off + index_size])))
        struct.pack_into("<Q", data, 120, _C.xxh64(bytes(data[:120])))
        with open(path, "wb") as fh:
            fh.write(data)
        s["bytes"], s["xxh64"] = len(data), f"{_C.xxh64(bytes(data)):016x}"
    with open(mpath, "wb") as fh:
        fh.write(_format.dump_manifest(body, _C.xxh64))


def _read_all(path: str) -> None:
    """Puts the dataset's files in the page cache."""
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb", buffering=0) as fh:
            while fh.read(1 << 24):
                pass


def map_all_s(path: str) -> float:
    """Seconds to map every page of the dataset's (cached) files into this process once more."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    maps = []
    t = time.perf_counter()
    for name in sorted(os.listdir(path)):
        if not name.endswith(".pyl"):
            continue
        with open(os.path.join(path, name), "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        a = np.frombuffer(m, np.uint8)
        if libc.madvise(ctypes.c_void_p(a.ctypes.data), len(m), 22) != 0:  # MADV_POPULATE_READ (Linux 5.14)
            int(a[::4096].sum())
        del a
        maps.append(m)
    dt = time.perf_counter() - t
    for m in maps:
        m.close()
    return dt


def child(path: str, batch: int, shuffle: bool, ahead: bool, epochs: int, settle: bool = False,
          pause: float = 0.0) -> dict[str, Any]:
    """One fresh process: first epoch, steady state, boundaries, memcpy, the limit.

    ``settle``: the first epoch is timed from ``iter()``, once the loader built before it
    has prepared its batch slots (as after a script's model building); ``pause``: from
    ``iter()`` after that many seconds; else from the constructor.
    """
    t_import = time.perf_counter()
    import pyloader
    from pyloader.bench import measure as B

    import_s = time.perf_counter() - t_import
    t0, c0 = time.perf_counter(), time.process_time()
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=shuffle, seed=0), batch_size=batch,
                                 num_workers=2)
    prepare_s = None
    if settle:
        pool = loader._batch_pool
        assert pool is not None
        while pool.preparing and time.perf_counter() - t0 < 30:
            time.sleep(0.001)
        prepare_s = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
    if pause:
        time.sleep(pause)
        t0, c0 = time.perf_counter(), time.process_time()
    if not ahead:
        loader._reads_ahead = lambda: False  # type: ignore[method-assign]  # the loader as it was before
    first_batch = None
    n = 0
    for b in loader:
        if first_batch is None:
            first_batch = time.perf_counter() - t0
        n += int(b["label"].shape[0])
        del b
    first_s, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    first_verified = loader.stats()["verified_bytes"]
    rates, cpus, inside, boundary = [], [], [], []
    last = None
    for _ in range(epochs):
        t, c = time.perf_counter(), time.process_time()
        start = True
        for b in loader:
            now = time.perf_counter()
            if last is not None:
                (boundary if start else inside).append(now - last)
            start = False
            del b
            last = time.perf_counter()
        rates.append(n / (time.perf_counter() - t))
        cpus.append(time.process_time() - c)
    payload = loader.stats()["decoded_bytes"]  # of one epoch (the last)
    steady = max(rates)
    warm_after_pause = None
    if pause:  # the warm loader after the same pause: what the pause alone costs (9. in the docstring)
        time.sleep(pause)
        t = time.perf_counter()
        for b in loader:
            del b
        warm_after_pause = n / (time.perf_counter() - t)
    pool = loader._batch_pool
    alloc_s = pool.memory()["driver_alloc_s"] if pool is not None else 0.0
    map_s = map_all_s(path)
    steady_s = n / steady
    return {"import_s": import_s, "first_batch_s": first_batch, "first_epoch_s": first_s, "records": n,
            "first_rate": n / first_s, "steady_rate": steady, "first_vs_steady": n / first_s / steady,
            "steady_gbps": steady * payload / n / 1e9, "memcpy_2t_gbps": B.memcpy_gbps(2),
            "gap_inside_s": statistics.median(inside), "gap_boundary_s": statistics.median(boundary),
            "boundary_vs_inside": statistics.median(boundary) / statistics.median(inside),
            "started_ahead": loader.stats()["started_ahead"], "slots": loader._pool.created,
            "prepare_s": prepare_s, "first_verified_bytes": first_verified, "alloc_s": alloc_s, "map_s": map_s,
            "limit": steady_s / (steady_s + (map_s + alloc_s) / 2), "first_cpu_s": first_cpu,
            "first_vs_steady_cpu": min(cpus) / first_cpu, "warm_after_pause_rate": warm_after_pause,
            "first_vs_warm_after_pause": n / first_s / warm_after_pause if warm_after_pause else None}


VARIANTS = {  # tag: (version, ahead, settle, pause_s, record of verified files)
    "v2": ("v2", True, False, 0.0, "shared"),
    "v2-pause": ("v2", True, False, 1.0, "shared"),
    "v2-built-ahead": ("v2", True, True, 0.0, "shared"),
    "v2-no-ahead": ("v2", False, False, 0.0, "shared"),
    "v2-hash": ("v2", True, False, 0.0, "empty"),
    "v1": ("v1", True, False, 0.0, "empty"),
}
BASE_VARIANTS = ("v2", "v2-pause")  # run on --baseline too, tagged "base v2", "base v2-pause"
KEYS = ("first_vs_steady_cpu", "first_batch_s", "first_rate", "steady_rate", "first_vs_steady", "steady_gbps", "memcpy_2t_gbps",
        "gap_inside_s", "gap_boundary_s", "boundary_vs_inside", "first_verified_bytes", "alloc_s", "map_s", "limit")


COLD_EPOCH = """
import sys
import pyloader
for _ in pyloader.DataLoader(pyloader.ShardDataset(sys.argv[1], shuffle=False), batch_size=256, num_workers=2):
    pass
"""


def _warm(path: str, how: str, env: dict[str, str]) -> None:
    """Puts the dataset's files in the page cache: read whole (``read``), or dropped and then
    read by one in-order epoch of the same pyloader in a process of its own (``cold-epoch``:
    the page cache as a job that read the files cold leaves it for the next)."""
    if how == "read":
        _read_all(path)
        return
    from pyloader.bench import measure as B

    B.drop_pages([os.path.join(path, n) for n in os.listdir(path)])
    subprocess.run([sys.executable, "-c", COLD_EPOCH, path], check=True, env=env, timeout=600)


def run_child(path: str, args: argparse.Namespace, *, ahead: bool, epochs: int, settle: bool = False,
              pause: float = 0.0, root: str = ROOT, cache: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), PYLOADER_CACHE_DIR=cache)
    _warm(path, args.warm_by, env)
    extra = ["--settle", "1"] if settle else []
    out = subprocess.run([sys.executable, __file__, "--child", path, "--batch", str(args.batch),
                          "--shuffle", str(int(args.shuffle)), "--ahead", str(int(ahead)), "--epochs", str(epochs),
                          "--pause", str(pause), *extra], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=480, help="dataset size per profile (MB)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=4, help="epochs after the first, per run")
    ap.add_argument("--shuffle", type=int, default=1)
    ap.add_argument("--profiles", default="image12k,tokens8k,blob150k")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which of: " + ", ".join(VARIANTS))
    ap.add_argument("--baseline", help="another checkout (its _C built) to run the v2 and v2-pause variants of too")
    ap.add_argument("--warm-by", choices=("read", "cold-epoch"), default="read",
                    help="how the page cache is made hot before each run: the files read whole, or one in-order "
                         "epoch of the same build from a cold page cache (what a job that read them leaves)")
    ap.add_argument("--out", default="bench_results/first_epoch.json")
    ap.add_argument("--child")
    ap.add_argument("--ahead", type=int, default=1)
    ap.add_argument("--settle", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--pause", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch, bool(args.shuffle), bool(args.ahead), args.epochs,
                               bool(args.settle), args.pause)))
        return 0

    from pyloader.bench import measure as B

    unknown = [n for n in args.profiles.split(",") if n not in B.PROFILES]
    if unknown:
        ap.error(f"--profiles: unknown profile(s) {', '.join(map(repr, unknown))}; choose from "
                 f"{', '.join(sorted(B.PROFILES))}")
    tags = args.variants.split(",")
    if any(t not in VARIANTS for t in tags):
        ap.error(f"--variants: choose from {', '.join(VARIANTS)}")
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "pyloader")):
        ap.error(f"--baseline {args.baseline!r}: not a checkout (no pyloader/ in it); pass the root of one")
    results: dict[str, Any] = {"config": vars(args), "environment": B.environment(), "profiles": {}}
    labels = list(tags) + ([f"base {t}" for t in BASE_VARIANTS] if args.baseline else [])
    with tempfile.TemporaryDirectory(prefix="pyloader-first-epoch-") as tmp:
        shared = os.path.join(tmp, "cache")  # one record of verified files for the run (NOTE [verified files])
        variants: list[tuple[str, str, str, str, bool, bool, float, str]] = []
        for name in args.profiles.split(","):
            p = B.PROFILES[name]
            paths = {"v2": os.path.join(tmp, f"{name}-v2"), "v1": os.path.join(tmp, f"{name}-v1")}
            B.write_profile_dataset(paths["v2"], p, int(args.mb * 1e6 / p.record_bytes), compression="none", version=2)
            if "v1" in tags:
                _to_v1(paths["v2"], paths["v1"])
            for label in labels:
                base = label.startswith("base ")
                version, ahead, settle, pause, store = VARIANTS[label.removeprefix("base ")]
                variants.append((name, label, paths[version], args.baseline if base else ROOT, ahead, settle, pause,
                                 f"base-{store}" if base else store))
        os.sync()  # the datasets just written go to disk now, not as writeback during the runs
        time.sleep(2.5)  # older than the window in which a changed file is not recorded as verified
        # The baseline keeps its own record (its format may be another), filled the same way.
        shared_base = os.path.join(tmp, "cache-base")
        for name in args.profiles.split(","):  # the job's first run ever, untimed: records the files as verified
            if any(VARIANTS[t][4] == "shared" for t in tags):
                run_child(os.path.join(tmp, f"{name}-v2"), args, ahead=True, epochs=2, cache=shared)
            if args.baseline and any(VARIANTS[t][4] == "shared" for t in BASE_VARIANTS):
                run_child(os.path.join(tmp, f"{name}-v2"), args, ahead=True, epochs=2, root=args.baseline,
                          cache=shared_base)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for k, (name, label, path, root, ahead, settle, pause, store) in enumerate(variants):
                cache = ({"shared": shared, "base-shared": shared_base}.get(store)
                         or os.path.join(tmp, f"empty-{r}-{k}"))
                res = run_child(path, args, ahead=ahead, epochs=args.epochs, settle=settle, pause=pause, root=root,
                                cache=cache)
                runs.setdefault((name, label), []).append(res)
                print(f"[round {r + 1}/{args.rounds}] {name} {label}: first/steady {res['first_vs_steady']:.2f} "
                      f"(limit {res['limit']:.2f}), first batch {1e3 * res['first_batch_s']:.1f} ms, hashed "
                      f"{res['first_verified_bytes'] / 1e6:.0f} MB", file=sys.stderr, flush=True)
    med = statistics.median
    for name in args.profiles.split(","):
        out: dict[str, Any] = {}
        for label in labels:
            rs = runs[(name, label)]
            out[label] = {"runs": rs, **{k: med([x[k] for x in rs]) for k in KEYS}}
            out[label]["steady_vs_memcpy_2t"] = med([x["steady_gbps"] / x["memcpy_2t_gbps"] for x in rs])
            if VARIANTS[label.removeprefix("base ")][2]:
                out[label]["prepare_s"] = med([x["prepare_s"] for x in rs])
            if rs[0]["warm_after_pause_rate"]:
                out[label]["warm_after_pause_vs_steady"] = med([x["warm_after_pause_rate"] / x["steady_rate"] for x in rs])
                out[label]["first_vs_warm_after_pause"] = med([x["first_vs_warm_after_pause"] for x in rs])
        results["profiles"][name] = out
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"medians of {args.rounds} interleaved rounds, {args.mb:.0f} MB per dataset, batch {args.batch}, "
          f"{'shuffled' if args.shuffle else 'in order'}, 2 native threads, page cache hot (" + args.warm_by + "), fresh process per run"
          + (f"; base = {args.baseline}" if args.baseline else ""))
    print(f"{'profile':<10}{'variant':<17}{'first/steady':>13}{'(range)':>12}{'limit':>7}{'CPU':>6}{'1st batch ms':>13}"
          f"{'hashed MB':>10}{'map ms':>8}{'alloc ms':>9}{'steady/memcpy2t':>16}{'boundary/inside':>16}")
    for name in args.profiles.split(","):
        for label in labels:
            o, rs = results["profiles"][name][label], runs[(name, label)]
            lo, hi = min(x["first_vs_steady"] for x in rs), max(x["first_vs_steady"] for x in rs)
            print(f"{name:<10}{label:<17}{o['first_vs_steady']:>13.2f}{f'({lo:.2f}-{hi:.2f})':>12}{o['limit']:>7.2f}{o['first_vs_steady_cpu']:>6.2f}"
                  f"{1e3 * o['first_batch_s']:>13.1f}{o['first_verified_bytes'] / 1e6:>10.0f}{1e3 * o['map_s']:>8.1f}"
                  f"{1e3 * o['alloc_s']:>9.1f}{o['steady_vs_memcpy_2t']:>16.2f}{o['boundary_vs_inside']:>15.1f}x")
    for name in args.profiles.split(","):
        for label in labels:
            o, rs = results["profiles"][name][label], runs[(name, label)]
            if "first_vs_warm_after_pause" in o:
                lo, hi = (f(x["first_vs_warm_after_pause"] for x in rs) for f in (min, max))
                print(f"{name} {label}: the warm loader after the same pause ran {o['warm_after_pause_vs_steady']:.2f}x "
                      f"steady; the first epoch after the pause ran {o['first_vs_warm_after_pause']:.2f}x that "
                      f"({lo:.2f}-{hi:.2f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
