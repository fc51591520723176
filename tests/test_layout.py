"""The package's shape: imports run one way through the stages, with no cycles.

Stages, lowest first (pyloader/README.md): errors <- format <- contract <- write | remote | transform <- read
<- loader <- bench <- CLI. A module may import its own package and any lower stage, never a
higher one nor a sibling of its own stage (write, remote and transform are independent). The command-line
modules (``_cli``, ``__main__`` and every ``<stage>/cli.py``) form the top stage, the
package ``__init__`` re-exports the public API, and the native ``_C`` (with ``_version``,
which imports nothing) sits below all. Every import counts, including those inside functions
(a lazy import is still a dependency). The graph is read from the source with ``ast``, so
those tests need nothing built.

No import runs back up: a module imports each name from the module that defines it (the
native module as ``import pyloader._C as _C``), never from the package root, and
``import pyloader`` itself loads only ``pyloader.errors`` (the rest on first use, PEP 562).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pyloader"

STAGES = {"errors": 0, "format": 1, "contract": 2, "write": 3, "remote": 3, "transform": 3, "read": 4, "loader": 5,
          "bench": 6, "integrations": 6}
TOP = 9  # the CLI modules and the package __init__
BOTTOM = ("pyloader._C", "pyloader._version")  # below every stage: they import no pyloader module


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def stage(mod: str) -> tuple[int, str]:
    """(level, stage name) of a pyloader module."""
    parts = mod.split(".")
    if mod in BOTTOM:
        return -1, mod.rsplit(".", 1)[1]
    if mod in ("pyloader", "pyloader._cli", "pyloader.__main__") or parts[-1] == "cli":
        return TOP, "cli"
    if len(parts) < 2 or parts[1] not in STAGES:
        raise AssertionError(f"{mod} belongs to no stage: add it to a stage package or to STAGES")
    return STAGES[parts[1]], parts[1]


def imports(mod: str, path: Path) -> set[str]:
    """The pyloader modules ``mod`` imports (resolved to modules, not names in them)."""
    known = modules()
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("pyloader"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("pyloader"):
                target = node.module
            else:
                continue
            for a in node.names:  # `from pkg import module` names a module; else the target is one
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known or sub == "pyloader._C" else target)
    out.discard(mod)
    return {m for m in out if m in known or m == "pyloader._C"}


def names_from_root(mod: str, path: Path) -> list[str]:
    """``from .. import X`` / ``from pyloader import X`` in ``mod`` where X is a name of the
    root ``__init__`` (not a subpackage or module): "X (line N)" for each."""
    known = modules()
    tree = ast.parse(path.read_text(), str(path))
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            anchor = base[: len(base) - (node.level - 1)]
            target = ".".join(anchor + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target != "pyloader":
            continue
        out += [f"{a.name} (line {node.lineno})" for a in node.names
                if f"pyloader.{a.name}" not in known and f"pyloader.{a.name}" != "pyloader._C"]
    return out


def graph() -> dict[str, set[str]]:
    return {m: imports(m, p) for m, p in modules().items()}


def test_every_module_belongs_to_a_stage() -> None:
    for m in modules():
        stage(m)


def test_imports_run_one_way() -> None:
    bad = []
    for m, deps in graph().items():
        lm, sm = stage(m)
        for d in deps:
            ld, sd = stage(d)
            if lm == TOP or sd == sm:
                continue
            if ld >= lm:
                bad.append(f"{m} ({sm}) imports {d} ({sd})")
    assert not bad, "imports against the stage order:\n  " + "\n  ".join(sorted(bad))


def test_no_module_imports_names_from_the_package_root() -> None:
    """The root ``__init__`` only re-exports; every other module imports a name from the
    module that defines it (``from .. import _C`` still counts as a module, but the house
    style is ``import pyloader._C as _C``: see test_native_module_is_imported_directly)."""
    bad = [f"{m}: {n}" for m, p in modules().items() if m != "pyloader" for n in names_from_root(m, p)]
    assert not bad, "names imported from the package root (import them from their module):\n  " + "\n  ".join(bad)


def test_native_module_is_imported_directly() -> None:
    """One style for the native module: ``import pyloader._C as _C``, not through the root."""
    bad = []
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "_C" for a in node.names):
                bad.append(f"{m} (line {node.lineno})")
    assert not bad, "write `import pyloader._C as _C` in:\n  " + "\n  ".join(bad)


def test_import_pyloader_loads_only_the_errors() -> None:
    """``import pyloader`` loads the root and ``pyloader.errors``, nothing else (not even the
    native module); every other public name is imported on first use."""
    code = 'import pyloader, sys; print(sorted(m for m in sys.modules if m.startswith("pyloader")))'
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout
    assert out.strip() == "['pyloader', 'pyloader.errors']", out


def test_a_local_dataset_loads_no_remote_fetching(tmp_path: Path) -> None:
    """A loader over local shards, iterated natively and through transform workers, loads
    none of the remote stage's fetching, cache or fsspec modules: they load with the first
    remote dataset, not in every job's first epoch (~7 ms of its start)."""
    code = textwrap.dedent(f"""
        import sys
        import pyloader
        with pyloader.ShardWriter({str(tmp_path / "ds")!r}, {{"x": "int64"}}) as w:
            for i in range(64):
                w.write({{"x": i}})
        ds = pyloader.ShardDataset({str(tmp_path / "ds")!r}, shuffle=True, seed=0)
        for loader in (pyloader.DataLoader(ds, batch_size=8),
                       pyloader.DataLoader(ds, batch_size=8, transform=lambda s: s, num_workers=2,
                                           executor="processes")):
            assert sum(int(b["x"].shape[0]) for b in loader) == 64
        print(sorted(m for m in sys.modules if m.startswith("pyloader.remote") or m == "fsspec"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout
    assert out.strip() == "['pyloader.remote', 'pyloader.remote.budget', 'pyloader.remote.locks', 'pyloader.remote.names']", out


def test_lazy_names_resolve() -> None:
    """Every name in the root's ``_LAZY`` table is in ``__all__`` (or is ``__version__``) and
    resolves to the object its module defines."""
    import importlib

    import pyloader

    for name, spec in pyloader._LAZY.items():
        mod, _, attr = spec.partition(":")
        assert name in pyloader.__all__ or name == "__version__", f"{name} is lazy but not in pyloader.__all__"
        want = getattr(importlib.import_module(mod, "pyloader"), attr or name)
        assert getattr(pyloader, name) is want, name


def test_no_import_cycles() -> None:
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    # A package __init__ that re-exports its own modules is not a cycle of dependencies.
    real = [c for c in cycles if not any(a == "pyloader" or b == "pyloader" for a, b in zip(c, c[1:]))]
    assert not real, "import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in real)


def test_each_stage_package_describes_its_files() -> None:
    """Every stage folder's __init__ docstring names each of its modules."""
    for pkg in sorted(p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
        missing = [f.name for f in sorted(pkg.glob("*.py")) if f.name != "__init__.py" and f.name not in doc]
        assert doc and not missing, f"pyloader/{pkg.name}/__init__.py docstring does not list {missing or 'its files'}"


def test_exceptions_live_in_errors_and_are_exported() -> None:
    import pyloader
    import pyloader.errors as errors

    for m, p in modules().items():
        if m == "pyloader.errors":
            continue
        tree = ast.parse(p.read_text())
        raised_classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                          and any(isinstance(b, ast.Name) and b.id.endswith(("Error", "Exception")) for b in n.bases)
                          and not n.name.startswith("_")]
        assert not raised_classes, f"{m} defines exception classes {raised_classes}: they belong in pyloader/errors.py"
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__ and not v.__name__.startswith("_")]
    for cls in classes:
        assert cls.__name__ in errors.__all__, f"{cls.__name__} missing from pyloader.errors.__all__"
        assert cls.__name__ in pyloader.__all__, f"{cls.__name__} missing from pyloader.__all__"
        assert getattr(pyloader, cls.__name__) is cls


@pytest.mark.parametrize("name,builtin", [("FetchError", OSError), ("CacheError", OSError),
                                          ("ShardIOError", OSError), ("ConvertError", ValueError),
                                          ("ResumeError", ValueError), ("ParquetReadError", ValueError),
                                          ("CacheLimitError", ValueError), ("LoaderTimeoutError", RuntimeError)])
def test_exported_errors_subclass_the_builtin_they_name(name: str, builtin: type) -> None:
    import pyloader

    cls = getattr(pyloader, name)
    assert issubclass(cls, pyloader.PyloaderError) and issubclass(cls, builtin)


def test_benchmarks_import_nothing_from_tests() -> None:
    root = PKG.parent
    test_modules = {p.stem for p in (root / "tests").rglob("*.py")}
    for p in sorted((root / "benchmarks").glob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module.split(".")[0]]
            hit = [n for n in names if n in test_modules or n == "tests"]
            assert not hit, f"{p.name} imports {hit} from tests/"
            if isinstance(node, ast.Constant) and node.value == "tests":
                raise AssertionError(f"{p.name} names the tests/ folder (line {node.lineno})")
