"""House rules that keep the sources consistent with themselves (/work/shared/STYLE.md).

Each test reads the source trees as text (or imports the package, where it says so) and
names every offending file and line, so a failure says what to fix.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The trees whose text is checked: sources, tests, benchmarks and docs.
TREES = ("pyloader", "csrc", "tests", "benchmarks", "docs")
TEXT_SUFFIXES = {".py", ".pyi", ".h", ".cpp", ".c", ".md", ".txt", ".toml", ".sh", ".cfg", ".ini"}


def text_files() -> list[Path]:
    """Every text file of TREES and the top-level README.md (this file excluded: it quotes the patterns)."""
    out = [ROOT / "README.md"]
    for tree in TREES:
        out += [p for p in sorted((ROOT / tree).rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES
                and "__pycache__" not in p.parts]
    here = Path(__file__).resolve()
    return [p for p in out if p.resolve() != here]


def lines_of(p: Path) -> list[tuple[int, str]]:
    return list(enumerate(p.read_text(errors="replace").splitlines(), 1))


# --- NOTE blocks -------------------------------------------------------------------------

# A NOTE's *definition* is the name in brackets after the word NOTE followed directly by a
# colon, not preceded by "See " or "see ": NOTE_DEF below. Any other mention of the
# bracketed name after NOTE is a *citation* (the "See ..." form, with or without the colon,
# or "NOTE [name] in <where>"): NOTE_ANY minus the definitions.
NOTE_DEF = re.compile(r"(?<![Ss]ee )NOTE \[([^\]]+)\]:")
NOTE_ANY = re.compile(r"NOTE \[([^\]]+)\]")


def test_each_note_has_exactly_one_definition_and_every_citation_one() -> None:
    """Definition: ``NOTE_DEF`` (``NOTE \\[name\\]:`` not after "See "); citation: any other ``NOTE_ANY``.

    Each name is defined in exactly one place across pyloader/, csrc/, tests/,
    benchmarks/, docs/ and README.md, and every cited name has a definition.
    """
    defs: dict[str, list[str]] = defaultdict(list)
    cites: dict[str, list[str]] = defaultdict(list)
    for p in text_files():
        rel = p.relative_to(ROOT)
        for no, line in lines_of(p):
            defined = {m.start(): m.group(1) for m in NOTE_DEF.finditer(line)}
            for m in NOTE_ANY.finditer(line):
                if m.start() in defined:
                    defs[m.group(1)].append(f"{rel}:{no}")
                else:
                    cites[m.group(1)].append(f"{rel}:{no}")
    twice = {n: w for n, w in defs.items() if len(w) > 1}
    assert not twice, "NOTEs defined more than once (keep one definition; write See NOTE [...] elsewhere):\n  " + \
        "\n  ".join(f"{n}: {', '.join(w)}" for n, w in sorted(twice.items()))
    undefined = {n: w for n, w in cites.items() if n not in defs}
    assert not undefined, "NOTEs cited but defined nowhere:\n  " + \
        "\n  ".join(f"{n}: {', '.join(w)}" for n, w in sorted(undefined.items()))


# --- every source file in its root's README ----------------------------------------------


def _expand(token: str) -> list[str]:
    """``core/xxh3.{h,cpp}`` -> ``core/xxh3.h``, ``core/xxh3.cpp``."""
    m = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", token)
    return [m[1] + x.strip() + m[3] for x in m[2].split(",")] if m else [token]


def readme_paths(readme: Path) -> set[str]:
    """The paths a README names in backticks, relative to its folder.

    In a table row whose first cell is a folder (`` `read/` ``), a bare file name in the row
    is a file of that folder, and the folder's ``__init__.py`` is the row itself.
    """
    out: set[str] = set()
    for line in readme.read_text().splitlines():
        cells = line.split("|")
        m = re.fullmatch(r"\s*`([\w./-]+/)`\s*", cells[1]) if line.startswith("|") and len(cells) > 2 else None
        folder = m.group(1) if m else ""
        if folder:
            out.add(folder + "__init__.py")
        for token in re.findall(r"`([^`\s]+)`", line):
            for path in _expand(token):
                out.add(path)
                if folder and "/" not in path:
                    out.add(folder + path)
    return out


def unlisted(root: str, files: list[Path]) -> list[str]:
    listed = readme_paths(ROOT / root / "README.md")
    return [str(p.relative_to(ROOT / root)) for p in files if str(p.relative_to(ROOT / root)) not in listed]


def test_pyloader_readme_lists_every_python_module() -> None:
    """Every ``.py`` under pyloader/ is named in pyloader/README.md (by path, or by file name
    in its folder's row)."""
    files = [p for p in sorted((ROOT / "pyloader").rglob("*.py")) if "__pycache__" not in p.parts]
    missing = unlisted("pyloader", files)
    assert not missing, f"pyloader/README.md does not list {missing}"


def test_csrc_readme_lists_every_file() -> None:
    """Every file under csrc/ (but the README) is named in csrc/README.md's table."""
    files = [p for p in sorted((ROOT / "csrc").rglob("*")) if p.is_file() and p.name != "README.md"]
    missing = unlisted("csrc", files)
    assert not missing, f"csrc/README.md does not list {missing}"


# --- names of modules and files that exist ---------------------------------------------

# `.py` names in the text that are not files of this repository, on purpose: torch's own test
# file (benchmarks/torch_dataloader_suite.py runs it), the scripts tests write into tmp_path
# and the hooks that suite writes into its temporary folder.
FOREIGN_PY = {"test/test_dataloader.py", "path/to/test_dataloader.py",  # pytorch's test/test_dataloader.py
              "usertr.py", "guard_child.py", "child.py", "loop.py", "run.py", "warm_probe_mod.py",  # written by tests
              # into tmp_path
              "sitecustomize.py", "_pyloader_suite_plugin.py"}  # written by benchmarks/torch_dataloader_suite.py
PY_FILE = re.compile(r"(?<![\w/.<>-])([\w./<>-]*\w\.py)(?!\w)")
DOTTED = re.compile(r"(?<![\w/.])pyloader(?:\.[A-Za-z_]\w*)+")


def repo_files() -> list[str]:
    """Every file of the working tree (relative, posix), hidden folders and caches left out."""
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if p.is_file() and not any(part.startswith(".") or part == "__pycache__" or part.endswith(".egg-info")
                                   for part in rel.parts):
            out.append(rel.as_posix())
    return out


def test_every_py_file_named_exists() -> None:
    """Every ``something.py`` in pyloader/, tests/, benchmarks/, docs/, csrc/ and README.md
    names a file of the repository: a path with a folder must be the end of an existing path
    (``write/writer.py``, ``pyloader/errors.py``), a bare name (or one after a placeholder
    such as ``<stage>/``) an existing file name; FOREIGN_PY lists the deliberate exceptions."""
    files = repo_files()
    names = {f.rsplit("/", 1)[-1] for f in files}
    bad = []
    for p in text_files():
        for no, line in lines_of(p):
            for m in PY_FILE.finditer(line):
                token = m.group(1)
                if token in FOREIGN_PY:
                    continue
                if "/" in token and not token.startswith("/") and ">" not in token:
                    ok = any(f == token or f.endswith("/" + token) for f in files)
                else:
                    ok = token.rsplit("/", 1)[-1] in names
                if not ok:
                    bad.append(f"{p.relative_to(ROOT)}:{no}: {token}")
    assert not bad, "names of files that do not exist:\n  " + "\n  ".join(bad)


def _modules() -> set[str]:
    out = {"pyloader._C"}
    for p in (ROOT / "pyloader").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_every_dotted_pyloader_name_resolves() -> None:
    """Every ``pyloader.x.y`` in those trees is a module of the package, or an attribute (a
    chain of them) of the longest module it starts with; the module is imported for that
    (``pyloader.__main__`` never is: it runs the command line)."""
    import importlib

    mods = _modules()
    seen: dict[str, bool] = {}

    def resolves(dotted: str) -> bool:
        parts = dotted.split(".")
        k = max(j for j in range(1, len(parts) + 1) if ".".join(parts[:j]) in mods)
        if k == len(parts):
            return True
        if parts[:k] == ["pyloader", "__main__"]:
            return False
        obj = importlib.import_module(".".join(parts[:k]))
        for a in parts[k:]:
            if not hasattr(obj, a):
                return False
            obj = getattr(obj, a)
        return True

    bad = []
    for p in text_files():
        for no, line in lines_of(p):
            for m in DOTTED.finditer(line):
                name = m.group(0).rstrip(".")
                if name not in seen:
                    seen[name] = resolves(name)
                if not seen[name]:
                    bad.append(f"{p.relative_to(ROOT)}:{no}: {name}")
    assert not bad, "dotted names that are neither a pyloader module nor an attribute of one:\n  " + "\n  ".join(bad)


# --- __all__ and the public API -----------------------------------------------------------


def public_modules() -> list[str]:
    """Every module whose own name does not start with ``_`` (package ``__init__``s included)."""
    out = []
    for p in sorted((ROOT / "pyloader").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        elif parts[-1].startswith("_"):
            continue
        out.append(".".join(parts))
    return out


# Public-looking names a module defines that are not API: called by name from C++.
NOT_EXPORTED = {"pyloader.errors": {"from_native"}}  # csrc/bindings/register_errors.cpp calls it


def defined_names(path: Path) -> list[str]:
    """The names a module's top level defines (def, class, assignment; inside a top-level
    ``if``/``try`` too, but not under ``if TYPE_CHECKING``) that do not start with ``_``."""
    import ast

    out: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.append(n.name)
            elif isinstance(n, ast.Assign):
                for t in n.targets:
                    out.extend(e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
                out.append(n.target.id)
            elif isinstance(n, ast.If) and not (isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"):
                visit(n.body)
                visit(n.orelse)
            elif isinstance(n, ast.Try):
                visit(n.body)
                for h in n.handlers:
                    visit(h.body)
                visit(n.orelse)

    visit(ast.parse(path.read_text()).body)
    return [n for n in dict.fromkeys(out) if not n.startswith("_")]


def module_path(name: str) -> Path:
    p = ROOT.joinpath(*name.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def test_every_public_module_defines_all_and_its_names_exist() -> None:
    """Each public module defines ``__all__``; every name in it is an attribute of the
    imported module (the root's lazy names included: getattr imports them) or, in a package,
    one of its modules, and every public name the module itself defines is in it
    (NOT_EXPORTED lists the exceptions)."""
    import importlib

    bad = []
    for name in public_modules():
        mod = importlib.import_module(name)
        names = getattr(mod, "__all__", None)
        if names is None:
            bad.append(f"{name}: no __all__")
            continue
        if len(set(names)) != len(names):
            bad.append(f"{name}: __all__ lists a name twice")
        bad += [f"{name}: {n} in __all__ does not exist" for n in names
                if not hasattr(mod, n) and not module_path(f"{name}.{n}").exists()]  # a package's module
        skip = NOT_EXPORTED.get(name, set())
        bad += [f"{name}: defines {n}, missing from __all__" for n in defined_names(module_path(name))
                if n not in names and n not in skip]
    assert not bad, "\n  ".join(["__all__ problems:", *bad])


# Test oracles and helpers: they live in tests/, never in a package's __all__.
TEST_ONLY = {"reference_pack"}


def test_no_test_helper_is_exported() -> None:
    import importlib

    for name in public_modules():
        exported = set(getattr(importlib.import_module(name), "__all__", ()))
        assert not exported & TEST_ONLY, f"{name} exports test helpers {sorted(exported & TEST_ONLY)}"
        assert not any(n.startswith(("reference_", "fake_", "mock_")) for n in exported), (name, sorted(exported))


def test_the_extension_point_is_exported() -> None:
    """``PlannedDataset`` (the dataset contract a new dataset implements) is public API."""
    import pyloader
    from pyloader.contract import PlannedDataset

    assert "PlannedDataset" in pyloader.__all__ and pyloader.PlannedDataset is PlannedDataset


def test_format_docstring_names_every_shard_version() -> None:
    import ast

    from pyloader.format.spec import SHARD_VERSIONS

    doc = ast.get_docstring(ast.parse((ROOT / "pyloader" / "format" / "__init__.py").read_text())) or ""
    assert f"versions {min(SHARD_VERSIONS)} to {max(SHARD_VERSIONS)}" in doc, doc.splitlines()[0]


def test_no_file_over_800_lines_and_no_class_over_400() -> None:
    """The sizes a newcomer can read whole (issue #28): a module that outgrows them is split by concern."""
    import ast

    big = []
    for p in sorted((ROOT / "pyloader").rglob("*.py")):
        text = p.read_text()
        if text.count("\n") > 800:
            big.append(f"{p.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                big.append(f"{p.relative_to(ROOT)}: class {node.name} is {node.end_lineno - node.lineno + 1} lines")
    assert not big, "\n  ".join(["too large:", *big])
