"""``pyloader bench [URL]``: the command line of the benchmark (pyloader.bench.stages measures).

``pyloader._cli`` wires it in with ``add_bench_parser(subparsers)`` and dispatches
``args.cmd == "bench"`` to ``run_bench(args)``. Building the parser imports no torch.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CollateError, PyloaderError, ShardNotFoundError, exit_code
from ..loader.autotune import cpu_budget
from . import au as A

if TYPE_CHECKING:
    from ..read.shards import ShardDataset

# The measuring modules (and torch, which they import) load in run_bench, not with the
# parser: `pyloader --help` and `pyloader bench --help` import no torch.

DEFAULT_RECORDS = 20000


def _generate(tmp: str, name: str, record_bytes: int, records: int, compression: str) -> str:
    from . import measure as B

    path = os.path.join(tmp, name)
    kind = "image"
    p = B.Profile(name, record_bytes, kind, name)
    B.write_profile_dataset(path, p, records, compression=compression, seed=0)
    return path


def _workload(args: argparse.Namespace) -> A.Workload | None:
    """The AU workload the options name (``None`` with ``--workload none``); options checked already."""
    if args.workload == "none":
        return None
    if args.workload == "custom":
        return A.Workload("custom", args.record_bytes or 0, args.au_batch_size, args.compute_time,
                          args.au_records or max(64, 4 * args.au_batch_size))
    w = A.WORKLOADS[args.workload]
    if args.au_records:
        w = A.Workload(w.name, w.record_bytes, w.batch_size, w.compute_s, args.au_records)
    return w


def _check_shards_present(ds: Any) -> None:
    """A local dataset's shard files are all there before anything is measured; else ShardNotFoundError naming them.

    The storage stage reads the files directly: without this a missing one would end the
    run with a bare ``[Errno 2]`` after the first measurements.
    """
    if ds.is_remote:
        return
    gone = [p for p in ds.shard_paths if not os.path.exists(p)]
    if gone:
        more = f" and {len(gone) - 1} more" if len(gone) > 1 else ""
        raise ShardNotFoundError(errno.ENOENT, f"shard {gone[0]!r}{more} is listed in "
                                 f"{os.path.join(ds.root, 'manifest.json')!r} but its file is gone: the dataset is "
                                 "incomplete; copy the dataset folder again whole, or write it again (ShardWriter "
                                 "or `pyloader convert`)")


def _bench_result(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    from ..loader.packing import PackSpec
    from ..read.shards import ShardDataset
    from ..transform.image import ImageDecode
    from . import diagnosis
    from . import measure as B
    from . import stages as R

    tmp = tempfile.mkdtemp(prefix="pyloader-bench-")
    result: dict[str, Any] = {
        "schema_version": R.SCHEMA_VERSION,
        "environment": B.environment(),
        "config": {k: v for k, v in vars(args).items() if k not in ("cmd", "func")},
    }
    try:
        url = args.url
        if url is None:
            p = B.PROFILES["image12k"]
            progress(f"generating the embedded dataset: {args.records} x {p.description}, LZ4")
            url = os.path.join(tmp, "data")
            B.write_profile_dataset(url, p, args.records, compression="lz4", seed=0)
        # The data path itself: encoded fields (images) are measured as the bytes they are.
        ds = ShardDataset(url, cache_dir=args.cache_dir, decode=False) if args.url else ShardDataset(url)
        _check_shards_present(ds)
        result["dataset"] = {"url": url if args.url else None, "generated": args.url is None,
                             "records": ds.num_records, "shards": len(ds.shard_paths),
                             "bytes": sum(ds.shard_bytes), "fields": [f.to_json() for f in ds.fields]}
        spec = None
        if args.pack is not None:
            spec = PackSpec(seq_len=args.pack, mode=args.pack_mode,
                            lookahead=args.pack_lookahead if args.pack_mode == "first_fit" else None)
            if args.url:
                spec.resolve_field(ds.fields)  # a dataset without a token field fails now, not after the stages
        stages = R.run_stages(ds, batch_size=args.batch_size, threads=args.threads, epochs=args.epochs,
                              torch_workers=args.torch_workers, progress=progress, min_seconds=args.min_seconds)
        result["stages"] = stages
        result["diagnosis"] = diagnosis.diagnose(stages)
        if args.transform is not None or (args.image_size is not None):
            fn = _load_transform(args.transform) if args.transform else None
            decode = None if args.image_size is None else ImageDecode(size=args.image_size, crop="random", flip=True)

            def make_ds(**kw: Any) -> ShardDataset:
                return ShardDataset(url, cache_dir=args.cache_dir if args.url else None, **kw)

            try:
                result["transform"] = R.run_transform_stage(
                    make_ds, fn, executor=args.executor, decode=decode, batch_size=args.batch_size,
                    threads=cpu_budget() if args.threads == "auto" else args.threads, epochs=args.epochs,
                    torch_workers=args.torch_workers,
                    min_seconds=args.min_seconds, progress=progress)
            except CollateError as e:
                raise CollateError(_collate_advice(str(e), args, ds)) from None
            result["transform"]["function"] = args.transform

        if spec is not None:
            pack_url = url if args.url else _generate_documents(tmp, args.records, progress)

            def make_pack_ds() -> ShardDataset:
                return ShardDataset(pack_url, cache_dir=args.cache_dir if args.url else None, shuffle=True)

            result["packing"] = R.run_pack_stage(
                make_pack_ds, spec, rows=args.pack_rows, threads=cpu_budget() if args.threads == "auto" else args.threads,
                epochs=args.epochs, min_seconds=args.min_seconds, progress=progress)
            result["packing"]["generated"] = args.url is None

        w = _workload(args)
        if w is not None:
            if args.url is None:
                progress(f"generating the {w.name} dataset: {w.records} x {w.record_bytes / 1e3:.1f} KB records")
                au_path = _generate(tmp, f"au-{w.name}", w.record_bytes, w.records, "none")
                source = "generated"
            else:
                # The user's own records: their size, not the preset's, is what the loaders move.
                py = stages["pyloader"]
                w = A.Workload(w.name, round(py["bytes"] / max(py["samples"], 1)), w.batch_size, w.compute_s,
                               ds.num_records)
                au_path, source = url, "dataset"
            result["accelerator_utilization"] = R.run_au(
                au_path, w, cache_dir=args.cache_dir, threads=args.au_threads, torch_workers=args.au_torch_workers,
                batches=A.au_batches(w, args.au_seconds), threshold=args.au_threshold,
                cap=args.max_accelerators, budget_s=args.au_budget, progress=progress)
            result["accelerator_utilization"]["workload"]["records_from"] = source
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _collate_advice(message: str, args: argparse.Namespace, ds: ShardDataset) -> str:
    """A collation error of the transform stage, with its fix in this command's options (not Python's)."""
    what = message.split("; every sample of a batch", 1)[0]
    images = [f.name for f in ds.fields if f.encoding is not None]
    fixes = []
    if images and args.image_size is None:
        fixes.append(f"pass --image-size N to decode the image field{'s' if len(images) > 1 else ''} "
                     f"({', '.join(map(repr, images))}) to N x N")
    if args.transform:
        fixes.append(f"make --transform {args.transform} return one shape for every sample (for sequences, pad or "
                     "cut to a fixed length)")
    return f"{what}; every sample of a batch needs one shape and dtype: {', or '.join(fixes) or 'pass --image-size N'}"


def _generate_documents(tmp: str, records: int, progress: Any) -> str:
    """A token dataset for the packing stage: ``records`` int32 documents of log-normal lengths (mean ~800)."""
    from ..write.writer import ShardWriter

    progress(f"generating the packing dataset: {records} token documents, log-normal lengths")
    path = os.path.join(tmp, "documents")
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(800) - 0.5, 1.0, records), 1, 32768).astype(np.int64)
    with ShardWriter(path, {"tokens": ("int32", (None,))}, compression=None) as w:
        for n in lengths:
            w.write({"tokens": rng.integers(1, 50_000, int(n), dtype=np.int32)})
    return path


def _print_packing(p: dict[str, Any]) -> None:
    la = f", lookahead {p['lookahead']}" if p["mode"] == "first_fit" else ""
    print(f"\n  packing stage: {p['field']!r} into rows of {p['seq_len']} tokens ({p['mode']}{la}, "
          f"{p['rows_per_batch']} rows per batch, {p['threads']} threads)")
    print(f"    packed               {p['tokens_per_s'] / 1e6:>10.1f} M tokens/s")
    print(f"    read unpacked        {p['unpacked_tokens_per_s'] / 1e6:>10.1f} M tokens/s "
          f"(packed / unpacked: {p['packed_vs_unpacked']:.2f}x)")
    print(f"    padding {100 * p['padding_fraction']:.2f}% of row tokens; {p['split_documents']} documents split "
          f"over rows, {p['truncated_tokens']} tokens truncated")
    print(f"    packer thread: building rows {100 * p['packer_busy']:.0f}% of the time, waiting for documents "
          f"{100 * p['packer_waiting']:.0f}%; the consumer waited {100 * p['wait_fraction']:.0f}%")
    print(f"    bound: {p['bound']}")


def _load_transform(spec: str) -> Any:
    """The function ``MODULE:FUNCTION`` names (the module importable from the current directory)."""
    mod_name, _, fn_name = spec.partition(":")
    if "" in (mod_name, fn_name):
        raise ValueError(f"--transform {spec!r}: expected MODULE:FUNCTION, e.g. mytransforms:augment")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--transform {spec!r}: cannot import {mod_name!r}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--transform {spec!r}: {mod_name} has no function {fn_name!r}")
    return fn


def _print_transform(t: dict[str, Any]) -> None:
    name = t["function"] or "image decoding"
    w, wo, tc = t["with_transform"], t["without_transform"], t["torch_dataloader"]
    kind = {"threads": "thread", "processes": "process"}[t["executor"]]
    print(f"\n  transform stage: {name} on {t['workers']} {kind} workers")
    choice = t.get("executor_choice")
    if choice:
        print(f"    executor='{t['executor_asked']}' chose {choice.get('executor') or 'threads, for now'}: "
              f"{choice.get('why', '')}")
    print(f"    pyloader with it      {w['samples_per_s']:>12,.0f} samples/s")
    print(f"    pyloader without it   {wo['samples_per_s']:>12,.0f} samples/s")
    print(f"    torch DataLoader      {tc['samples_per_s']:>12,.0f} samples/s (num_workers={tc['num_workers']}, "
          f"the transform in its workers)")
    limit = t["limit_samples_per_s"]
    print(f"    per sample: {t['per_sample_us']:.0f} us of transform and decoding on a worker"
          + (f" (limit with {t['workers']} workers: {limit:,.0f} samples/s)" if limit else ""))
    m = t["measured"]
    print(f"    share of each sample's time in the loader: {100 * t['share_of_sample_time']:.0f}%; workers busy "
          f"{100 * t['workers_busy']:.0f}%, the consumer waited {100 * t['wait_fraction']:.0f}% (over the "
          f"{m['batches']} batches of {m['epochs']} timed epoch{'s' if m['epochs'] != 1 else ''}, "
          f"{m['wall_s']:.2f} s)")
    if t["skipped_samples"]:
        print(f"    skipped samples (undecodable images): {t['skipped_samples']}")
    c = t["ceiling"]
    print(f"    ceiling               {c['samples_per_s']:>12,.0f} samples/s ({c['processes']} processes running it "
          f"alone on {c['samples']} samples held in memory)")
    print(f"    first epoch (from building the loader): pyloader {t['first_epoch_samples_per_s']:,.0f} samples/s, "
          f"torch DataLoader {t['torch_first_epoch_samples_per_s']:,.0f} samples/s")
    print(f"    pyloader / torch DataLoader with the transform: {t['speedup_vs_torch']:.2f}x")
    print(f"    pyloader / ceiling: {t['of_ceiling']:.2f}")
    print(f"    first epoch: pyloader / torch DataLoader {t['first_epoch_vs_torch']:.2f}x, pyloader's first epoch / "
          f"its steady epochs {t['first_epoch_vs_steady']:.2f}")
    print(f"    {t['hint']}")


def _print_bench(r: dict[str, Any]) -> None:
    st, d, dg = r["stages"], r["dataset"], r["diagnosis"]
    print(f"\npyloader bench: {d['records']} records in {d['shards']} shards, {d['bytes'] / 1e6:.1f} MB stored")
    rows = []
    rf = st.get("remote_fetch")
    if rf:
        speed = f"{rf['gbps']:.3f} GB/s" if rf["gbps"] else "all cached"
        how = f", {rf['transport']}, {rf['jobs']} at once" if rf.get("transport") else ""
        rows.append((f"remote fetch ({rf['shards_downloaded']} shards{how})", speed, rf["cpu_s"]))
    rows.append((f"storage read ({st['storage_read'].get('threads', 1)} thr)",
                 f"{st['storage_read']['gbps']:.2f} GB/s", st["storage_read"]["cpu_s"]))
    cr = st.get("cold_read")
    if cr:
        rows.append(("cold sequential read (1 thr, best of 2)", f"{cr['seq_gbps']:.2f} GB/s", None))
        for key, label in (("in_order", "in order"), ("shuffled", "shuffled")):
            e = cr[key]
            speed = f"{e['gbps']:.2f} GB/s"
            if e["of_seq"]:
                speed += f" = {e['of_seq']:.2f}x seq"
            if e.get("of_limit"):
                speed += f", {e['of_limit']:.2f}x limit"
            rows.append((f"cold epoch {label}, pyloader ({cr['threads']} thr)", speed, e["cpu_s"]))
    if st["decode"]:
        rows.append((f"LZ4 decode ({st['decode']['threads']} thr)", f"{st['decode']['gbps']:.2f} GB/s",
                     st["decode"]["cpu_s"]))
    rows.append((f"collation copy ({st['collate_limit']['threads']} thr)",
                 f"{st['collate_limit']['memcpy_gbps']:.2f} GB/s", st["collate_limit"]["cpu_s"]))
    for key, label in (("pyloader", f"pyloader, end to end ({st['pyloader']['threads']} thr)"),
                       ("torch_dataloader", f"torch DataLoader (workers={st['torch_dataloader']['num_workers']})")):
        s = st[key]
        rows.append((label, f"{s['samples_per_s']:,.0f} samples/s", s["cpu_s"]))
        rows.append((f"  steady: {s['epochs']} x {1e3 * s['epoch_s']:.0f} ms epochs", f"{s['gbps']:.2f} GB/s", None))
        if s.get("autotune"):
            a = s["autotune"]
            dl = f", {a['fetch_jobs']} downloads" if a.get("fetch_jobs") else ""
            rows.append((f"  auto-tuned: {a['threads']} threads, read-ahead {a['prefetch']}{dl}",
                         f"{a['memory_bytes'] / 2**20:.0f} of {a['memory_budget'] / 2**20:.0f} MiB", None))
        if "first_batch_s" in s:
            rows.append((f"  first epoch: {1e3 * s['startup_s']:.0f} ms, first batch {1e3 * s['first_batch_s']:.1f} ms",
                         f"{s['first_epoch_vs_steady']:.2f}x steady", None))
        if s.get("first_epoch_alloc_bytes"):
            rows.append((f"    of it new batch memory: {s['first_epoch_alloc_bytes'] / 2**20:.0f} MiB",
                         f"{1e3 * s['first_epoch_alloc_s']:.0f} ms thread time", None))
        if "paused_first_epoch_vs_steady" in s:
            rows.append((f"  after a {s['pause_s']:.0f} s pause: {1e3 * s['paused_first_epoch_s']:.0f} ms, 1st "
                         f"{1e3 * s['paused_first_batch_s']:.1f} ms", f"{s['paused_first_epoch_vs_steady']:.2f}x steady",
                         None))
            rows.append((f"    warm loader, same pause: {1e3 * s['paused_warm_epoch_s']:.0f} ms",
                         f"{s['paused_warm_epoch_vs_steady']:.2f}x steady", None))
    if st.get("h2d"):
        rows.append(("host-to-device (torch pinned)", f"{st['h2d']['gbps']:.2f} GB/s", None))
    w = max([22, *(len(val) for _, val, _ in rows)])
    print(f"  {'stage':<40}{'throughput':>{w}}{'CPU s':>8}")
    for name, val, cpu in rows:
        print(f"  {name:<40}{val:>{w}}{'' if cpu is None else f'{cpu:8.2f}'}")
    print("  (CPU s: the CPU time of every thread and child process, the loaders' live workers included, "
          "in the stage's timed run)")
    if cr and cr["in_order"].get("of_limit"):
        print("  (cold limit: what the machine allows a cold epoch: in order, the slower of the sequential read and "
              "the same loader's next epoch, warm; shuffled, the two one after the other, as a global shuffle's "
              "batches wait for (almost) the last read)")
    if st["pyloader"].get("first_epoch_alloc_bytes"):
        print("  (first epoch: from building the loader to the end of its first epoch; new batch memory: the "
              "batch buffers' pages the kernel populated in it, paid once per process, and the time that took, "
              "summed over the collating threads)")
    for wmsg in dg.get("warnings", []):
        print(f"\n  WARNING: {wmsg}")
    flag = " (see WARNING above)" if dg.get("warnings") else ""
    print(f"\n  pyloader / torch DataLoader: {dg['speedup_vs_torch']:.2f}x samples/s{flag}")
    print(f"  pyloader delivered {dg['loader_gbps']:.2f} GB/s (decoded). What it drew from each stage, "
          "against that stage's measured capacity:")
    print(f"    {'stage':<10}{'capacity':>12}{'drawn':>12}{'used':>8}  measured as")
    for name, row in dg["stages"].items():
        how = row["how"] + (f"; measured {row['measured_gbps']:.2f} GB/s, below what the loader's own epochs "
                            "show, raised to that (see the note)" if row.get("clamped") else "")
        print(f"    {name:<10}{row['capacity_gbps']:>7.2f} GB/s{row['demand_gbps']:>7.2f} GB/s"
              f"{100 * row['utilization']:>7.0f}%  {how}")
    if dg["bound"]:
        row = dg["stages"][dg["bound"]]
        if row.get("clamped") and row["utilization"] >= 0.995:
            print(f"  bound by: {dg['bound']}, at its limit (the loader drew {row['demand_gbps']:.2f} GB/s from it; "
                  f"measured apart: {row['measured_gbps']:.2f} GB/s, see the note)")
        else:
            print(f"  bound by: {dg['bound']}, at {100 * row['utilization']:.0f}% of its capacity "
                  f"({row['demand_gbps']:.2f} of {row['capacity_gbps']:.2f} GB/s)")
    else:
        print("  bound by: no measured stage")
    for n in dg["notes"]:
        print(f"  - {n}")
    if r.get("transform"):
        _print_transform(r["transform"])
    if r.get("packing"):
        _print_packing(r["packing"])
    au = r.get("accelerator_utilization")
    if au:
        w = au["workload"]
        where = ("this dataset" if w.get("records_from") == "dataset"
                 else f"a generated {w['name']} dataset")
        print(f"\n  accelerator utilization, {where}: {w['records']} records of {w['record_bytes'] / 1e3:.1f} KB, "
              f"batch {w['batch_size']}, {w['compute_s'] * 1e3:.1f} ms compute per batch ({w['name']}); "
              f"AU >= {100 * au['pyloader']['threshold']:.0f}% wanted")
        print(f"  {'accelerators':>14}{'AU pyloader':>14}{'AU torch':>12}")
        py = {t["accelerators"]: t for t in au["pyloader"]["trials"]}
        tc = {t["accelerators"]: t for t in au["torch_dataloader"]["trials"]}
        for n in sorted(set(py) | set(tc)):
            print(f"  {n:>14}{_au_cell(py.get(n)):>14}{_au_cell(tc.get(n)):>12}")
        print("  (AU: the median of the trials at that count, xN: N trials)")
        print(f"  max accelerators at AU >= {100 * au['pyloader']['threshold']:.0f}%: pyloader "
              f"{_au_count(au['pyloader'])}, torch DataLoader {_au_count(au['torch_dataloader'])}")
        for line in _au_stops(au):
            print(f"  ({line})")
        if au.get("shared_loader"):
            limited = any(t.get("prefetch_limit") == "memory" for key in ("pyloader", "torch_dataloader")
                          for t in au[key]["trials"])
            print("  (the accelerators of a trial share one loader, as one node's processes share its CPUs: "
                  "N x --au-threads threads, N x --au-torch-workers for torch, at most the CPUs this process may "
                  "use, and N batches read ahead"
                  + (f", at most the {au['memory_batches']} that fit in 40% of free memory" if limited else "")
                  + ": memory bounds the read-ahead, not the count; docs/bench.md)")


def _au_cell(t: dict[str, Any] | None) -> str:
    """One count's AU in the table: the median of its trials, and how many there were."""
    if t is None:
        return "-"
    k = len(t.get("au_trials") or [t["au"]])
    return f"{100 * t['au']:.1f}%" + (f" x{k}" if k > 1 else "")


def _au_count(r: dict[str, Any]) -> str:
    """A search's result: the maximum with its range, or a lower bound saying what stopped it (See NOTE [AU search])."""
    if not r.get("capped"):
        lo, hi = r.get("range") or (r["max_accelerators"], r["max_accelerators"])
        many = max((len(t.get("au_trials") or ()) for t in r.get("trials", ())), default=1)
        if lo == hi:
            return f"{r['max_accelerators']} (its trials agree)" if many > 1 else str(r["max_accelerators"])
        how = "at 95% confidence" if "crossing" in r else "where its trials disagree"
        return f"{r['max_accelerators']} ({lo} to {hi} {how}, {many} trials per count near it)"
    why = "time budget" if r.get("stopped_by") == "time" else "cap"
    below = f", fewer than {r['fails_at']}" if r.get("fails_at") else ""
    return f"at least {r['max_accelerators']}{below} ({why})"


def _au_stops(au: dict[str, Any]) -> list[str]:
    """Why a search stopped short of the maximum, and what lets it go further (one line per reason)."""
    lines: list[str] = []
    for key in ("pyloader", "torch_dataloader"):
        r = au[key]
        if not r.get("capped"):
            continue
        cap = r.get("cap", au["cap"])
        if r.get("stopped_by") == "time":
            line = f"the search spent its {r['budget_s']:g} s of trials: raise --au-budget to search further"
        elif r.get("cap_reason", au.get("cap_reason")) == "ceiling":
            line = f"the search stopped at {cap}, its ceiling without --max-accelerators"
        else:
            line = f"the search stopped at {cap}, the cap: raise --max-accelerators to search further"
        if line not in lines:
            lines.append(line)
    return lines


def _plot_bars(r: dict[str, Any]) -> list[tuple[str, float]]:
    """The throughput bars of ``--plot``: (name, GB/s), each stage's capacity as the diagnosis took it.

    A stage measured apart below the rate the loader drew from it is drawn at that rate
    (See NOTE [a diagnosis true to its figures]), so no bar contradicts the table.
    """
    st, rows = r["stages"], r["diagnosis"]["stages"]

    def capacity(row: str, measured: float) -> float:
        return float(rows[row]["capacity_gbps"]) if row in rows else measured

    bars = [("storage read", capacity("storage", st["storage_read"]["gbps"]))]
    if st["decode"]:
        bars.append(("LZ4 decode", capacity("decode", st["decode"]["gbps"])))
    return bars + [("collation copy", capacity("collate", st["collate_limit"]["memcpy_gbps"])),
                   ("pyloader", st["pyloader"]["gbps"]), ("torch DataLoader", st["torch_dataloader"]["gbps"])]


def _plot_bench(r: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pyloader[plot]'") from None
    names, vals = zip(*_plot_bars(r))
    au = r.get("accelerator_utilization")
    fig, axes = plt.subplots(1, 2 if au else 1, figsize=(11 if au else 6, 4))
    ax = axes[0] if au else axes
    ax.barh(names, vals, color=["#888"] * (len(names) - 2) + ["#1f77b4", "#ff7f0e"])
    ax.set_xlabel("GB/s")
    ax.set_title("throughput per stage")
    if au:
        ax2 = axes[1]
        for key, label in (("pyloader", "pyloader"), ("torch_dataloader", "torch DataLoader")):
            tr = au[key]["trials"]
            ax2.plot([t["accelerators"] for t in tr], [100 * t["au"] for t in tr], "o-", label=label)
        ax2.axhline(100 * au["pyloader"]["threshold"], color="gray", linestyle="--")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("simulated accelerators")
        ax2.set_ylabel("AU %")
        ax2.set_title(f"accelerator utilization ({au['workload']['name']})")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _number(kind: type, low: float, *, low_open: bool = True, high: float | None = None) -> Any:
    """An argparse type: a finite ``kind`` in (low, high] (or [low, high] with ``low_open=False``)."""
    def parse(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {s!r}") from None
        if not math.isfinite(v) or (v <= low if low_open else v < low) or (high is not None and v > high):
            rng = f"{'>' if low_open else '>='} {low:g}" if high is None else \
                f"in {'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be {rng}, got {s}")
        return v
    return parse


def _positive(kind: type) -> Any:
    return _number(kind, 0)


def _threads_arg(s: str) -> int | str:
    """``--threads``: a positive int, or ``auto``."""
    if s == "auto":
        return s
    try:
        return _positive(int)(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"a positive number of threads or 'auto' (the loader tunes them), "
                                         f"got {s!r}") from None


def _size_arg(s: str) -> int:
    """A positive size in bytes: ``12288``, ``12K``, ``1.5M`` (``pyloader.format.sizes.parse_size``)."""
    from ..format.sizes import parse_size

    try:
        return parse_size(s, minimum=1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a positive size in bytes, e.g. 12288, 12K or 1.5M, got {s!r}") from None


def add_bench_parser(sub: Any) -> None:
    """Adds the ``bench`` command and its options to ``sub`` (the subparsers of ``pyloader``)."""
    b = sub.add_parser("bench", help="measure the data path, stage by stage (default: a generated dataset)",
                       description="Measure what the data path delivers and which stage bounds it, with "
                                   "torch's DataLoader on the same data. Without URL, generates a dataset.")
    b.add_argument("url", nargs="?", help="dataset directory or manifest (default: generate one)")
    b.add_argument("--batch-size", type=_positive(int), default=256)
    b.add_argument("--threads", type=_threads_arg, default=min(cpu_budget(), 8),
                   help="pyloader native threads, or 'auto': the loader tunes its threads and read-ahead "
                        "(num_workers='auto'; the report shows what it chose and why)")
    b.add_argument("--epochs", type=_positive(int), default=2,
                   help="timed rounds per loader, each at least --min-seconds of whole epochs (best is kept)")
    b.add_argument("--min-seconds", type=_positive(float), default=0.5,
                   help="shortest timed round: epochs repeat until it is reached (default 0.5)")
    b.add_argument("--torch-workers", type=_number(int, 0, low_open=False), default=2,
                   help="num_workers of the torch DataLoader baseline (>= 0)")
    b.add_argument("--records", type=_positive(int), help="records in the generated dataset (default 20000)")
    b.add_argument("--workload", choices=[*A.WORKLOADS, "custom", "none"], default="resnet50",
                   help="accelerator-utilization workload (MLPerf Storage H100 presets); with URL, "
                        "its batch size and compute time on the dataset's own records")
    b.add_argument("--record-bytes", type=_size_arg,
                   help="custom workload, generated data: bytes per record (a number or a size such as 12K)")
    b.add_argument("--au-batch-size", type=_positive(int), help="custom workload: batch size")
    b.add_argument("--compute-time", type=_positive(float), help="custom workload: seconds of compute per batch")
    b.add_argument("--au-records", type=_positive(int), help="records in the generated AU dataset")
    b.add_argument("--au-seconds", type=_positive(float), default=1.0, help="steady-state seconds per AU trial")
    b.add_argument("--au-threshold", type=_number(float, 0, high=1.0), default=0.9,
                   help="AU an accelerator count must keep, in (0, 1] (default 0.9)")
    b.add_argument("--au-threads", type=_positive(int), default=1, help="pyloader threads per accelerator")
    b.add_argument("--au-torch-workers", type=_number(int, 0, low_open=False), default=1,
                   help="torch workers per accelerator (>= 0)")
    b.add_argument("--max-accelerators", type=_positive(int),
                   help=f"the most accelerators the AU search tries (default: no limit but {A.AU_CEILING}, the "
                        "time budget and memory); a result at it reads 'at least N'")
    b.add_argument("--au-budget", type=_positive(float), default=A.AU_BUDGET_S, metavar="SECONDS",
                   help=f"seconds of AU trials per loader (default {A.AU_BUDGET_S:g}): the search tries no larger "
                        "count once they are spent, and a result still above the threshold reads 'at least N'")
    b.add_argument("--transform", metavar="MODULE:FUNCTION",
                   help="also measure a per-sample transform (fn(sample) or fn(sample, ctx)), importable from "
                        "the current directory: pyloader with and without it, and torch's DataLoader running it")
    b.add_argument("--executor", choices=["auto", "threads", "processes"], default="auto",
                   help="the transform's executor (docs/transforms.md); 'auto' measures which one the transform "
                        "needs and says why")
    b.add_argument("--image-size", type=_positive(int), metavar="N",
                   help="decode image fields to N x N with a random resized crop and flip in the transform stage")
    b.add_argument("--pack", type=_positive(int), metavar="SEQ_LEN",
                   help="also measure sequence packing into rows of SEQ_LEN tokens (docs/llm-pretraining.md): the "
                        "dataset's token field, or generated token documents without URL")
    b.add_argument("--pack-mode", choices=["greedy", "first_fit"], default="first_fit")
    b.add_argument("--pack-lookahead", type=_positive(int), default=64, help="first-fit window in pieces")
    b.add_argument("--pack-rows", type=_positive(int), default=8, help="packed rows per batch")
    b.add_argument("--cache-dir", help="node cache directory for a remote URL (default: PYLOADER_CACHE_DIR)")
    b.add_argument("--json", action="store_true", help="print the result as JSON (docs/bench.md) on stdout")
    b.add_argument("--plot", metavar="FILE.png", help="plot stage throughput and AU (needs matplotlib)")
    b.add_argument("--quiet", action="store_true", help="no progress messages")


def _usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with options that argparse cannot check one at a time; None if nothing.

    Checked before anything is measured.
    """
    if args.workload == "custom":
        need = ["--au-batch-size", "--compute-time"] + (["--record-bytes"] if args.url is None else [])
        missing = [o for o in need if getattr(args, o[2:].replace("-", "_")) is None]
        if missing:
            return f"--workload custom needs {', '.join(need)} (missing: {', '.join(missing)})"
    else:
        given = [o for o in ("--record-bytes", "--au-batch-size", "--compute-time")
                 if getattr(args, o[2:].replace("-", "_")) is not None]
        if given:
            return f"{', '.join(given)} apply to --workload custom only (got --workload {args.workload})"
    if args.url is not None:
        given = [o for o in ("--records", "--au-records", "--record-bytes")
                 if getattr(args, o[2:].replace("-", "_")) is not None]
        if given:
            return f"{', '.join(given)} size the generated datasets; with URL the dataset's own records are used"
    if args.transform is not None:
        try:
            _load_transform(args.transform)
        except ValueError as e:
            return str(e)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install 'pyloader[plot]' (or drop --plot)"
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            return f"--plot {args.plot}: no such directory {folder!r}"
    return None


def run_bench(args: argparse.Namespace) -> int:
    """Runs ``pyloader bench`` with the parsed ``args``; returns the exit code.

    Prints a table (or JSON with ``--json``) on stdout and progress on stderr; with
    ``--plot``, draws the plot after printing. Returns 0, or the code of NOTE [exit codes]
    (pyloader/errors.py) for what failed: 2 for options that do not fit together, ``--plot``
    without matplotlib (both checked before measuring) or a URL that holds no dataset; 4
    for data it cannot reach; 1 when the measurement (or the plot) failed otherwise.
    """
    problem = _usage_error(args)
    if problem:
        print(f"pyloader bench: error: {problem}", file=sys.stderr)
        return 2
    if args.url is None and args.records is None:
        args.records = DEFAULT_RECORDS

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[pyloader bench] {msg}", file=sys.stderr, flush=True)

    try:
        r = _bench_result(args, progress)
    except (PyloaderError, OSError, ValueError) as e:  # See NOTE [exit codes]: as every command exits
        print(f"pyloader bench: error: {e}", file=sys.stderr)
        return exit_code(e) or 1
    if args.json:
        json.dump(r, sys.stdout, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
        print()
    else:
        _print_bench(r)
    sys.stdout.flush()
    if args.plot:
        try:
            _plot_bench(r, args.plot)
        except (OSError, ValueError) as e:  # the results are printed above already
            print(f"pyloader bench: error: the plot was not written: {e}", file=sys.stderr)
            return 1
    return 0


__all__ = ["DEFAULT_RECORDS", "add_bench_parser", "run_bench"]
