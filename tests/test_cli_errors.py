"""Bad input to the real ``farm`` CLI: one line, a non-zero exit, no traceback, no harm.

Each case runs ``farm build`` in a subprocess and checks that stderr is exactly one
line starting with ``error:`` that names the file and the line or field, that the exit
status is 2 (bad input), and that nothing already stored changed: a foreign or garbage
store file is byte-identical afterwards, and a real store keeps every row after a
build that a bad manifest stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FARM = Path(sys.executable).with_name("farm")


def run_farm(home: Path, *args: str, cwd: Path | None = None,
             **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    full.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
                CUDA_CACHE_DISABLE="1")
    full.update(env)
    return subprocess.run([str(FARM), *args], env=full, cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)


def one_error_line(proc: subprocess.CompletedProcess[str], rc: int = 2) -> str:
    """The single ``error:`` line of a refused command (after checking the rest)."""
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, both
    assert proc.returncode == rc, both
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    return lines[0]


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- manifests ------------------------------------------------------------------------------
GOOD_HEAD = 'format = 1\nname = "bad"\n\n'

CASES = {
    # name: (manifest text, what the line must contain besides the file name)
    "syntax": (GOOD_HEAD + '[[kernels]]\nfamily = "matmul"\nparams = { m = 8, n = 8 k = 8 }\n',
               [":6:", "TOML syntax error"]),
    "unknown-family": (GOOD_HEAD + '[[kernels]]\nfamily = "elementwise_unary"\n'
                       'params = { op = "relu" }\n\n[[kernels]]\nfamily = "no_such_family"\n',
                       [":9:", "kernels[1].family", "no_such_family"]),
    "out-of-range": (GOOD_HEAD + '[[kernels]]\nfamily = "matmul"\n'
                     'params = { m = 64, n = 64, k = 999999 }\n',
                     [":6:", "kernels[0].params.k", "less than or equal"]),
    "bad-choice": (GOOD_HEAD + '[[kernels]]\nfamily = "elementwise_unary"\n'
                   'params = { op = "frobnicate" }\n',
                   [":6:", "kernels[0].params.op"]),
    "wrong-type": (GOOD_HEAD + '[[kernels]]\nfamily = "reduce"\n'
                   'params = { op = "sum", cols = "many" }\n',
                   [":6:", "kernels[0].params.cols"]),
    "wrong-type-table": (GOOD_HEAD + '[[kernels]]\nfamily = "reduce"\nparams = 7\n',
                         [":6:", "kernels[0].params"]),
    "unknown-key": (GOOD_HEAD + '[[kernels]]\nfamily = "reduce"\nparams = { op = "sum" }\n'
                    'colour = "blue"\n', [":7:", "kernels[0].colour", "unknown key"]),
    "truncated": (GOOD_HEAD + '[[kernels]]\nfamily = "matmul"\nparams = { m = 8, n = 8, k',
                  [":6:", "truncated"]),
    "wrong-format": ("format = 7\n[[kernels]]\nfamily = \"reduce\"\n",
                     [":1:", "format", "not supported"]),
    "empty": ("# nothing here\n\n", ["no keys"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_manifest_is_one_line(case: str, tmp_path: Path) -> None:
    text, expected = CASES[case]
    manifest = tmp_path / f"{case}.toml"
    manifest.write_text(text)
    line = one_error_line(run_farm(tmp_path / "home", "build", str(manifest)))
    assert str(manifest) in line
    for part in expected:
        assert part in line, line


def test_binary_garbage_is_one_line(tmp_path: Path) -> None:
    noise = random.Random(7).randbytes(4096)
    for name, data in (("noise.toml", noise.replace(b"\0", b"\1")),
                       ("nul.toml", b'format = 1\nname = "x"\n\0\0\0' + noise)):
        path = tmp_path / name
        path.write_bytes(data)
        line = one_error_line(run_farm(tmp_path / "home", "build", str(path)))
        assert str(path) in line
        assert "UTF-8" in line or "binary" in line, line
    assert "binary data" in line and ":3:" in line  # the NUL is on line 3


def test_directory_and_missing_file(tmp_path: Path) -> None:
    folder = tmp_path / "models.toml"
    folder.mkdir()
    line = one_error_line(run_farm(tmp_path / "home", "build", str(folder)))
    assert str(folder) in line and "directory" in line
    missing = tmp_path / "nowhere" / "model.toml"
    line = one_error_line(run_farm(tmp_path / "home", "build", str(missing)))
    assert str(missing) in line and "no such file" in line


# -- stores that are not ours ----------------------------------------------------------------
def _garbage(path: Path) -> None:
    path.write_bytes(random.Random(11).randbytes(8192))


def _other_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE people (name TEXT)")
    conn.execute("INSERT INTO people VALUES ('ada')")
    conn.commit()
    conn.close()


def _other_meta(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT)")
    conn.execute("INSERT INTO meta VALUES ('format', 'someone-elses-cache')")
    conn.commit()
    conn.close()


def _truncated_sqlite(path: Path) -> None:
    _other_sqlite(path)
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize("make", [_garbage, _other_sqlite, _other_meta, _truncated_sqlite],
                         ids=["garbage", "other-sqlite", "other-meta", "truncated-sqlite"])
def test_foreign_store_file_is_refused_untouched(make: object, tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = home / "envs" / "default" / "store.sqlite"
    store.parent.mkdir(parents=True)
    make(store)  # type: ignore[operator]
    before = digest(store)
    line = one_error_line(run_farm(home, "build", "tiny", "--workers", "0"))
    assert str(store) in line and "not a kernel-farm store" in line, line
    assert digest(store) == before
    assert sorted(p.name for p in store.parent.iterdir()) == ["store.sqlite"]


def test_store_that_is_a_directory(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = home / "envs" / "default" / "store.sqlite"
    store.mkdir(parents=True)
    line = one_error_line(run_farm(home, "build", "tiny", "--workers", "0"))
    assert str(store) in line and "not a file" in line


def test_foreign_records_file_is_refused_untouched(tmp_path: Path) -> None:
    home = tmp_path / "home"
    records = home / "envs" / "default" / "records.sqlite"
    records.parent.mkdir(parents=True)
    _other_sqlite(records)
    before = digest(records)
    line = one_error_line(run_farm(home, "build", "tiny", "--workers", "0"))
    assert str(records) in line, line
    assert digest(records) == before


# -- a real store survives a failed build ------------------------------------------------------
def _store_rows(path: Path) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    conn = sqlite3.connect(path)
    try:
        arts = conn.execute("SELECT namespace, id_hash, build_id, digest, size, meta, binary "
                            "FROM artifacts ORDER BY 1, 2, 3").fetchall()
        srcs = conn.execute("SELECT * FROM sources ORDER BY 1, 2").fetchall()
    finally:
        conn.close()
    return arts, srcs


def test_store_keeps_its_artifacts_after_a_failed_build(tmp_path: Path) -> None:
    home = tmp_path / "home"
    good = write(tmp_path / "good.toml", """\
        format = 1
        [[kernels]]
        family = "elementwise_unary"
        params = { op = "relu" }
        """)
    proc = run_farm(home, "build", str(good), "--workers", "0", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["summary"]["compiled"] == 1
    store = home / "envs" / "default" / "store.sqlite"
    before = _store_rows(store)
    assert len(before[0]) == 1

    # bad after the store is open (the families check the parameters), and bad before
    bad_params = write(tmp_path / "bad.toml", """\
        format = 1
        [[kernels]]
        family = "elementwise_unary"
        params = { op = "relu" }

        [[kernels]]
        family = "matmul"
        params = { m = 0, n = 8, k = 8 }
        """)
    line = one_error_line(run_farm(home, "build", str(bad_params), "--workers", "0"))
    assert f"{bad_params}:8:" in line and "kernels[1].params.m" in line
    assert _store_rows(store) == before
    bad_syntax = write(tmp_path / "syntax.toml", "format = 1\n[[kernels]\n")
    one_error_line(run_farm(home, "build", str(bad_syntax), "--workers", "0"))
    assert _store_rows(store) == before

    again = run_farm(home, "build", str(good), "--workers", "0", "--json")
    assert json.loads(again.stdout)["summary"]["loaded"] == 1


# -- settings --------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "value"), [
    ("FARM_WORKERS", "-1"),
    ("FARM_RECORDS_LEVEL", "loud"),
    ("FARM_KEEP_SESSIONS", "many"),
    ("FARM_ENVIRONMENT", "../escape"),
    ("FARM_FAMILY_MODULES", "not json"),
    ("FARM_FAMILY_MODULES", '["no_such_module_xyz"]'),
])
def test_bad_setting_is_one_line_naming_it(name: str, value: str, tmp_path: Path) -> None:
    proc = run_farm(tmp_path / "home", "build", "tiny", "--workers", "0", **{name: value})
    line = one_error_line(proc)
    assert name in line or "no_such_module_xyz" in line, line
    assert not (tmp_path / "home" / "envs").exists()  # refused before anything is made


@pytest.mark.parametrize(("args", "says"), [
    (("build", "tiny", "--workers", "-3"), "'--workers'"),
    (("records", "prune", "--keep", "-1"), "'--keep'"),
    (("build", "tiny", "--no-such-flag"), "--no-such-flag"),
    (("build",), "'MANIFEST'"),
    (("gc", "--namespace", "../v1/x"), "--namespace"),
])
def test_bad_flag_is_one_line(args: tuple[str, ...], says: str, tmp_path: Path) -> None:
    line = one_error_line(run_farm(tmp_path / "home", *args))
    assert says in line
