"""torch's own DataLoader test suite, run twice: once as is, once with pyloader's DataLoader
patched in as ``torch.utils.data.DataLoader``.

Give it the path of torch's ``test/test_dataloader.py`` (not shipped in the torch wheel and
not part of this repository: fetch the file matching the installed torch). It runs that file
with pytest twice, in subprocesses of this interpreter:

1. ``torch``: as is;
2. ``pyloader``: with a ``sitecustomize`` on ``PYTHONPATH`` that sets
   ``torch.utils.data.DataLoader`` and ``torch.utils.data.dataloader.DataLoader`` to
   ``pyloader.DataLoader`` at the start of every Python process -- pytest itself, the spawned
   processes the tests start (``ErrorTrackingProcess``, spawn and forkserver workers) and the
   ``python -c`` programs they run -- and a pytest plugin that checks the test module's
   ``DataLoader`` is pyloader's and counts the ``pyloader.DataLoader`` objects each test builds.

It prints the tests run and passed/failed/skipped under each, then every test that passes
under torch and fails under pyloader with its first error line, less the known differences
(``KNOWN``, each with its reason). Exit status 1 when an unexplained difference is left.
``--json`` writes all per-test outcomes. torch's tests need ``expecttest`` (imported by
``torch.testing._internal``) and ``psutil``: ``pip install expecttest psutil``.

Usage: python benchmarks/torch_dataloader_suite.py /tmp/torch_tests/test_dataloader.py
           [-k EXPR] [--timeout 120] [--slow] [--json out.json] [--only torch|pyloader]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tests of torch's file that pass under torch and not under pyloader, for a reason that
# makes pyloader's behaviour the right one: test id -> why. (Both entries can only show on a
# machine with CUDA: without it the test pins nothing and passes under both.)
_PIN_THREAD = ("with CUDA it reads iter(loader)._pin_memory_thread, torch's Python pin thread: pyloader "
               "pins in its native copy engine, whose thread stops when the iterator is dropped or closed")
KNOWN: dict[str, str] = {
    "TestDataLoader::test_partial_workers": _PIN_THREAD,
    "TestDataLoaderPersistentWorkers::test_partial_workers": _PIN_THREAD,
}

# Runs first in every Python process of the pyloader run (PYTHONPATH): the drop-in patch.
SITECUSTOMIZE = '''\
import functools
import os

import torch.utils.data
import torch.utils.data.dataloader

import pyloader

torch.utils.data.DataLoader = pyloader.DataLoader
torch.utils.data.dataloader.DataLoader = pyloader.DataLoader

# Each pyloader.DataLoader built, in any process of the run, appends its pid to this file.
_built = os.environ.get("PYLOADER_SUITE_BUILT")
if _built:
    _init = pyloader.DataLoader.__init__

    @functools.wraps(_init)
    def _counting_init(self, *args, **kwargs):
        with open(_built, "a") as f:
            f.write(f"{os.getpid()}\\n")
        _init(self, *args, **kwargs)

    pyloader.DataLoader.__init__ = _counting_init
'''

# pytest plugin of the pyloader run (main process): proves the patch is in effect and counts
# the loaders pyloader built in each test.
PLUGIN = '''\
import json
import os

import pytest
import torch.utils.data

import pyloader

assert torch.utils.data.DataLoader is pyloader.DataLoader, "sitecustomize did not patch torch"
assert torch.utils.data.dataloader.DataLoader is pyloader.DataLoader

_built = os.environ["PYLOADER_SUITE_BUILT"]
_per_test = {}


def _pids():
    with open(_built) as f:
        return f.read().split()


def pytest_collection_modifyitems(session, config, items):
    for mod in {item.module for item in items if getattr(item, "module", None) is not None}:
        got = getattr(mod, "DataLoader", None)
        if got is not None and got is not pyloader.DataLoader:
            raise pytest.UsageError(f"{mod.__name__}.DataLoader is {got!r}, not pyloader.DataLoader")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = len(_pids())
    yield
    pids = _pids()[before:]
    _per_test[item.nodeid] = {"built": len(pids), "in_children": sum(p != str(os.getpid()) for p in pids)}


def pytest_sessionfinish(session, exitstatus):
    pids = _pids()
    with open(os.environ["PYLOADER_SUITE_COUNTS"], "w") as f:
        json.dump({"built": len(pids), "in_children": sum(p != str(os.getpid()) for p in pids),
                   "per_test": _per_test, "pyloader": pyloader.__file__}, f)
'''


def test_id(case: ET.Element) -> str:
    """``Class::test`` of a junit testcase (the file's module name left out)."""
    cls = case.get("classname", "").rsplit(".", 1)[-1]
    return f"{cls}::{case.get('name')}" if cls else str(case.get("name"))


def outcomes(junit: str) -> dict[str, dict[str, Any]]:
    """Per test: outcome (passed, failed, skipped, xfailed), seconds, first error line."""
    out: dict[str, dict[str, Any]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, first = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                text = (child.get("message") or child.text or "").strip()
                first = text.splitlines()[0][:300] if text else child.tag
                break
            if child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                first = (child.get("message") or "").splitlines()[0][:200] if child.get("message") else ""
        out[test_id(case)] = {"outcome": outcome, "seconds": float(case.get("time", 0) or 0), "first": first}
    return out


def run_suite(which: str, test_file: str, work: str, keyword: str | None, timeout: int, wall: int,
              slow: bool) -> dict[str, Any]:
    """One pytest run of ``test_file`` in a subprocess; its per-test outcomes."""
    junit = os.path.join(work, f"{which}.xml")
    ini = os.path.join(work, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")  # not the repository's configuration (filterwarnings=error etc.)
    cmd = [sys.executable, "-m", "pytest", test_file, "-c", ini, "--rootdir", os.path.dirname(test_file),
           "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={junit}", "-o", "junit_family=xunit1",
           f"--timeout={timeout}"]
    if keyword:
        cmd += ["-k", keyword]
    env = dict(os.environ)
    if slow:
        env["PYTORCH_TEST_WITH_SLOW"] = "1"  # torch's @slowTest tests (test_proper_exit)
    paths = [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    counts = os.path.join(work, "counts.json")
    if which == "pyloader":
        hooks = os.path.join(work, "hooks")
        os.makedirs(hooks, exist_ok=True)
        with open(os.path.join(hooks, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        with open(os.path.join(hooks, "_pyloader_suite_plugin.py"), "w") as f:
            f.write(PLUGIN)
        paths.insert(0, hooks)
        cmd += ["-p", "_pyloader_suite_plugin"]
        env["PYLOADER_SUITE_COUNTS"] = counts
        env["PYLOADER_SUITE_BUILT"] = os.path.join(work, "built.txt")
        open(env["PYLOADER_SUITE_BUILT"], "w").close()
    env["PYTHONPATH"] = os.pathsep.join(paths)
    log = os.path.join(work, f"{which}.log")
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=os.path.dirname(test_file), env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=wall).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    seconds = time.monotonic() - t0
    if not os.path.exists(junit):
        with open(log) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"{which} run wrote no junit report (exit {rc}); its log ends:\n{tail}")
    result: dict[str, Any] = {"exit": rc, "seconds": round(seconds, 1), "log": log, "outcomes": outcomes(junit)}
    if which == "pyloader":
        with open(counts) as f:
            result["loaders"] = json.load(f)
    return result


def summary(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    s = {"run": len(tests), "passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    for t in tests.values():
        s[t["outcome"]] += 1
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_file", help="torch's test/test_dataloader.py")
    ap.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset of the tests)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test (pytest-timeout)")
    ap.add_argument("--wall", type=int, default=5400, help="seconds per whole run")
    ap.add_argument("--json", default=None, help="write every per-test outcome here")
    ap.add_argument("--slow", action="store_true", help="also torch's @slowTest tests (PYTORCH_TEST_WITH_SLOW=1)")
    ap.add_argument("--only", choices=["torch", "pyloader"], default=None, help="one run only")
    args = ap.parse_args()

    import torch

    import pyloader

    test_file = os.path.abspath(args.test_file)
    with open(test_file, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as work:
        for which in ("torch", "pyloader"):
            if args.only in (None, which):
                d = os.path.join(work, which)
                os.makedirs(d)
                runs[which] = run_suite(which, test_file, d, args.keyword, args.timeout, args.wall, args.slow)
                runs[which].pop("log")

    print(f"torch {torch.__version__} ({torch.version.git_version[:12]}), pyloader from "
          f"{os.path.dirname(pyloader.__file__)}, python {platform.python_version()}")
    print(f"test file {test_file} (sha256 {digest[:16]})" + (f", -k {args.keyword!r}" if args.keyword else ""))
    print(f"{'':10} {'run':>6} {'passed':>7} {'failed':>7} {'skipped':>8} {'xfailed':>8} {'seconds':>8}")
    for which, r in runs.items():
        s = r["summary"] = summary(r["outcomes"])
        print(f"{which:10} {s['run']:6d} {s['passed']:7d} {s['failed']:7d} {s['skipped']:8d} {s['xfailed']:8d} "
              f"{r['seconds']:8.0f}")
    report: dict[str, Any] = {"torch": torch.__version__, "torch_git": torch.version.git_version,
                              "python": platform.python_version(), "test_file": test_file, "sha256": digest,
                              "keyword": args.keyword, "timeout": args.timeout, "slow": args.slow,
                              "runs": runs, "differences": {}, "known": {}}
    unexplained = 0
    if "pyloader" in runs:
        loaders = runs["pyloader"]["loaders"]
        with_loader = sum(1 for n in loaders["per_test"].values() if n["built"])
        print(f"pyloader.DataLoader objects built: {loaders['built']} ({loaders['in_children']} in child "
              f"processes), by {with_loader} of {len(loaders['per_test'])} tests")
    if len(runs) == 2:
        theirs, ours = runs["torch"]["outcomes"], runs["pyloader"]["outcomes"]
        diff = {name: ours.get(name, {"outcome": "missing", "first": "not run"})
                for name, t in sorted(theirs.items())
                if t["outcome"] == "passed" and ours.get(name, {}).get("outcome") != "passed"}
        for name, t in diff.items():
            (report["known"] if name in KNOWN else report["differences"])[name] = t
        unexplained = len(report["differences"])
        print(f"pass under torch, not under pyloader: {unexplained}"
              + (f" (+{len(report['known'])} known)" if report["known"] else ""))
        for name, t in report["differences"].items():
            print(f"  {name} [{t['outcome']}]: {t['first']}")
        if report["known"]:
            print("known differences:")
            for name, t in report["known"].items():
                print(f"  {name} [{t['outcome']}]: {KNOWN[name]}")
        better = sorted(n for n, t in ours.items() if t["outcome"] == "passed"
                        and theirs.get(n, {}).get("outcome") not in (None, "passed"))
        if better:
            print(f"pass under pyloader, not under torch: {len(better)}: {', '.join(better)}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
        print(f"wrote {args.json}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
