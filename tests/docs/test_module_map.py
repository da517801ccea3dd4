"""docs/architecture.md's module map names every source file of the four packages: by its path, by
its name after a path of the same folder in one row's first cell, or by a folder or glob there."""

from __future__ import annotations

import fnmatch
import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "tokenizer_proc", "scheduler_proc", "worker_proc")


def mapped(doc: str) -> tuple[set[str], list[str]]:
    """(paths named, folder and glob patterns) of the first cells of the document's table rows."""
    named: set[str] = set()
    patterns: list[str] = []
    for line in doc.splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3:
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", cells[1]):
            path = token if "/" in token else folder + token
            if "/" in token:
                folder = token if token.endswith("/") else posixpath.dirname(token) + "/"
            if path.endswith("/"):
                patterns.append(path + "*")
            elif any(c in path for c in "*?["):
                patterns.append(path)
            else:
                named.add(path)
    return named, patterns


def sources() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if p.name != "__init__.py" and "builtin_model" not in p.parts)  # fmt: skip


def test_every_source_file_is_in_the_module_map() -> None:
    named, patterns = mapped((ROOT / "docs" / "architecture.md").read_text())
    missing = [f for f in sources() if f not in named and not any(fnmatch.fnmatch(f, g) for g in patterns)]
    assert not missing, f"docs/architecture.md's module map does not name: {', '.join(missing)}"


def test_the_map_names_no_file_that_is_gone() -> None:
    named, _ = mapped((ROOT / "docs" / "architecture.md").read_text())
    gone = sorted(p for p in named if p.split("/")[0] in PACKAGES and p.endswith(".py") and not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md names files that do not exist: {', '.join(gone)}"


def test_the_reader_resolves_names_after_a_path() -> None:
    named, patterns = mapped("| `a/b.py`, `c.py`, `d/` | x |\n| `e/f*.py` | y |\nnot a row `g.py`")
    assert named == {"a/b.py", "a/c.py"} and patterns == ["d/*", "e/f*.py"]
