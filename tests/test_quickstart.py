"""The README's quick start: exactly two commands, and the scripts they name exist.

Cheap static checks. ``scripts/check-fresh-clone`` runs the two commands for real in a
fresh clone (too slow for the suite).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["scripts/demo", "scripts/test"]


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", readme, re.S | re.M)
    assert section, "README has no '## Quick start' section"
    blocks = re.findall(r"^```(?:sh|bash|console)?\n(.*?)^```", section[1], re.S | re.M)
    assert len(blocks) == 1, "the quick start should be one code block"
    lines = [line.split("#", 1)[0].strip() for line in blocks[0].splitlines()]
    return [line for line in lines if line]


def test_quick_start_is_exactly_two_commands() -> None:
    assert quick_start_commands() == COMMANDS


def test_quick_start_scripts_exist_and_are_executable() -> None:
    for rel in [*COMMANDS, ".ci/run", "scripts/check-fresh-clone"]:
        path = ROOT / rel
        assert path.is_file(), rel
        assert os.access(path, os.X_OK), f"{rel} is not executable"
        assert path.read_text().startswith("#!"), f"{rel} has no shebang"


def test_ci_runs_the_readme_test_command() -> None:
    lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
             if line.strip() and not line.strip().startswith("#")]
    assert any(re.search(r"(^|\s|/)scripts/test(\s|$)", line) for line in lines), lines


def test_test_command_runs_ruff_mypy_and_pytest() -> None:
    text = (ROOT / "scripts/test").read_text()
    for tool in ("ruff", "mypy", "pytest"):
        assert re.search(rf"^[^#\n]*\b{tool}\b", text, re.M), f"scripts/test runs no {tool}"
