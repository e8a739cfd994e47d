"""Issue 9, hostile input: one regression test per numbered finding, each failing before
its fix. The property tests of every surface are in ``tests/test_properties.py``.

1. a bundle whose metadata lies about its source hash cannot repoint another kernel's
   source-index entry (unit and end to end through ``farm build``);
2. a family whose OpenCL C lives in a ``.cl`` data file gets a new build id when that
   file changes, so the rebuild compiles instead of serving the old binary;
3. poison records stream entries never stop the ingester, and an old session entry with
   ``keep_sessions=0`` does not delete newer sessions;
4. Infinity and NaN are refused where they enter (records, bundles, payloads);
5. memory bounds: a huge manifest vocab, sparse tar members;
6. one line and an exit status, never a traceback (plugins, damaged stores, settings);
7. settings that used to be accepted and then did the wrong thing.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from farm.bundle import export_bundle, import_bundle
from farm.keys import Namespace
from farm.model import Artifact, Key, Lowered
from farm.store import MemoryStore, SQLiteStore

FARM = Path(sys.executable).with_name("farm")
NS = Namespace.for_fingerprint("pocl-test-device-0123456789ab")


def farm_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               CUDA_CACHE_DISABLE="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def farm(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FARM), *args], env=farm_env(home, **env), capture_output=True,
                          text=True, timeout=300, check=False)


def build(home: Path, manifest: Path, **env: str) -> dict[str, Any]:
    proc = farm(home, "build", str(manifest), "--workers", "0", "--json", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def outcomes(report: dict[str, Any]) -> tuple[int, int, int, int]:
    s = report["summary"]
    return s["loaded"], s["rekeyed"], s["compiled"], s["failed"]


def one_line_refusal(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    """A refusal as the standards want it: non-zero, no traceback, one line naming it."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# -- 1. the source index is never taken from imported metadata ------------------------------
def lowered(text: str) -> Lowered:
    return Lowered(source=text, kernel_names=("k",))


@pytest.mark.parametrize("make", [lambda p: SQLiteStore(p / "s.sqlite"), lambda p: MemoryStore()])
def test_a_lying_bundle_cannot_repoint_the_source_index(tmp_path: Path, make: Any) -> None:
    store = make(tmp_path)
    k_low = lowered("__kernel void k(__global float *x) { x[0] = 2.0f; }")
    k = Key(id_hash="a" * 32, build_id="1" * 24)
    store.put(NS, Artifact.create(k, "scale", b"K's binary", k_low.source_hash),
              source=k_low)
    # a bundle of one new key X whose metadata claims K's source hash
    x = Key(id_hash="b" * 32, build_id="1" * 24)
    scratch = SQLiteStore(tmp_path / "scratch.sqlite")
    scratch.put(NS, Artifact.create(x, "evil", b"X's binary", k_low.source_hash))
    export_bundle(scratch, None, tmp_path / "x.bundle")
    report = import_bundle(tmp_path / "x.bundle", store)
    assert report.imported == 1
    assert store.find_source(NS, k_low.source_hash) == k
    store.delete(NS, k)  # K's key goes (an upgrade, gc): the index must not name X
    assert store.find_source(NS, k_low.source_hash) is None


MANIFEST_ONE = 'format = 1\nname = "one"\n\n[[kernels]]\nfamily = "elementwise_unary"\n' \
               'params = { op = "relu" }\n'


def test_a_lying_bundle_never_makes_farm_build_serve_its_binary(tmp_path: Path) -> None:
    home = tmp_path / "home"
    manifest = tmp_path / "one.toml"
    manifest.write_text(MANIFEST_ONE)
    assert outcomes(build(home, manifest)) == (0, 0, 1, 0)
    path = home / "envs" / "default" / "store.sqlite"
    conn = sqlite3.connect(path)
    (ns_text, id_hash, build_id, meta_text), = conn.execute(
        "SELECT namespace, id_hash, build_id, meta FROM artifacts").fetchall()
    conn.close()
    ns = Namespace.parse(ns_text)
    k_meta = json.loads(meta_text)

    x = Key(id_hash="c" * 32, build_id=build_id)
    scratch = SQLiteStore(tmp_path / "scratch.sqlite")
    scratch.put(ns, Artifact.create(x, "elementwise_unary", b"not a program",
                                    k_meta["source_hash"]))
    scratch.close()
    export_bundle(SQLiteStore(tmp_path / "scratch.sqlite"), None, tmp_path / "x.bundle")
    proc = farm(home, "bundle", "import", str(tmp_path / "x.bundle"))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    store = SQLiteStore(path)
    store.delete(ns, Key(id_hash=id_hash, build_id=build_id))  # K's key goes
    store.close()
    again = build(home, manifest)
    assert outcomes(again) == (0, 0, 1, 0)  # compiled from its source, not "Rekeyed"
    store = SQLiteStore(path)
    got = store.get(ns, Key(id_hash=id_hash, build_id=build_id))
    assert got is not None and got.binary != b"not a program"
    store.close()


# -- 2. the build id covers data files --------------------------------------------------------
FAMILY_READING_A_CL_FILE = '''\
"""A family that keeps its OpenCL C in a data file next to it."""

from __future__ import annotations

from importlib import resources

import numpy as np

from farm.device import DeviceInfo
from farm.families.base import Example, KernelFamily, Params
from farm.model import LaunchSettings, Lowered


class ScaleParams(Params):
    n: int = 16


class ClScale(KernelFamily[ScaleParams]):
    name = "cl_scale"
    params_model = ScaleParams

    def lower(self, params: ScaleParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        source = resources.files("clkernels").joinpath("scale.cl").read_text()
        return Lowered(source=source, kernel_names=("cl_scale",))

    def example(self, params: ScaleParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        raise NotImplementedError


FAMILIES = [ClScale]
'''

CL_SOURCE = """\
__kernel void cl_scale(__global float *x, const uint n)
{
    const size_t i = get_global_id(0);
    if (i < n) x[i] = x[i] * FACTOR;
}
"""


def test_a_changed_cl_data_file_gives_a_new_build_id_and_a_compile(tmp_path: Path) -> None:
    pkgs, home = tmp_path / "pkgs", tmp_path / "home"
    pkg = pkgs / "clkernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Kernels kept in .cl files."""\n')
    (pkg / "family.py").write_text(FAMILY_READING_A_CL_FILE)
    (pkg / "scale.cl").write_text(CL_SOURCE.replace("FACTOR", "2.0f"))
    manifest = tmp_path / "cl.toml"
    manifest.write_text('format = 1\nname = "cl"\n\n[[kernels]]\nfamily = "cl_scale"\n')
    env = {"FARM_FAMILY_MODULES": json.dumps(["clkernels.family"]), "PYTHONPATH": str(pkgs)}

    assert outcomes(build(home, manifest, **env)) == (0, 0, 1, 0)
    assert outcomes(build(home, manifest, **env)) == (1, 0, 0, 0)
    (pkg / "scale.cl").write_text(CL_SOURCE.replace("FACTOR", "3.0f"))  # same size
    assert outcomes(build(home, manifest, **env)) == (0, 0, 1, 0)  # not "Loaded"
    conn = sqlite3.connect(home / "envs" / "default" / "store.sqlite")
    build_ids = {r[0] for r in conn.execute("SELECT build_id FROM artifacts")}
    conn.close()
    assert len(build_ids) == 2
    # a file the family never reads changes the id too (the package is the unit)
    (pkg / "notes.txt").write_text("anything")
    assert outcomes(build(home, manifest, **env)) == (0, 1, 0, 0)


def test_the_build_id_skips_byte_code_caches(tmp_path: Path) -> None:
    from farm.families.base import _root_digest

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    before = _root_digest(str(pkg))
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    _root_digest.cache_clear()
    assert _root_digest(str(pkg)) == before
    (pkg / "data.cl").write_text("x")
    _root_digest.cache_clear()
    assert _root_digest(str(pkg)) != before

