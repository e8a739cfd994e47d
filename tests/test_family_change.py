"""Changing a kernel family's definition: only that family is compiled again.

A user's package of kernels (written into tmp_path, found through PYTHONPATH and
``FARM_FAMILY_MODULES``) is built together with built-in kernels by the real CLI. Then:

* a comment-only change of the user module gives its kernels a new build id but the
  same OpenCL C: they are ``Rekeyed`` and *moved* (the old keys leave the store and the
  source index), the built-in kernels are ``Loaded``, and nothing is compiled;
* a change of the generated code compiles the user family's kernels again, and only
  those;
* two kernels of one batch with identical source are compiled once (one ``Compiled``,
  one ``Rekeyed``), and both keys stay (copy, not move), also when a later batch rekeys
  a third kernel from the source index.

Every build runs in a fresh process (the build id is cached per process) with
``PYTHONDONTWRITEBYTECODE=1``: a module rewritten within one second at the same size
could otherwise run from a stale ``.pyc`` while its source text (which the build id
hashes) has changed.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

FARM = Path(sys.executable).with_name("farm")
USER_FAMILY = "user_scale"

MODULE = '''\
"""A user's kernel family: scale a vector in place. {comment}"""

from __future__ import annotations

import numpy as np

from farm.core.device import DeviceInfo
from farm.families.base import Example, KernelFamily, Params
from farm.core.model import LaunchSettings, Lowered


class ScaleParams(Params):
    factor: float = 2.0
    #: a name for people; it never reaches the generated source
    tag: str = ""


class Scale(KernelFamily[ScaleParams]):
    name = "{name}"
    params_model = ScaleParams

    def lower(self, params: ScaleParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        f = f"{{params.factor!r}}f"
        source = (
            "__kernel void user_scale(__global float *x, const uint n)\\n"
            "{{\\n"
            "    const size_t i = get_global_id(0);\\n"
            "    if (i >= n) return;\\n"
            f"    x[i] = {expr};\\n"
            "}}\\n"
        )
        return Lowered(source=source, kernel_names=("user_scale",))

    def example(self, params: ScaleParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        x = rng.uniform(-1, 1, 16).astype(np.float32)
        return Example(kernel_name="user_scale", args=[x, np.uint32(16)], global_size=(16,),
                       local_size=None, expected={{0: x * np.float32(params.factor)}})


FAMILIES = [Scale]
'''

MANIFEST = """\
format = 1
name = "mixed"

[[kernels]]
family = "user_scale"
params = { factor = 2.0 }

[[kernels]]
family = "user_scale"
params = { factor = 0.5 }

[[kernels]]
family = "elementwise_binary"
params = { op = "max" }

[[kernels]]
family = "elementwise_unary"
params = { op = "relu" }
"""


# -- helpers -------------------------------------------------------------------------------
def write_module(root: Path, *, comment: str = "", expr: str = "x[i] * {f}") -> None:
    pkg = root / "userkernels"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""A user\'s kernels."""\n')
    (pkg / "scale.py").write_text(MODULE.format(comment=comment, name=USER_FAMILY, expr=expr))


def build(home: Path, pkgs: Path, manifest: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), FARM_FAMILY_MODULES=json.dumps(["userkernels.scale"]),
               PYTHONPATH=str(pkgs), PYTHONDONTWRITEBYTECODE="1", PYOPENCL_NO_CACHE="1",
               POCL_KERNEL_CACHE="0", CUDA_CACHE_DISABLE="1")
    proc = subprocess.run([str(FARM), "build", str(manifest), "--workers", "2", "--json"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)


def rows(home: Path) -> dict[tuple[str, str], str]:
    """(id_hash, build_id) -> family of every stored artifact."""
    conn = sqlite3.connect(home / "envs" / "default" / "store.sqlite")
    try:
        found = conn.execute("SELECT id_hash, build_id, meta FROM artifacts").fetchall()
    finally:
        conn.close()
    return {(r[0], r[1]): json.loads(r[2])["family"] for r in found}


def index(home: Path) -> set[tuple[str, str]]:
    """The keys the source index points at."""
    conn = sqlite3.connect(home / "envs" / "default" / "store.sqlite")
    try:
        return set(conn.execute("SELECT id_hash, build_id FROM sources").fetchall())
    finally:
        conn.close()


def outcomes(report: dict[str, Any]) -> tuple[int, int, int, int]:
    s = report["summary"]
    return s["loaded"], s["rekeyed"], s["compiled"], s["failed"]


def of_family(stored: dict[tuple[str, str], str], user: bool) -> set[tuple[str, str]]:
    return {k for k, fam in stored.items() if (fam == USER_FAMILY) == user}


# -- tests ---------------------------------------------------------------------------------
@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    pkgs, home = tmp_path / "pkgs", tmp_path / "home"
    write_module(pkgs)
    manifest = tmp_path / "mixed.toml"
    manifest.write_text(MANIFEST)
    return pkgs, home, manifest


def test_only_the_changed_family_is_rebuilt(setup: tuple[Path, Path, Path]) -> None:
    pkgs, home, manifest = setup
    first = build(home, pkgs, manifest)
    assert outcomes(first) == (0, 0, 4, 0)
    stored0 = rows(home)
    user0, builtin0 = of_family(stored0, True), of_family(stored0, False)
    assert len(user0) == 2 and len(builtin0) == 2
    assert len({b for _, b in user0}) == 1  # one build id for the family

    # (a) a comment changes the module (so its build id) but not the generated source
    write_module(pkgs, comment="Now with a longer docstring.")
    second = build(home, pkgs, manifest)
    assert outcomes(second) == (2, 2, 0, 0)
    assert second["summary"]["compiler_invocations"] == 0
    stored1 = rows(home)
    user1 = of_family(stored1, True)
    assert of_family(stored1, False) == builtin0  # built-ins untouched
    assert len(user1) == 2 and user1.isdisjoint(user0)  # moved: the old keys are gone
    assert {i for i, _ in user1} == {i for i, _ in user0}  # same kernel ids...
    assert {b for _, b in user1} != {b for _, b in user0}  # ...under a new build id
    assert index(home) == set(stored1)  # no index entry names a removed key

    # (b) a change of the generated code: the family compiles again, nothing else does
    write_module(pkgs, comment="Now with a longer docstring.", expr="{f} * x[i] + 0.0f")
    third = build(home, pkgs, manifest)
    assert outcomes(third) == (2, 0, 2, 0)
    assert third["summary"]["compiler_invocations"] == 2
    stored2 = rows(home)
    assert of_family(stored2, False) == builtin0
    # the new keys; the earlier build's artifacts stay (never served: their build id is
    # stale, and no source of the new build matches theirs)
    new = of_family(stored2, True) - user1
    assert len(new) == 2 and {b for _, b in new}.isdisjoint({b for _, b in user1})
    assert {i for i, _ in new} == {i for i, _ in user0}

    # and with nothing changed, everything loads
    fourth = build(home, pkgs, manifest)
    assert outcomes(fourth) == (4, 0, 0, 0)
    assert fourth["summary"]["compiler_invocations"] == 0

    # `farm gc` deletes the earlier build's keys, and only those
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), FARM_FAMILY_MODULES=json.dumps(["userkernels.scale"]),
               PYTHONPATH=str(pkgs), PYTHONDONTWRITEBYTECODE="1")
    dry = subprocess.run([str(FARM), "gc", "--dry-run", "--json"], env=env, text=True,
                         capture_output=True, check=True)
    assert len(json.loads(dry.stdout)["stale"]) == 2 and rows(home) == stored2
    gone = subprocess.run([str(FARM), "gc", "--json"], env=env, text=True,
                          capture_output=True, check=True)
    assert {(s["key"].split(".")[0], s["build_id"]) for s in
            json.loads(gone.stdout)["stale"]} == user1
    assert set(rows(home)) == set(stored2) - user1
    assert outcomes(build(home, pkgs, manifest)) == (4, 0, 0, 0)


def test_identical_sources_compile_once_and_copies_keep_both_keys(
        setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    pkgs, home, _ = setup
    twins = tmp_path / "twins.toml"
    kernel = textwrap.dedent("""
        [[kernels]]
        family = "user_scale"
        params = {{ factor = 3.0, tag = "{tag}" }}
        """)
    head = 'format = 1\nname = "twins"\n'
    twins.write_text(head + kernel.format(tag="a") + kernel.format(tag="b"))
    first = build(home, pkgs, twins)
    assert outcomes(first) == (0, 1, 1, 0)
    assert first["summary"]["compiler_invocations"] == 1
    stored = rows(home)
    assert len(stored) == 2 and set(stored.values()) == {USER_FAMILY}
    assert len({i for i, _ in stored}) == 2 and len({b for _, b in stored}) == 1

    # a third twin in a later batch is rekeyed from the source index, by copy
    twins.write_text(head + "".join(kernel.format(tag=t) for t in "abc"))
    second = build(home, pkgs, twins)
    assert outcomes(second) == (2, 1, 0, 0)
    assert second["summary"]["compiler_invocations"] == 0
    after = rows(home)
    assert set(stored) < set(after) and len(after) == 3
