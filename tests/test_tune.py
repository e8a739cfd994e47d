"""``farm tune`` on the local PoCL device, end to end through the CLI and fresh processes.

Two manifests share one FARM_HOME: two matrix shapes with three matmul candidates each
(a 4x4 tile that is very poor on a CPU, the default 16x16, a 64x64 tile with register
blocking), and one problem of the test family ``twice`` (tests/tunefam) whose fastest
candidate computes wrong values and whose last cannot run on a CPU device.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FARM = Path(sys.executable).with_name("farm")
TUNEFAM = Path(__file__).resolve().parent / "tunefam"
#: light timing: these tests check what is chosen and kept, not how fast it is
FAST = ("--min-launches", "5", "--min-ms", "2", "--budget", "20")

MATMUL_TOML = """
format = 1
name = "three-tiles"
{kernels}
"""
TILES = ("tile_m = 4, tile_n = 4, tile_k = 4",
         "tile_m = 16, tile_n = 16, tile_k = 16",
         "tile_m = 64, tile_n = 64, tile_k = 16, wpt_m = 4, wpt_n = 4")
SHAPES = ({"m": 128, "n": 128, "k": 128}, {"m": 64, "n": 192, "k": 96})

TWICE_TOML = """
format = 1
name = "twice"
[[kernels]]
family = "twice"
params = { n = 65536, way = "slow" }
[[kernels]]
family = "twice"
params = { n = 65536, way = "lazy" }
[[kernels]]
family = "twice"
params = { n = 65536, way = "plain" }
[[kernels]]
family = "twice"
params = { n = 65536, way = "huge" }
"""


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               CUDA_CACHE_DISABLE="1", FARM_ISOLATION_DIR=str(home / "isolation"),
               FARM_FAMILY_MODULES='["tunefam"]', FARM_WORKERS="2",
               PYTHONPATH=os.pathsep.join([str(TUNEFAM), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def farm(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FARM), *args], env=env_for(home, **extra),
                          capture_output=True, text=True, timeout=600, check=False)


def tune_json(home: Path, manifest: Path, *flags: str, rc: int = 0) -> dict[str, Any]:
    out = home / f"tune-{len(list(home.glob('tune-*.json')))}.json"
    proc = farm(home, "tune", str(manifest), "--json", str(out), *FAST, *flags,
                COLUMNS="80")
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert all(len(line) <= 80 for line in proc.stdout.splitlines()), proc.stdout
    return {**json.loads(out.read_text()), "_stdout": proc.stdout, "_stderr": proc.stderr}


@dataclass
class Tuned:
    home: Path
    matmul: Path
    twice: Path
    first: dict[str, Any]
    wrong: dict[str, Any]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    home = tmp_path_factory.mktemp("tune-home")
    kernels = []
    for shape in SHAPES:
        for tiles in TILES:
            kernels.append(f'[[kernels]]\nfamily = "matmul"\nparams = {{ m = {shape["m"]}, '
                           f'n = {shape["n"]}, k = {shape["k"]}, {tiles} }}\n')
    matmul = home / "three.toml"
    matmul.write_text(MATMUL_TOML.format(kernels="\n".join(kernels)))
    twice = home / "twice.toml"
    twice.write_text(TWICE_TOML)
    first = tune_json(home, matmul)
    wrong = tune_json(home, twice, rc=1)
    return Tuned(home=home, matmul=matmul, twice=twice, first=first, wrong=wrong)


def test_the_json_has_exactly_its_keys_and_the_winner_is_the_fastest_right_one(
        tuned: Tuned) -> None:
    doc = tuned.first
    assert set(doc) - {"_stdout", "_stderr"} == {"fingerprint", "timed", "reused", "keys"}
    assert (doc["timed"], doc["reused"]) == (2, 0)
    assert [k["problem"] for k in doc["keys"]] == [{**s, "dtype": "float"} for s in SHAPES]
    for key in doc["keys"]:
        assert set(key) == {"family", "problem", "winner", "winner_ms", "first_ms",
                            "candidates"}
        assert len(key["candidates"]) == 3
        for cand in key["candidates"]:
            assert set(cand) == {"params", "ms", "spread", "status"}
            assert cand["status"] == "ok" and cand["ms"] > 0 and cand["spread"] >= 0
        fastest = min(key["candidates"], key=lambda c: c["ms"])
        assert key["winner"] == fastest["params"]
        assert key["winner_ms"] == fastest["ms"]
        assert key["first_ms"] == key["candidates"][0]["ms"]
        # the 4x4 tile, listed first, is not the winner: a 64x64 or 16x16 tile is
        assert key["winner"]["tile_m"] != 4
    assert "geometric-mean speedup over the first-listed candidates" in doc["_stdout"]
    # progress on stderr: the build's kernels, then the keys, with rate and ETA
    assert "building: 1/6 kernels" in doc["_stderr"]
    assert "tuning: 1/2 keys (50%)" in doc["_stderr"] and "ETA" in doc["_stderr"]


def test_a_wrong_candidate_is_never_chosen_and_an_unsupported_one_is_said(
        tuned: Tuned) -> None:
    (key,) = tuned.wrong["keys"]
    status = {c["params"]["way"]: c["status"] for c in key["candidates"]}
    assert status == {"slow": "ok", "lazy": "wrong", "plain": "ok", "huge": "unsupported"}
    assert key["winner"] == {"way": "plain"}
    lazy = next(c for c in key["candidates"] if c["params"]["way"] == "lazy")
    assert lazy["ms"] is None
    assert "lazy wrong: values differ from the reference" in tuned.wrong["_stderr"]


def test_a_second_tune_measures_nothing_and_retune_measures_again(tuned: Tuned) -> None:
    again = tune_json(tuned.home, tuned.matmul)
    assert (again["timed"], again["reused"]) == (0, 2)
    assert again["keys"] == tuned.first["keys"]  # the stored figures, not new ones
    assert "tuning:" not in again["_stderr"]  # nothing built, nothing timed
    redone = tune_json(tuned.home, tuned.matmul, "--retune")
    assert (redone["timed"], redone["reused"]) == (2, 0)
    fresh = tune_json(tuned.home, tuned.matmul)
    assert fresh["keys"] == redone["keys"]  # the retune replaced what was stored


FRESH = textwrap.dedent("""
    import json, sys
    import numpy as np
    from farm.families.run import check_example, run_example
    from loader import KernelLoader
    from farm.core.model import LaunchSettings

    problem = json.loads(sys.argv[1])
    with KernelLoader(on_miss="fail") as loader:
        got = loader.tuned("matmul", problem, on_miss="fail")
        family = loader.registry.get("matmul")
        example = family.example(family.validate(got.params), LaunchSettings(),
                                 np.random.default_rng(3))
        problems = check_example(run_example(loader.queue, got.kernel, example), example)
        print(json.dumps({"params": got.params, "tuned": got.tuned, "problems": problems,
                          "timing_imported": "farm.tuning.measure" in sys.modules,
                          "stats": loader.stats.snapshot()}))
""")


def test_a_fresh_process_gets_the_winner_without_timing_anything(tuned: Tuned) -> None:
    stored = tune_json(tuned.home, tuned.matmul)  # what the store holds now (reused)
    assert stored["timed"] == 0
    for key in stored["keys"]:
        proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(key["problem"])],
                              env=env_for(tuned.home), capture_output=True, text=True,
                              timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got["params"] == {**key["problem"], **key["winner"]}
        assert got["tuned"] and not got["problems"]  # the winner, loaded, computes right
        assert not got["timing_imported"]  # the timing code was not even loaded
        assert got["stats"]["compiled"] == 0 and got["stats"]["local"] == 1


def _first_session(home: Path, label: str) -> str:
    """The id of the oldest session labelled ``label``: the fixture's own tune, whatever
    the tests that ran before this one tuned since (``latest`` would be theirs, or the
    fixture's second tune, of ``twice``)."""
    proc = farm(home, "records", "sessions", "--json")
    assert proc.returncode == 0, proc.stderr
    ids = [s["id"] for s in json.loads(proc.stdout) if s["label"] == label]
    assert ids, proc.stdout
    return str(min(ids))


def test_the_records_show_each_tuning_as_a_changed_record(tuned: Tuned) -> None:
    session = _first_session(tuned.home, "tune three-tiles")
    proc = farm(tuned.home, "records", "tuning", session, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert str(doc["session"]) == session
    records = doc["records"]
    assert [r["kind"] for r in records] == ["records/v1/tune"] * 2
    assert {r["problem"] for r in records} == {
        " ".join(f"{k}={v}" for k, v in {**s, "dtype": "float"}.items()) for s in SHAPES}
    for r in records:
        assert r["winner"] is not None and r["candidates"][r["winner"]]["status"] == "ok"
        assert r["isolated"] is True
    table = farm(tuned.home, "records", "tuning", session, COLUMNS="80")
    assert table.returncode == 0 and "speedup" in table.stdout
    assert all(len(line) <= 80 for line in table.stdout.splitlines())
    sessions = farm(tuned.home, "records", "sessions", "--json")
    labels = [s["label"] for s in json.loads(sessions.stdout)]
    assert "tune three-tiles" in labels


def test_a_tampered_result_is_a_miss_never_a_crash(tuned: Tuned, tmp_path: Path) -> None:
    home = tmp_path / "home"
    subprocess.run(["cp", "-a", str(tuned.home), str(home)], check=True)
    db = home / "envs" / "default" / "store.sqlite"
    with sqlite3.connect(db) as conn:  # every tuning result and index: one byte changed
        rows = conn.execute("SELECT rowid, binary FROM artifacts WHERE meta LIKE "
                            "'%\"family\":\"tune%'").fetchall()
        assert len(rows) == 2 * 3  # three keys, each with its problem's index entry
        for rowid, data in rows:
            conn.execute("UPDATE artifacts SET binary = ? WHERE rowid = ?",
                         (data.replace(b'"ok"', b'"ko"', 1), rowid))
    problem = json.dumps(tuned.first["keys"][0]["problem"])
    proc = subprocess.run([sys.executable, "-c", FRESH, problem], env=env_for(home),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1
    assert "TuningMissing" in proc.stderr and "never tuned" in proc.stderr
    assert "fails its digest" in proc.stderr  # said, and treated as a miss
    again = tune_json(home, tuned.matmul)
    assert (again["timed"], again["reused"]) == (2, 0)  # measured again, stored again


def test_a_manifest_without_tuning_keys_is_one_line_and_status_2(tmp_path: Path) -> None:
    manifest = tmp_path / "none.toml"
    manifest.write_text('format = 1\n[[kernels]]\nfamily = "matmul"\n'
                        'params = { m = 8, n = 8, k = 8 }\n')
    proc = farm(tmp_path / "home", "tune", str(manifest))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "no tuning key" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bundle_carries_the_winners_to_a_machine_that_never_tuned(
        tuned: Tuned, tmp_path: Path) -> None:
    bundle = tmp_path / "tuned.bundle"
    exported = farm(tuned.home, "bundle", "export", str(bundle), "--all", "--json")
    assert exported.returncode == 0, exported.stderr
    home = tmp_path / "elsewhere"
    imported = farm(home, "bundle", "import", str(bundle), "--json")  # validates binaries
    assert imported.returncode == 0, imported.stdout + imported.stderr
    stored = tune_json(tuned.home, tuned.matmul)  # the winners stored over there
    reused = tune_json(home, tuned.matmul)
    assert (reused["timed"], reused["reused"]) == (0, 2)  # tuning results came along
    assert reused["keys"] == stored["keys"]
    for key in stored["keys"]:
        proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(key["problem"])],
                              env=env_for(home), capture_output=True, text=True,
                              timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got["params"] == {**key["problem"], **key["winner"]} and not got["problems"]
