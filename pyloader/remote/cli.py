"""``pyloader cache``: warm, list, check and empty the node-local shard cache.

``pyloader._cli`` wires it in with ``add_cache_parser(subparsers)`` and dispatches
``args.cmd == "cache"`` to ``run_cache(args)``; ``python -m pyloader.remote.cli`` runs
it alone.

Exit codes: those of every ``pyloader`` command (NOTE [exit codes] in pyloader/errors.py).
Here: 0 done; 1 done in part (a shard failed to download, a cached file failed
verification and was removed, or shards in use were left in place when the target needed
them gone); 2 bad usage, URL or manifest (none at that URL), or a ``--cache-dir`` that does
not exist; 3 the cache cannot take the data (size limit too small, disk full, read-only);
4 cannot reach the data (the host does not answer, the request is refused or times out,
credentials are missing or denied: nothing was downloaded); 130 interrupted: Ctrl-C, or
SIGTERM (what a scheduler sends), both leaving no temp file behind.

``warm`` shows its progress on stderr unless ``--quiet`` or ``--json``: a live bar on a
terminal, a line every ``LOG_EVERY_S`` seconds in a log (stderr not a TTY).

A request that gets no answer is not silent: after ``QUIET_S`` seconds without a byte,
``warm`` prints a line naming the URL it waits for and the timeouts that bound the wait
(``PYLOADER_FETCH_STALL_TIMEOUT``, ``PYLOADER_FETCH_DEADLINE``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import (
    EXIT_CACHE,
    EXIT_FAILED,
    EXIT_HELP,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CacheError,
    CacheLimitError,
    exit_code,
)
from ..format.sizes import format_size, parse_size
from ..read import order as _plan
from .bad_copies import remove_entry, verify_entry
from .cache import ShardCache, dataset_key
from .fetch import ShardFetcher, auto_fetch_jobs, first_touch_order, open_remote
from .fs import RetryPolicy, is_remote

EXIT_PARTIAL = EXIT_FAILED  # done in part: some shards failed (NOTE [exit codes])

QUIET_S = 5.0  # seconds without a byte before warm says what it waits for
LOG_EVERY_S = 10.0  # seconds between progress lines when stderr is no terminal


def _size_arg(s: str) -> int:
    try:
        return parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(lo: int, what: str) -> Callable[[str], int]:
    """An argparse type: an int >= ``lo``, else an error naming ``what`` was expected."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = lo - 1
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected a {what} int, got {s!r}")
        return v

    return parse


_positive = _int_at_least(1, "positive")


def _jobs_arg(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or a positive int, got {text!r}") from None
_nonneg = _int_at_least(0, "non-negative")


def add_cache_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``cache`` (with warm/ls/stats/verify/evict/clear) to a ``pyloader`` subparsers object."""
    p = subparsers.add_parser("cache", help="the node-local shard cache of remote datasets",
                              description=EXIT_HELP)
    sub = p.add_subparsers(dest="cache_cmd", metavar="COMMAND", title="commands")
    p.set_defaults(cache_parser=p)

    def common(sp: argparse.ArgumentParser, json_flag: bool = True) -> None:
        sp.add_argument("--cache-dir", default=None,
                        help="cache directory (default: $PYLOADER_CACHE_DIR, else ~/.cache/pyloader)")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print a machine-readable result on stdout")

    w = sub.add_parser("warm", help="download a remote dataset's shards into the cache (idempotent, resumable)",
                       description=EXIT_HELP)
    w.add_argument("url", help="dataset URL (s3://, gs://, https://, ...)")
    common(w)
    w.add_argument("--jobs", type=_jobs_arg, default="auto",
                   help="parallel downloads (default auto: 8, or more for small shards, to keep 16 MiB in flight)")
    w.add_argument("--limit", type=_size_arg, default=None, help="cache size limit, e.g. 200G (LRU eviction)")
    w.add_argument("--nodes", type=_positive, default=1, help="nodes in the job (default 1: warm everything)")
    w.add_argument("--node-rank", type=_nonneg, default=0, help="this node's index")
    w.add_argument("--ranks-per-node", type=_positive, default=1, help="ranks (processes) per node")
    w.add_argument("--epoch", type=_nonneg, default=0, help="the epoch whose shards to warm (default 0)")
    w.add_argument("--seed", type=_nonneg, default=0, help="the readers' seed (default 0)")
    w.add_argument("--shuffle", action="store_true", help="the readers shuffle (as ShardDataset(shuffle=True))")
    w.add_argument("--shuffle-mode", choices=("global", "window"), default="global",
                   help="the readers' shuffle_mode (default global)")
    w.add_argument("--window", type=_positive, default=65536, help="the readers' window (default 65536)")
    w.add_argument("--partition", choices=("pad", "drop"), default="pad",
                   help="the readers' partition (default pad)")
    w.add_argument("--quiet", action="store_true", help="no progress output")
    w.add_argument("--progress", action="store_true", help="show progress even with --json")
    w.add_argument("--storage-options", metavar="JSON", default=None,
                   help="fsspec options as a JSON object, e.g. '{\"anon\": true}' (default: the backend's own "
                   "settings, e.g. the AWS_* variables)")

    common(sub.add_parser("ls", help="list cached datasets"))
    common(sub.add_parser("stats", help="totals: shards, bytes, pinned, temp files"))
    v = sub.add_parser("verify", help="re-hash cached shards against their manifests; remove bad ones")
    v.add_argument("url", nargs="?", help="only this dataset")
    common(v)
    e = sub.add_parser("evict", help="evict least-recently-used shards not in use")
    e.add_argument("url", nargs="?", help="only this dataset")
    e.add_argument("--to", type=_size_arg, default=0, help="evict until the cache holds at most this (default 0)")
    common(e)
    c = sub.add_parser("clear", help="remove every shard not in use, and stale temp files")
    c.add_argument("url", nargs="?", help="only this dataset")
    common(c)
    return p


def _emit(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        json.dump(result, sys.stdout, indent=1, sort_keys=True)
        print()
    else:
        print(text)


def _err(args: argparse.Namespace, msg: str) -> None:
    print(f"pyloader cache {args.cache_cmd}: error: {msg}", file=sys.stderr)


def run_cache(args: argparse.Namespace) -> int:
    """Runs a parsed ``pyloader cache ...`` command; returns the exit code (NOTE [exit codes])."""
    if getattr(args, "cache_cmd", None) is None:
        parser = getattr(args, "cache_parser", None)
        if parser is not None:
            parser.print_help(sys.stderr)
        print(f"pyloader cache: error: name a command: {', '.join(_COMMANDS)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with _sigterm_as_interrupt():
            return _COMMANDS[args.cache_cmd](args)
    except Exception as e:
        code = exit_code(e)
        if code is None:
            raise
        _err(args, str(e))
        return code
    except KeyboardInterrupt as e:
        _err(args, "interrupted by SIGTERM" if isinstance(e, _Terminated) else "interrupted")
        return EXIT_INTERRUPTED


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler's stop) ends the command as Ctrl-C does: downloads cancelled, their temps removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def storage_options_arg(text: str | None) -> dict[str, Any] | None:
    """``--storage-options`` as a dict; ValueError naming the option and the fix otherwise."""
    if text is None:
        return None
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--storage-options {text!r} is not JSON ({e}); give a JSON object, "
                         "e.g. '{\"anon\": true}'") from None
    if not isinstance(opts, dict):
        raise ValueError(f"--storage-options {text!r} is not a JSON object; give one, e.g. '{{\"anon\": true}}'")
    return opts


def select_shards(records_per_shard: list[int], *, nodes: int, node_rank: int, ranks_per_node: int, epoch: int,
                  seed: int, shuffle: bool, shuffle_mode: str, window: int, partition: str) -> list[int]:
    """Shards the ranks of one node read in ``epoch``, interleaved so every rank's first shards come first."""
    if not 0 <= node_rank < nodes:
        raise ValueError(f"--node-rank must be in [0, {nodes})")
    world = nodes * ranks_per_node
    orders = []
    for r in range(node_rank * ranks_per_node, (node_rank + 1) * ranks_per_node):
        sidx, _ = _plan.plan(records_per_shard, shuffle=shuffle, seed=seed, epoch=epoch, rank=r, world_size=world,
                             worker=0, num_workers=1, shuffle_mode=shuffle_mode, window=window, partition=partition)
        orders.append(first_touch_order(sidx))
    out, seen = [], set()
    for k in range(max((len(o) for o in orders), default=0)):
        for o in orders:
            if k < len(o) and o[k] not in seen:
                seen.add(o[k])
                out.append(o[k])
    return out


def _unreachable(e: BaseException) -> bool:
    """A failure to reach the data (network, timeout, credentials), not a missing or changed object."""
    return exit_code(e) == EXIT_UNREACHABLE


class _QuietWatch:
    """Prints a line to stderr whenever ``progress()`` has not moved for ``QUIET_S`` seconds.

    A server that accepts a connection and never answers would otherwise leave the command
    silent until the stall timeout and the retry deadline run out.
    """

    def __init__(self, what: Callable[[], str], progress: Callable[[], int]) -> None:
        self.what, self.progress = what, progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pyloader-quiet-watch")

    def _run(self) -> None:
        last, since, told = self.progress(), time.monotonic(), 0.0
        policy = RetryPolicy.from_env()
        while not self._stop.wait(min(0.25, QUIET_S / 4)):
            now, cur = time.monotonic(), self.progress()
            if cur != last:
                last, since, told = cur, now, 0.0
                continue
            quiet = now - since
            if quiet >= QUIET_S and quiet - told >= max(QUIET_S, 30.0 if told else 0.0):
                told = quiet
                print(f"pyloader cache warm: no data for {quiet:.0f} s from {self.what()}; still trying: a request "
                      f"that sends nothing for {policy.stall_timeout:g} s fails and is retried, up to "
                      f"{policy.attempts} attempts and at most {policy.deadline:g} s, whichever comes first "
                      "(PYLOADER_FETCH_STALL_TIMEOUT, PYLOADER_FETCH_ATTEMPTS, PYLOADER_FETCH_DEADLINE)",
                      file=sys.stderr, flush=True)

    def __enter__(self) -> _QuietWatch:
        self._thread.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        self._thread.join()


class _Progress:
    """Progress on stderr: shards, bytes/s, ETA; a live bar on a terminal, a line every ``LOG_EVERY_S`` in a log."""

    def __init__(self, total_shards: int, total_bytes: int, fetcher: ShardFetcher, enabled: bool) -> None:
        self.total_shards, self.total_bytes, self.fetcher, self.enabled = total_shards, total_bytes, fetcher, enabled
        self.tty = sys.stderr.isatty()
        self.done_shards = 0
        self.done_bytes = 0
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pyloader-progress")

    def shard_done(self, i: int, nbytes: int, err: BaseException | None) -> None:
        self.done_shards += 1
        self.done_bytes += nbytes

    def line(self) -> str:
        el = max(time.monotonic() - self.t0, 1e-9)
        rate = self.fetcher.bytes / el
        left = max(self.total_bytes - self.done_bytes, 0)
        eta = left / rate if rate > 0 else float("inf")
        frac = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        eta_s = "--:--" if eta == float("inf") else time.strftime("%H:%M:%S", time.gmtime(eta))
        start = "\r" if self.tty else ""
        return (f"{start}[{bar}] {self.done_shards}/{self.total_shards} shards  "
                f"{_fmt_bytes(rate)}/s  ETA {eta_s}  ")

    def _run(self) -> None:
        every = 0.2 if self.tty else LOG_EVERY_S
        while not self._stop.wait(every):
            sys.stderr.write(self.line() + ("" if self.tty else "\n"))
            sys.stderr.flush()

    def __enter__(self) -> _Progress:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()
            sys.stderr.write(self.line() + "\n")
            sys.stderr.flush()


def _warm(args: argparse.Namespace) -> int:
    if not is_remote(args.url):
        raise ValueError(f"{args.url!r} is local: only remote (fsspec) URLs are cached")
    opts = storage_options_arg(args.storage_options)
    with _QuietWatch(lambda: f"{args.url.rstrip('/')}/manifest.json", lambda: 0):
        dcache = open_remote(args.url, cache_dir=args.cache_dir, cache_limit=args.limit, storage_options=opts)
    rps = [int(s["records"]) for s in dcache.shards]
    order = select_shards(rps, nodes=args.nodes, node_rank=args.node_rank, ranks_per_node=args.ranks_per_node,
                          epoch=args.epoch, seed=args.seed, shuffle=args.shuffle, shuffle_mode=args.shuffle_mode,
                          window=args.window, partition=args.partition)
    total = sum(int(dcache.shards[i]["bytes"]) for i in order)
    if args.limit is not None and total > args.limit:
        raise CacheLimitError(f"the {len(order)} selected shards hold {format_size(total)} ({total} bytes), more "
                              f"than --limit {format_size(args.limit)}: give a --limit of at least "
                              f"{format_size(total)}, or warm this node's share only (--nodes, --node-rank)")
    was_cached = {i for i in order if dcache.is_published(i)}
    cached_before = len(was_cached)
    # --jobs auto: See NOTE [fetch jobs]; a warm has no reader to leave CPU to: at least 8.
    jobs = max(8, auto_fetch_jobs([int(s["bytes"]) for s in dcache.shards])) if args.jobs == "auto" else args.jobs
    fetcher = ShardFetcher(dcache, None, jobs=jobs)
    prog = _Progress(len(order), total, fetcher, args.progress or not (args.quiet or args.json))
    fetcher.on_done = prog.shard_done
    t0 = time.monotonic()
    with prog, _QuietWatch(lambda: dcache.url, lambda: fetcher.bytes):
        try:
            fetcher.schedule(order)
            fetcher.wait()
        except KeyboardInterrupt:
            fetcher.close()
            raise
    dt = time.monotonic() - t0
    errors = fetcher.errors
    failed = [{"shard": dcache.shards[i]["path"], "url": dcache.shard_url(i), "error": str(e)}
              for i, e in sorted(errors.items())]
    # The bytes of the shards this run put in the cache; a failed download's bytes (and those of
    # retried attempts) are received, not downloaded.
    good = sum(int(dcache.shards[i]["bytes"]) for i in order if i not in was_cached and i not in errors)
    result = {"url": dcache.url, "cache_dir": dcache.cache.base, "selected_shards": len(order),
              "selected_bytes": total, "cached_before": cached_before, "downloaded": fetcher.downloaded,
              "bytes_downloaded": good, "bytes_received": fetcher.bytes, "failed": failed, "seconds": dt,
              "bytes_per_s": fetcher.bytes / dt if dt > 0 else 0.0, "jobs": jobs,
              "transport": dcache.transport().name}
    text = (f"{dcache.url}: {len(order)} shards ({_fmt_bytes(total)}) selected, {cached_before} already cached, "
            f"{fetcher.downloaded} downloaded ({_fmt_bytes(good)} in {dt:.1f} s; {jobs} at once, "
            f"{dcache.transport().name} transport), {len(failed)} failed")
    for f in failed:
        text += f"\n  failed: {f['error']}"
    _emit(args, result, text)
    if failed:
        if all(isinstance(e, (CacheError, CacheLimitError)) for e in errors.values()):
            return EXIT_CACHE
        if fetcher.downloaded == 0 and all(_unreachable(e) for e in errors.values()):
            return EXIT_UNREACHABLE
        return EXIT_PARTIAL
    return EXIT_OK


def _cache(args: argparse.Namespace) -> ShardCache:
    """The cache ``--cache-dir`` (or the default) names; one named that does not exist is a usage error."""
    cache = ShardCache(args.cache_dir)
    if not os.path.isdir(cache.base) and (args.cache_dir is not None or os.environ.get("PYLOADER_CACHE_DIR")):
        given = "--cache-dir" if args.cache_dir is not None else "PYLOADER_CACHE_DIR"
        raise ValueError(f"{given} {cache.base!r}: no such folder; check the path (the cache that "
                         "`pyloader cache warm` or a reader filled)")
    return cache


def _ls(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for d in _cache(args).datasets():
        ents = d.entries()
        refs = [e for e in ents if e.referenced]
        rows.append({"url": d.url, "key": d.key, "shards_cached": len(refs), "shards_total": len(d.shards),
                     "bytes_cached": sum(e.bytes for e in ents),
                     "bytes_total": sum(int(s["bytes"]) for s in d.shards),
                     "unreferenced_shards": len(ents) - len(refs),
                     "last_used": max((e.mtime for e in ents), default=None)})
    text = "\n".join(f"{r['key']}  {r['shards_cached']}/{r['shards_total']} shards  "
                     f"{_fmt_bytes(r['bytes_cached'])}  {r['url']}" for r in rows) or "(cache is empty)"
    _emit(args, {"cache_dir": _cache(args).base, "datasets": rows}, text)
    return EXIT_OK


def _stats(args: argparse.Namespace) -> int:
    s: dict[str, Any] = _cache(args).stats()
    text = (f"{s['cache_dir']}: {s['datasets']} datasets, {s['shards']} shards, {_fmt_bytes(s['bytes'])}; "
            f"{s['pinned_shards']} in use; {s['temp_files']} temp files ({_fmt_bytes(s['temp_bytes'])})")
    _emit(args, s, text)
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    cache = _cache(args)
    stale = cache.clean_stale()
    checked, bad = 0, []
    for d in cache.datasets():
        if args.url is not None and d.key != dataset_key(args.url):
            continue
        for e in d.entries():
            problem = verify_entry(d, e)
            checked += 1
            if problem is not None:
                remove_entry(d, e)
                bad.append({"url": d.url, "file": e.path, "problem": problem})
    text = f"verified {checked} cached shards: {len(bad)} bad (removed); {stale} stale temp files removed"
    for b in bad:
        text += f"\n  bad: {b['file']}: {b['problem']}"
    _emit(args, {"checked": checked, "bad": bad, "stale_temp_removed": stale}, text)
    return EXIT_PARTIAL if bad else EXIT_OK


def _removable(cache: ShardCache, command: str) -> ShardCache:
    """``cache``, once it is known that files can be removed from it; else a CacheError naming why.

    On a read-only filesystem every shard would otherwise look held (its pins cannot be
    write-locked) and the command would report them as in use.
    """
    top = cache.root if os.path.isdir(cache.root) else cache.base
    if os.path.isdir(top) and not os.access(top, os.W_OK):
        if os.statvfs(top).f_flag & os.ST_RDONLY:
            raise CacheError(errno.EROFS, f"cache {cache.base} is on a read-only filesystem: `cache {command}` "
                             "cannot remove anything from it; run it where the cache is mounted read-write")
        raise CacheError(errno.EACCES, f"cache {cache.base} is not writable by this user: `cache {command}` "
                         "cannot remove anything from it; run it as the cache's owner")
    return cache


def _evict(args: argparse.Namespace) -> int:
    cache = _removable(_cache(args), "evict")
    evicted, busy = cache.evict(to_bytes=args.to, url=args.url)
    left = cache.usage()
    r = {"evicted": len(evicted), "evicted_bytes": sum(e.bytes for e in evicted), "in_use_skipped": len(busy),
         "bytes_left": left}
    _emit(args, r, f"evicted {r['evicted']} shards ({_fmt_bytes(r['evicted_bytes'])}); "
                   f"{len(busy)} in use kept; {_fmt_bytes(left)} left")
    return EXIT_OK if left <= args.to or args.url is not None and not busy else EXIT_PARTIAL


def _clear(args: argparse.Namespace) -> int:
    removed, busy = _removable(_cache(args), "clear").clear(args.url)
    _emit(args, {"removed_files": removed, "in_use_kept": busy},
          f"removed {removed} files; {busy} shards in use kept")
    return EXIT_PARTIAL if busy else EXIT_OK


_COMMANDS = {"warm": _warm, "ls": _ls, "stats": _stats, "verify": _verify, "evict": _evict, "clear": _clear}


def main(argv: list[str] | None = None) -> int:
    """``python -m pyloader.remote.cli cache ...``: parses ``argv`` and returns the exit code."""
    ap = argparse.ArgumentParser(prog="pyloader")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_cache_parser(sub)
    return run_cache(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EXIT_OK", "EXIT_PARTIAL", "LOG_EVERY_S", "storage_options_arg", "EXIT_USAGE", "EXIT_CACHE", "EXIT_UNREACHABLE", "EXIT_INTERRUPTED", "EXIT_HELP",
           "QUIET_S", "add_cache_parser", "run_cache", "select_shards", "main"]
