"""``pyloader convert SRC [SRC ...] DST``: the command line of pyloader.write.convert and .verify.

SRC is one file or folder, several files (a shell glob), or a quoted glob pattern that
convert expands itself (``"wds/*.tar"``). Messages name the command's flags (``--kind``),
not the Python keywords (``kind=``) of the same options.

Exit codes (those of every ``pyloader`` command, NOTE [exit codes] in pyloader/errors.py):
0 converted (and verified, with ``--verify``); 1 the source could not be converted or read
(the message names the file, column and row), or DST already holds a dataset without
``--overwrite``; 2 bad arguments; 4 a URL destination cannot be reached; 5
``--verify``/``--verify-only`` found a record that differs from its source; 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from ..errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, VerifyError, exit_code
from ..format.sizes import parse_size
from .convert import COMPRESSIONS, ENGINES, convert
from .sources import KINDS, NULL_POLICIES
from .verify import verify_dataset

# convert()'s keywords as the command's flags, in the messages it prints: ``nulls='zero'`` is
# ``--nulls zero``, ``labels=True`` is ``--labels``, ``kind=`` alone is ``--kind``.
_KEYWORD = re.compile(r"\b(kind|fields|nulls|labels|compression|jobs|engine|scheduler|storage_options|shard_size"
                      r"|task_size|overwrite)=(?:(True)\b|'([^'\s]*)'|(\d+)\b)?")


def _flag(m: re.Match[str]) -> str:
    value = m.group(3) if m.group(3) is not None else m.group(4)
    return f"--{m.group(1).replace('_', '-')}" + (f" {value}" if value is not None else "")


def cli_words(message: str) -> str:
    """``message`` with ``nulls='zero'`` (a keyword of ``convert()``) written as the flag ``--nulls zero``."""
    return _KEYWORD.sub(_flag, message)


def _size_option(flag: str, text: str) -> None:
    try:
        parse_size(text, minimum=1)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def parse_fields(text: str | None) -> Any:
    """``"a,b:int32,c"`` -> ``{"a": None, "b": "int32", "c": None}`` (or a list without casts)."""
    if text is None:
        return None
    out: dict[str, str | None] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, dtype = part.partition(":")
        if name in out:
            raise ValueError(f"--fields names {name!r} twice")
        out[name] = dtype or None
    if not out:
        raise ValueError("--fields names no column")
    return out if any(v is not None for v in out.values()) else list(out)


def add_convert_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the ``convert`` command and its options to ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "convert", help="convert Parquet/Arrow, numpy, a folder of files or WebDataset tars to pyloader shards",
        description="Convert SRC into a pyloader dataset at DST (shards + manifest.json). SRC is a Parquet file "
        "or folder, an Arrow IPC file, a .npy/.npz file or folder of .npy files, WebDataset .tar shards, or "
        "any other folder (each file a record). Exit codes: 0 ok, 1 conversion failed, 2 bad arguments, "
        "4 a URL destination cannot be reached, 5 verification found a difference, 130 interrupted.")
    p.add_argument("src", nargs="+", metavar="SRC",
                   help="source file or folder; several files; or a quoted glob pattern such as \"wds/*.tar\"")
    p.add_argument("dst", metavar="DST", help="dataset folder to write, or a URL (s3://bucket/prefix): shards are "
                   "uploaded as they are made, the manifest last")
    p.add_argument("--kind", choices=KINDS, help="source kind (default: guessed from the file names)")
    p.add_argument("--fields", help="columns to convert, in order: a,b,c; name:dtype casts a Parquet/Arrow column "
                   "(checked: lossy casts fail)")
    p.add_argument("--compression", default="auto", choices=COMPRESSIONS,
                   help="auto (default): LZ4 only for fields where it saves >= 10%% on a sample")
    p.add_argument("--shard-size", default="64M", help="payload bytes per shard, e.g. 64M (default), 256M, 1G")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default 1); with --engine dask, those of the local cluster")
    p.add_argument("--engine", default="local", choices=ENGINES,
                   help="local (default): this machine's processes; dask: tasks on a Dask cluster (pyloader[dask])")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="with --engine dask: the cluster's scheduler (tcp://host:8786); default: a local cluster "
                   "of --jobs processes")
    p.add_argument("--task-size", help="with --engine dask: source bytes per task (default: 4 x --shard-size)")
    p.add_argument("--storage-options", metavar="JSON",
                   help="a URL DST's fsspec options as a JSON object (default: the backend's own settings, "
                   "e.g. the AWS_* variables)")
    p.add_argument("--nulls", default="error", choices=NULL_POLICIES,
                   help="error (default): a null fails naming its column and row; zero: store zeros / empty values")
    p.add_argument("--labels", action="store_true", help="folder of files: add an int64 label from the class folder")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    p.add_argument("--verify", action="store_true", help="after converting, compare every record with the source")
    p.add_argument("--verify-only", action="store_true", help="only compare an existing DST with SRC")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_convert)
    return p


def run_convert(args: argparse.Namespace) -> int:
    """Runs ``pyloader convert`` with the parsed ``args``; returns the exit code (see the module docstring)."""
    err = sys.stderr
    try:
        fields = parse_fields(args.fields)
        if args.jobs is not None and args.jobs < 1:
            raise ValueError("--jobs must be >= 1")
        if args.scheduler is not None and args.jobs is not None:
            raise ValueError("--jobs sets the local cluster's processes; with --scheduler the cluster's own "
                             "workers run the tasks")
        if args.engine != "dask" and (args.scheduler is not None or args.task_size is not None):
            raise ValueError("--scheduler and --task-size need --engine dask")
        _size_option("--shard-size", args.shard_size)
        if args.task_size is not None:
            _size_option("--task-size", args.task_size)
        try:
            storage_options = json.loads(args.storage_options) if args.storage_options else None
        except json.JSONDecodeError as e:
            raise ValueError(f"--storage-options {args.storage_options!r} is not JSON ({e}); give a JSON object, "
                             "e.g. '{\"anon\": true}'") from None
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ValueError(f"--storage-options {args.storage_options!r} is not a JSON object; give one, "
                             "e.g. '{\"anon\": true}'")
    except ValueError as e:
        print(f"pyloader convert: {e}", file=err)
        return EXIT_USAGE
    opts = {"kind": args.kind, "fields": fields, "nulls": args.nulls, "labels": args.labels}
    src = args.src[0] if isinstance(args.src, list) and len(args.src) == 1 else args.src
    try:
        if args.verify_only:
            out: dict[str, Any] = {"verified": verify_dataset(src, args.dst, storage_options=storage_options,
                                                              **opts)}
        else:
            res = convert(src, args.dst, compression=args.compression, shard_size=args.shard_size,
                          jobs=args.jobs or 1, overwrite=args.overwrite, progress=not args.quiet and not args.json,
                          verify=args.verify, engine=args.engine, scheduler=args.scheduler,
                          task_size=args.task_size, storage_options=storage_options, **opts)
            out = dataclasses.asdict(res)
            out["mb_per_s"] = res.mb_per_s
    except VerifyError as e:
        print(f"pyloader convert: verification failed: {cli_words(str(e))}", file=err)
        return EXIT_MISMATCH
    except ImportError as e:  # --engine dask without dask installed
        print(f"pyloader convert: {e}", file=err)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("pyloader convert: interrupted; no dataset was written", file=err)
        return EXIT_INTERRUPTED
    except Exception as e:  # See NOTE [exit codes]: a source that fails 1, an option found bad opening it 2
        code = exit_code(e)
        if code is None:
            raise
        print(f"pyloader convert: {cli_words(str(e))}", file=err)
        return code
    if args.json:
        print(json.dumps(out))
        return EXIT_OK
    v = out.get("verified")
    if not args.verify_only:
        comp = ", ".join(f"{k}={c}" for k, c in out["compression"].items())
        print(f"wrote {out['records']:,} records in {_plural(out['shards'], 'shard')} to {out['path']}: "
              f"{_mb(out['bytes_in'])} of values -> {_mb(out['bytes_out'])} of shard files{_overhead(out)}, "
              f"{out['seconds']:.2f}s ({_mb(out['mb_per_s'] * 1e6)}/s, {_parallelism(out)}); compression: {comp}")
    if v is not None:
        print(f"verified: {v['records']:,} records x {v['fields']} fields equal the source "
              f"({v['bytes'] / 1e6:.1f} MB in {v['seconds']:.2f}s)")
    return EXIT_OK


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _mb(nbytes: float) -> str:
    """Bytes in the unit that shows them (``380 B``, ``31.2 KB``, ``12.5 MB``; 1 KB = 1000 B), never ``0.0 MB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _overhead(out: dict[str, Any]) -> str:
    """Why the shard files are larger than the values, when they are: what a record costs besides its values."""
    extra = out["bytes_out"] - out["bytes_in"]
    if extra <= 0 or out["records"] <= 0:
        return ""
    per_record = extra / out["records"]
    return (f" (+{per_record:.0f} B per record: each shard's header and index, an entry per record and "
            "field, and checksums; small records pay the most)")


def _parallelism(out: dict[str, Any]) -> str:
    if out.get("engine") == "dask":
        return f"{_plural(out['tasks'], 'dask task')} on {_plural(out['jobs'], 'worker')}"
    return _plural(out["jobs"], "job")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m pyloader.write.cli``) until ``pyloader convert`` is wired in."""
    ap = argparse.ArgumentParser(prog="pyloader")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_convert_parser(sub)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_MISMATCH", "EXIT_INTERRUPTED", "cli_words", "parse_fields",
           "add_convert_parser", "run_convert", "main"]
