"""One place for every name of shared state, one place for the version.

``farm/core/keys.py`` builds every Redis key, stream, queue, task, object path and embedded
file name; this test finds such names spelt out anywhere else in the shipped code. The
version is ``farm/version.py``'s, which the distribution reads (``dynamic``) and the
chart's ``appVersion`` repeats (Helm cannot read Python): a test keeps them equal.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "farm.version.__version__"
    chart = (ROOT / "helm" / "kernel-farm" / "Chart.yaml").read_text()
    app_version = re.search(r'^appVersion:\s*"?([^"\n]+)"?$', chart, re.M)
    assert app_version is not None and app_version.group(1) == __version__
