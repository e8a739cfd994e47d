"""``farm build`` end to end on the local device (PoCL on the CPU).

What this file proves, each against the real CLI in a subprocess unless it says
in-process (the drivers' own caches are off in every run, so a compile is a compile):

* the tiny manifest builds, then builds again all ``Loaded`` with no compiler call;
* in-process, a second build goes through a compiler that fails the test when used,
  a ``finalize`` that fails when called and an OpenCL ``Program.build`` that fails on
  source: it completes all ``Loaded``;
* the first build writes a session with its compilation records; a build that only
  loads writes no session;
* a corrupted stored artifact is detected, never handed to the device, recompiled
  (``Compiled``) and repaired (the next build is all ``Loaded``);
* a kernel whose OpenCL C does not compile fails the build (exit 1, its build log
  printed), the other kernels are stored, nothing of the bad one is;
* a tuning candidate the device cannot run is ``unsupported`` (exit 0), and a failure
  under ``--strict`` (exit 1).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from farm.core.outcomes import Outcome
from farm.core.settings import Settings
from farm.records import CompilationBatchRecord, CompilationRecord, SessionStorage

FARM = Path(sys.executable).with_name("farm")
TINY_KERNELS = 20


# -- helpers ----------------------------------------------------------------------------
def farm_env(home: Path, **extra: str) -> dict[str, str]:
    """The test process's environment without FARM_*, plus FARM_HOME and caches off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               CUDA_CACHE_DISABLE="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def farm(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FARM), *args], env=farm_env(home, **env), capture_output=True,
                          text=True, timeout=300, check=False)


def build_json(home: Path, manifest: str | Path, *flags: str, expect_rc: int = 0,
               **env: str) -> dict[str, Any]:
    proc = farm(home, "build", str(manifest), "--workers", "2", "--json", *flags, **env)
    assert proc.returncode == expect_rc, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def store_path(home: Path) -> Path:
    return home / "envs" / "default" / "store.sqlite"


def records_url(home: Path) -> str:
    return f"sqlite:///{home / 'envs' / 'default' / 'records.sqlite'}"


def artifact_rows(home: Path) -> list[tuple[str, str, str]]:
    """(id_hash, build_id, family) of every stored artifact."""
    conn = sqlite3.connect(store_path(home))
    try:
        rows = conn.execute("SELECT id_hash, build_id, meta FROM artifacts").fetchall()
    finally:
        conn.close()
    return sorted((r[0], r[1], json.loads(r[2])["family"]) for r in rows)


def sessions(home: Path) -> list[Any]:
    storage = SessionStorage(records_url(home))
    try:
        return [(s, storage.records(s.id)) for s in storage.sessions()]
    finally:
        storage.close()


def settings_for(home: Path, **extra: Any) -> Settings:
    return Settings(home=home, environment="default", records_url=None, device=None,
                    family_modules=[], keep_sessions=None, records_level="basic", **extra)


def expand_tiny(registry: Any) -> list[Any]:
    from farm.manifest import expand, load_manifest, resolve_manifest

    return [e.artifact for e in expand(load_manifest(resolve_manifest("tiny")), registry)]


@dataclass
class TwoBuilds:
    home: Path
    first: dict[str, Any]
    second: dict[str, Any]
    sessions_after_first: list[Any]
    sessions_after_second: list[Any]
    rows_after_first: list[tuple[str, str, str]]


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory: pytest.TempPathFactory) -> TwoBuilds:
    """The tiny manifest built twice in one fresh FARM_HOME (CLI, --workers 2)."""
    home = tmp_path_factory.mktemp("tiny-home")
    first = build_json(home, "tiny")
    after_first = sessions(home)
    rows = artifact_rows(home)
    second = build_json(home, "tiny")
    return TwoBuilds(home, first, second, after_first, sessions(home), rows)


@pytest.fixture
def built_copy(two_builds: TwoBuilds, tmp_path: Path) -> Path:
    """A private copy of the twice-built FARM_HOME, for tests that change it."""
    home = tmp_path / "home"
    shutil.copytree(two_builds.home, home)
    return home


# -- build twice ----------------------------------------------------------------------------
def test_first_build_compiles_every_kernel(two_builds: TwoBuilds) -> None:
    s = two_builds.first["summary"]
    assert s["kernels"] == TINY_KERNELS
    assert s["compiled"] + s["rekeyed"] == TINY_KERNELS
    assert s["compiled"] == s["compiler_invocations"] > 0
    assert s["loaded"] == 0 and s["failed"] == 0 and s["unsupported"] == 0
    assert two_builds.first["failures"] == [] and two_builds.first["unsupported"] == []
    assert s["parallelism"] == 2
    assert s["work_s"] > 0 and s["wall_s"] > 0
    assert len(two_builds.rows_after_first) == TINY_KERNELS
    # the work, split by step, adds up to the whole (rounding aside); PoCL has no linker
    parts = s["work_parts"]
    assert abs(sum(parts.values()) - s["work_s"]) < 0.01
    assert parts["compile"] > parts["lower"] > 0 and parts["validate"] > 0
    assert parts["store"] > 0 and parts["native"] == parts["fetch"] == parts["worker"] == 0


def test_second_build_is_all_loaded_without_compiling(two_builds: TwoBuilds) -> None:
    s = two_builds.second["summary"]
    assert s["kernels"] == TINY_KERNELS
    assert s["loaded"] == TINY_KERNELS
    assert s["compiled"] == s["rekeyed"] == s["failed"] == s["unsupported"] == 0
    assert s["compiler_invocations"] == 0
    assert two_builds.second["fingerprint"] == two_builds.first["fingerprint"]
    # loading is much cheaper than compiling (a compile is ~0.5 s on PoCL, a load ~ms)
    assert s["work_s"] < two_builds.first["summary"]["work_s"] / 5
    assert s["work_parts"]["fetch"] == pytest.approx(s["work_s"], abs=0.01)
    assert artifact_rows(two_builds.home) == two_builds.rows_after_first


def test_first_build_writes_a_session_with_its_records(two_builds: TwoBuilds) -> None:
    (session, records), = two_builds.sessions_after_first
    assert session.label == "build tiny"
    compilations = [r for r in records if isinstance(r, CompilationRecord)]
    batches = [r for r in records if isinstance(r, CompilationBatchRecord)]
    assert len(compilations) == TINY_KERNELS
    assert {r.outcome for r in compilations} <= {Outcome.COMPILED, Outcome.REKEYED}
    assert all(r.family and r.key for r in compilations)
    stored = {f"{i}.{b}" for i, b, _ in two_builds.rows_after_first}
    assert {r.key for r in compilations} == stored
    assert len(batches) == 1
    assert batches[0].kernels == TINY_KERNELS and batches[0].compiled > 0
    seqs = [r.stamp.seq for r in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_a_build_that_only_loads_writes_no_session(two_builds: TwoBuilds) -> None:
    first_ids = [s.id for s, _ in two_builds.sessions_after_first]
    assert [s.id for s, _ in two_builds.sessions_after_second] == first_ids
    assert [len(r) for _, r in two_builds.sessions_after_second] == \
        [len(r) for _, r in two_builds.sessions_after_first]


class Forbidden:
    """A compiler that fails the test when the batch asks it for anything."""

    parallelism = 1

    def submit(self, lowered: Any) -> Any:
        pytest.fail(f"the compiler was asked to compile {lowered.kernel_names}")

    def close(self) -> None:
        pass


def test_second_build_never_calls_the_platform_compiler(
        built_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyopencl as cl

    import farm.compilation.compiler
    import farm.compilation.finalize
    from farm.compilation.local import local_farm

    def no_finalize(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("finalize was called")

    monkeypatch.setattr(farm.compilation.finalize, "finalize", no_finalize)
    monkeypatch.setattr(farm.compilation.compiler, "finalize_and_validate", no_finalize)
    source_builds: list[str] = []
    real_build = cl.Program.build

    def guarded_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_source", None) is not None:  # built from OpenCL C: a compile
            source_builds.append(str(self._source)[:80])
            raise AssertionError("Program.build on source during a load-only build")
        return real_build(self, *args, **kwargs)

    monkeypatch.setattr(cl.Program, "build", guarded_build)
    with local_farm(settings_for(built_copy), label="test load-only",
                    compiler=Forbidden()) as f:
        report = f.batch(keep_programs=True).run(expand_tiny(f.registry))
    assert source_builds == []
    assert report.count(Outcome.LOADED) == TINY_KERNELS
    assert report.compiler_invocations == 0
    assert not report.failed and not report.unsupported
    assert all(r.program is not None and r.program.all_kernels() for r in report.results)
    assert len(sessions(built_copy)) == 1  # this build only observed, too


# -- integrity -------------------------------------------------------------------------------
def test_corrupted_artifact_is_detected_recompiled_and_repaired(
        built_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import farm.compilation.batch
    from farm.compilation.local import local_farm

    conn = sqlite3.connect(store_path(built_copy))
    id_hash, build_id, binary = conn.execute(
        "SELECT id_hash, build_id, binary FROM artifacts ORDER BY id_hash LIMIT 1").fetchone()
    evil = bytearray(binary)
    mid = len(evil) // 2
    evil[mid:mid + 16] = bytes(b ^ 0xFF for b in evil[mid:mid + 16])
    conn.execute("UPDATE artifacts SET binary=? WHERE id_hash=? AND build_id=?",
                 (bytes(evil), id_hash, build_id))
    conn.commit()
    conn.close()

    loaded_binaries: list[bytes] = []
    real_load = farm.compilation.batch.load_binary

    def spy_load(ctx: Any, dev: Any, binary: bytes, *names: Any, **kw: Any) -> Any:
        assert binary != bytes(evil), "the corrupted binary reached the device"
        loaded_binaries.append(binary)
        return real_load(ctx, dev, binary, *names, **kw)

    monkeypatch.setattr(farm.compilation.batch, "load_binary", spy_load)
    # keep_programs: every kernel is loaded in this process (the loader's path), so the
    # spy sees every binary that reaches the device.
    with local_farm(settings_for(built_copy), label="test corrupt", workers=0) as f:
        report = f.batch(keep_programs=True).run(expand_tiny(f.registry))
        corrupt_seen = f.store.stats.corrupt
    by_id = {r.key.id_hash: r for r in report.results if r.key}
    assert by_id[id_hash].outcome is Outcome.COMPILED
    assert report.count(Outcome.LOADED) == TINY_KERNELS - 1
    assert report.compiler_invocations == 1
    assert corrupt_seen == 1
    assert len(loaded_binaries) == TINY_KERNELS

    conn = sqlite3.connect(store_path(built_copy))
    (repaired,) = conn.execute("SELECT binary FROM artifacts WHERE id_hash=? AND build_id=?",
                               (id_hash, build_id)).fetchone()
    conn.close()
    assert repaired != bytes(evil)
    third = build_json(built_copy, "tiny")["summary"]
    assert third["loaded"] == TINY_KERNELS and third["compiler_invocations"] == 0


# -- a kernel that does not compile, and --strict ---------------------------------------------
BROKEN_FAMILY = '''
"""A user family whose OpenCL C has a syntax error."""
from __future__ import annotations

import numpy as np

from farm.families.base import Example, KernelFamily, Params
from farm.core.model import Lowered


class BrokenParams(Params):
    n: int = 1


class Broken(KernelFamily[BrokenParams]):
    name = "user_broken"
    params_model = BrokenParams

    def lower(self, params, launch, device):
        source = ("__kernel void user_broken(__global float *x)\\n"
                  "{\\n"
                  "    x[get_global_id(0)] = * ;\\n"
                  "}\\n")
        return Lowered(source=source, kernel_names=("user_broken",))

    def example(self, params, launch, rng):
        x = np.zeros(4, np.float32)
        return Example(kernel_name="user_broken", args=[x], global_size=(4,),
                       local_size=None, expected={0: x})


FAMILIES = [Broken]
'''


@pytest.fixture
def broken_package(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkgs" / "brokenkernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "broken.py").write_text(BROKEN_FAMILY)
    return tmp_path / "pkgs"


def test_a_kernel_that_does_not_compile_fails_alone(tmp_path: Path,
                                                     broken_package: Path) -> None:
    manifest = tmp_path / "mixed.toml"
    manifest.write_text(textwrap.dedent("""\
        format = 1
        name = "mixed"

        [[kernels]]
        family = "elementwise_binary"
        params = { op = "sub" }

        [[kernels]]
        family = "user_broken"
        params = { n = 3 }

        [[kernels]]
        family = "elementwise_unary"
        params = { op = "relu" }
        """))
    home = tmp_path / "home"
    env = {"PYTHONPATH": str(broken_package),
           "FARM_FAMILY_MODULES": json.dumps(["brokenkernels.broken"])}
    proc = farm(home, "build", str(manifest), "--workers", "2", **env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "Traceback" not in text
    assert "FAILED" in proc.stdout and "user_broken" in proc.stdout
    log_lines = [line for line in proc.stdout.splitlines() if line.startswith("    | ")]
    assert log_lines, proc.stdout
    assert any("error" in line.lower() for line in log_lines)

    rows = artifact_rows(home)
    assert sorted(f for _, _, f in rows) == ["elementwise_binary", "elementwise_unary"]

    # Again, as JSON: the good kernels load, the bad one is compiled (and fails) again.
    again = build_json(home, manifest, expect_rc=1, **env)
    s = again["summary"]
    assert (s["loaded"], s["compiled"], s["failed"]) == (2, 0, 1)
    assert s["compiler_invocations"] == 1
    (failure,) = again["failures"]
    assert failure["kind"] == "compile" and failure["kernel"]["family"] == "user_broken"
    assert "error" in failure["build_log"].lower()
    assert artifact_rows(home) == rows


def test_unsupported_candidate_counts_apart_unless_strict(tmp_path: Path) -> None:
    manifest = tmp_path / "tuning.toml"
    manifest.write_text(textwrap.dedent("""\
        format = 1
        name = "tuning"

        [[kernels]]
        family = "matmul"
        params = { m = 64, n = 64, k = 64, tile_m = 128, tile_n = 128, tile_k = 16 }

        [[kernels]]
        family = "elementwise_unary"
        params = { op = "relu" }
        """))
    home = tmp_path / "home"
    lenient = build_json(home, manifest, expect_rc=0)
    s = lenient["summary"]
    assert (s["kernels"], s["compiled"], s["unsupported"], s["failed"]) == (2, 1, 1, 0)
    (unsupported,) = lenient["unsupported"]
    assert unsupported["kind"] == "unsupported"
    assert "16384" in unsupported["message"]
    assert lenient["failures"] == []

    strict = build_json(home, manifest, "--strict", expect_rc=1)
    s = strict["summary"]
    assert (s["loaded"], s["unsupported"], s["compiler_invocations"]) == (1, 1, 0)
    assert sorted(f for _, _, f in artifact_rows(home)) == ["elementwise_unary"]


@pytest.fixture(autouse=True)
def _no_stray_farm_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In-process farms read settings too: keep the caller's FARM_* out of them."""
    for name in list(os.environ):
        if name.startswith("FARM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYOPENCL_NO_CACHE", "1")
    monkeypatch.setenv("POCL_KERNEL_CACHE", "0")
    yield
