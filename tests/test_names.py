"""One place for every name of shared state, for the outcome names, for the version.

``farm/core/keys.py`` builds every Redis key, stream, queue, task, object path and embedded
file name; this test finds such names spelt out anywhere else in the shipped code. The
outcome names (``Loaded``, ``loaded``, ``unsupported``, ``failed``...) are
``farm/core/outcomes.py``'s: a string literal equal to one anywhere else is found (a
docstring may say the words). The version is ``farm/version.py``'s, which the
distribution reads (``dynamic``) and the chart's ``appVersion`` repeats (Helm cannot read
Python): a test keeps them equal.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from farm.core.outcomes import Fate, Outcome
from farm.version import __version__

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [p for d in ("farm", "worker", "loader") for p in (ROOT / d).rglob("*.py")]

#: what a name of shared state looks like when spelt out in a string literal
NAME_LITERALS = {
    "a Redis key": re.compile(r"""["']farm:[a-z]"""),
    "a queue or task name": re.compile(r"""["']farm\.(default|compile)["']"""),
    "a record kind": re.compile(r"""["']records/v\d"""),
    "an embedded file name": re.compile(r"""["'](store|records)\.sqlite["']"""),
    "the default bucket": re.compile(r"""["']kernel-farm["']\s*[,)]"""),
}


def test_no_name_of_shared_state_is_spelt_out_outside_keys() -> None:
    found = []
    for path in SHIPPED:
        if path == ROOT / "farm" / "core" / "keys.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in NAME_LITERALS.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_the_scanner_finds_what_it_looks_for() -> None:
    samples = ['x = "farm:lease:abc"', "q = 'farm.default'", 'k = "records/v1/compilation"',
               'p = home / "records.sqlite"', 'bucket: str = "kernel-farm",']
    assert all(any(p.search(s) for p in NAME_LITERALS.values()) for s in samples)


OUTCOMES = ROOT / "farm" / "core" / "outcomes.py"
OUTCOME_NAMES = frozenset({*Fate, *Outcome})


def outcome_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string literal in ``tree`` that is an outcome name, but for
    docstrings and other lone strings (prose)."""
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in OUTCOME_NAMES and id(node) not in prose]


def test_no_outcome_name_is_spelt_out_outside_its_module() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
             for path in SHIPPED if path != OUTCOMES
             for line, text in outcome_literals(ast.parse(path.read_text()))]
    assert found == [], "take them from farm.core.outcomes:\n" + "\n".join(found)


def test_the_outcome_scanner_finds_what_it_looks_for() -> None:
    tree = ast.parse('"""Loaded or compiled: prose."""\n'
                     'x = {"compiled": 1}\n'
                     'y = Literal["ok", "failed"]\n'
                     'if outcome == "Rekeyed": pass\n'
                     'z = f"{n} failed"\n')
    assert sorted(outcome_literals(tree)) == [(2, "compiled"), (3, "failed"), (4, "Rekeyed")]


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "farm.version.__version__"
    chart = (ROOT / "helm" / "kernel-farm" / "Chart.yaml").read_text()
    app_version = re.search(r'^appVersion:\s*"?([^"\n]+)"?$', chart, re.M)
    assert app_version is not None and app_version.group(1) == __version__
