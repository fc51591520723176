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
