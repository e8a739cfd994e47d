"""Per-family build ids (issue 32): changing one built-in family rekeys only its own
artifacts.

The build id of a built-in family hashes its module and the farm modules it imports
(``farm.families.buildid``). The tests change a *copy* of the ``farm`` package and read
the build ids from it (``build_id_of(..., farm_root=copy)``), so the checkout itself is
never edited; the last one runs the real ``farm build`` twice, the second time with the
build ids read from a copy in which ``softmax.py`` has one more comment.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from farm.families.buildid import FARM_ROOT, build_id_of, farm_closure_digests
from farm.families.registry import Registry

BUILTIN = "farm.families.builtin"


@pytest.fixture(scope="module")
def builtin_modules() -> dict[str, str]:
    """family name -> its module, for every built-in family."""
    return {f.name: type(f).__module__ for f in Registry.load()
            if type(f).__module__.startswith(BUILTIN + ".")}


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the ``farm`` package (its code, without byte-code caches)."""
    shutil.copytree(FARM_ROOT / "farm", tmp_path / "farm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def ids(modules: dict[str, str], root: Path) -> dict[str, str]:
    return {name: build_id_of([module], root) for name, module in modules.items()}


def append(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.write_text(path.read_text() + text)


def test_an_unchanged_copy_gives_the_registry_s_build_ids(
        builtin_modules: dict[str, str], copy: Path) -> None:
    """The id depends on module names and contents, never on where the files are."""
    registry = Registry.load()
    assert ids(builtin_modules, copy) == {n: registry.get(n).build_id for n in builtin_modules}
    assert len(builtin_modules) == 10


def test_changing_one_family_changes_only_its_build_id(
        builtin_modules: dict[str, str], copy: Path) -> None:
    before = ids(builtin_modules, copy)
    append(copy, "farm/families/builtin/softmax.py", "# a fix to softmax\n")
    after = ids(builtin_modules, copy)
    assert {n for n in before if before[n] != after[n]} == {"softmax"}


@pytest.mark.parametrize(("changed", "rekeyed"), [
    # what every built-in family imports: all ten
    ("farm/families/builtin/common.py", "all"),
    ("farm/core/model.py", "all"),
    ("farm/families/buildid.py", "all"),
    ("farm/version.py", "all"),
    # the package's __init__ imports every family, but none of them imports it
    ("farm/families/builtin/__init__.py", "none"),
    # code no family imports
    ("farm/records/query.py", "none"),
    ("farm/cli/families.py", "none"),
])
def test_a_change_rekeys_the_families_that_import_it(
        builtin_modules: dict[str, str], copy: Path, changed: str, rekeyed: str) -> None:
    before = ids(builtin_modules, copy)
    append(copy, changed, "# changed\n")
    after = ids(builtin_modules, copy)
    differ = {n for n in before if before[n] != after[n]}
    assert differ == (set(before) if rekeyed == "all" else set())


def test_imports_inside_functions_and_relative_imports_count(copy: Path) -> None:
    """A module a family imports lazily, or by a relative name, is part of its code."""
    family = copy / "farm" / "families" / "builtin" / "softmax.py"
    family.write_text(family.read_text() + "\n\ndef _later() -> None:\n"
                      "    from ...records import query  # noqa: F401\n")
    found = farm_closure_digests((f"{BUILTIN}.softmax",), copy)
    assert "farm.records.query" in found
    before = build_id_of([f"{BUILTIN}.softmax"], copy)
    append(copy, "farm/records/query.py", "# changed\n")
    assert build_id_of([f"{BUILTIN}.softmax"], copy) != before


def test_the_built_in_families_read_no_data_file() -> None:
    """The import rule sees Python modules only, so the built-in families keep their
    OpenCL C in Python (a plugin may read a ``.cl`` file: its whole package is hashed)."""
    folder = FARM_ROOT / "farm" / "families" / "builtin"
    assert {p.suffix for p in folder.iterdir() if p.is_file()} == {".py"}


# -- the real CLI: a build after a change to softmax ----------------------------------------
MANIFEST = """\
format = 1
name = "three"

[[kernels]]
family = "softmax"
params = { cols = 64 }

[[kernels]]
family = "elementwise_binary"
params = { op = "add" }

[[kernels]]
family = "transpose"
params = { rows = 16, cols = 16 }
"""

#: runs ``farm`` with the build ids read from the copy of the package in argv[1]
PATCHED_FARM = """\
import sys
from pathlib import Path
import farm.families.buildid as buildid
buildid.FARM_ROOT = Path(sys.argv.pop(1))
from farm.cli.entry import main
main()
"""


def build(home: Path, root: Path, manifest: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               CUDA_CACHE_DISABLE="1")
    proc = subprocess.run([sys.executable, "-c", PATCHED_FARM, str(root), "build",
                           str(manifest), "--workers", "1", "--json"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def stored(home: Path) -> dict[str, tuple[str, str]]:
    """family -> (id hash, build id) of its one stored artifact."""
    conn = sqlite3.connect(home / "envs" / "default" / "store.sqlite")
    try:
        found = conn.execute("SELECT id_hash, build_id, meta FROM artifacts").fetchall()
    finally:
        conn.close()
    by_family = {json.loads(m)["family"]: (i, b) for i, b, m in found}
    assert len(by_family) == len(found)
    return by_family


def test_a_build_after_a_change_to_one_family_rekeys_only_that_family(
        tmp_path: Path, copy: Path) -> None:
    home, manifest = tmp_path / "home", tmp_path / "three.toml"
    manifest.write_text(MANIFEST)
    first = build(home, copy, manifest)["summary"]
    assert (first["compiled"], first["failed"]) == (3, 0)
    before = stored(home)

    append(copy, "farm/families/builtin/softmax.py", "# a fix that leaves the source\n")
    second = build(home, copy, manifest)["summary"]
    assert (second["loaded"], second["rekeyed"], second["compiled"]) == (2, 1, 0)
    assert second["compiler_invocations"] == 0
    after = stored(home)
    assert after["elementwise_binary"] == before["elementwise_binary"]
    assert after["transpose"] == before["transpose"]
    assert after["softmax"][0] == before["softmax"][0]  # the same kernel id...
    assert after["softmax"][1] != before["softmax"][1]  # ...moved to its new build id
