"""Every ``SOMETHING.md`` the docs and the code point to is in the repository.

A reference to a page that is not there (the architecture map once was) sends a reader
nowhere; this finds one the moment it is written.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: ``docs/LOADER.md``, ``ARCHITECTURE.md``, ``(../docs/DESIGN.md)``: upper-case page names
PAGE = re.compile(r"(?<![\w/.-])((?:\.\./)?(?:docs/)?[A-Z][A-Z0-9_]*\.md)\b")


def _sources() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("farm", "worker", "loader", "examples", "bench", "scripts"):
        files += sorted(p for p in (ROOT / folder).rglob("*")
                        if p.suffix in (".py", ".md", ".toml", ".sh") and p.is_file())
    return files


def test_every_referenced_page_exists() -> None:
    missing = []
    for path in _sources():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for ref in PAGE.findall(line):
                name = Path(ref).name
                if not any((base / name).is_file() for base in (ROOT, ROOT / "docs",
                                                                  path.parent)):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {ref}")
    assert not missing, "\n".join(missing)


def test_the_check_sees_references() -> None:
    """The pattern finds what the docs write, so the test above can fail."""
    assert PAGE.findall("see docs/ARCHITECTURE.md, and `LOADER.md` or (../docs/X.md)") == [
        "docs/ARCHITECTURE.md", "LOADER.md", "../docs/X.md"]
