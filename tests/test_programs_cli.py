"""Bad input to ``farm run``, ``farm capture`` and ``farm build CAPTURE``: one clear line,
a non-zero exit, no traceback, nothing stored.

A capture is input (it may be edited by hand, truncated, or come from elsewhere): each
way it can be wrong is refused before anything is built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from farm.core.hashing import sha256_hex
from farm.programs.capture import read_capture

KERNEL = "__kernel void f(__global int *a) { a[0] = VALUE; }\n"
APP = f"""
import sys
import pyopencl as cl
ctx = cl.create_some_context(interactive=False)
cl.Program(ctx, '#include "value.h"\\n' + {KERNEL!r}).build(["-I", sys.argv[1]])
"""


def _farm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               PYOPENCL_CTX="0")
    return env


def _one_line(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real capture of a one-program application with a header."""
    root = tmp_path_factory.mktemp("captured")
    (root / "inc").mkdir()
    (root / "inc" / "value.h").write_text("#define VALUE 5\n")
    (root / "app.py").write_text(APP)
    proc = _farm(_env(root / "home"), "capture", str(root / "c.json"), "--",
                 sys.executable, str(root / "app.py"), str(root / "inc"))
    assert proc.returncode == 0, proc.stderr
    return json.loads((root / "c.json").read_text())


Edit = Callable[[dict[str, Any]], Any]


def _source_of(c: dict[str, Any]) -> str:
    return c["programs"][0]["spec"]["source"]


def _edit_blob(c: dict[str, Any]) -> None:
    c["blobs"][_source_of(c)]["text"] = KERNEL.replace("VALUE", "666")


def _drop_blob(c: dict[str, Any]) -> None:
    del c["blobs"][_source_of(c)]


def _bad_path(c: dict[str, Any]) -> None:
    c["programs"][0]["spec"]["headers"][0]["path"] = "../../etc/passwd"


def _bad_fingerprint(c: dict[str, Any]) -> None:
    c["programs"][0]["fingerprints"] = ["../Not A Fingerprint"]


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c.update(version=2), ("format version 2",)),
    (lambda c: c.update(format="something-else"), ("not a kernel-farm capture",)),
    (_edit_blob, ("does not hold the bytes",)),
    (_drop_blob, ("lacks",)),
    (_bad_path, ("not a relative header path",)),
    (_bad_fingerprint, ("fingerprint",)),
    (lambda c: c["programs"][0]["spec"].update(source="zz"), ("programs.0.spec.source",)),
])
def test_a_capture_edited_by_hand_is_refused_in_one_line(
        captured: dict[str, Any], tmp_path: Path, edit: Edit, words: tuple[str, ...]) -> None:
    data = json.loads(json.dumps(captured))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    proc = _farm(_env(tmp_path / "home"), "build", str(path))
    assert proc.returncode == 2
    _one_line(proc, f"capture {path}", *words)
    assert not (tmp_path / "home").exists() or not list((tmp_path / "home").rglob("*.sqlite"))


def test_a_truncated_or_garbage_capture_is_refused_in_one_line(
        captured: dict[str, Any], tmp_path: Path) -> None:
    text = json.dumps(captured)
    for name, body in (("truncated.json", text[: len(text) // 2]), ("garbage.json", "{\xff"),
                       ("list.json", "[1, 2]")):
        path = tmp_path / name
        path.write_text(body)
        proc = _farm(_env(tmp_path / "home"), "build", str(path))
        assert proc.returncode == 2, proc.stderr
        _one_line(proc, f"capture {path}")


def test_a_spec_whose_headers_do_not_resolve_as_it_says_compiles_nothing(
        captured: dict[str, Any], tmp_path: Path) -> None:
    """Every digest valid, but a header laid out under another name than its include
    line says: the key would not be what the inputs produce, so nothing is compiled; and
    a spec that drops its header compiles (and fails) as the compiler says."""
    for how, kind in (("renamed", "validation"), ("dropped", "compile")):
        data = json.loads(json.dumps(captured))
        spec = data["programs"][0]["spec"]
        if how == "renamed":
            for header in spec["headers"]:
                header["path"] = "other.h"
        else:
            spec["includes"] = [[n, q, []] for n, q, _ in spec["includes"]]
            spec["headers"] = []
        path = tmp_path / f"{how}.json"
        path.write_text(json.dumps(data))
        read_capture(path)  # valid as a file
        home = tmp_path / f"home-{how}"
        proc = _farm(_env(home), "build", str(path), "--json")
        assert proc.returncode == 1, proc.stderr
        failure = json.loads(proc.stdout)["builds"][0]["failures"][0]
        assert failure["kind"] == kind, failure
        from farm.store import SQLiteStore

        store = SQLiteStore(next(home.rglob("store.sqlite")))
        assert all(not list(store.keys(ns)) for ns in store.namespaces())
        store.close()


def test_a_capture_builds_here_and_its_programs_are_then_served(
        captured: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(captured))
    env = _env(tmp_path / "home")
    first = _farm(env, "build", str(path), "--json", "--workers", "1")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["builds"][0]["summary"]["compiled"] == 1
    again = json.loads(_farm(env, "build", str(path), "--json").stdout)
    assert again["builds"][0]["summary"]["loaded"] == 1
    inc = tmp_path / "elsewhere"  # the application runs from another folder: same key
    inc.mkdir()
    (inc / "value.h").write_text("#define VALUE 5\n")
    (tmp_path / "app.py").write_text(APP)
    counts = tmp_path / "counts.json"
    run = _farm(env, "run", "--json", str(counts), "--", sys.executable,
                str(tmp_path / "app.py"), str(inc))
    assert run.returncode == 0, run.stderr
    assert json.loads(counts.read_text()) == {"programs": 1, "loaded": 1, "compiled": 0,
                                              "fallbacks": 0, "failed": 0}
    assert sha256_hex(captured["blobs"][_source_of(captured)]["text"]) == _source_of(captured)


def test_a_capture_for_a_device_that_is_not_here_says_so(
        captured: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(captured))
    proc = _farm(_env(tmp_path / "home"), "build", str(path), "--local", "--fingerprint",
                 "nvidia-some-gpu-0123456789ab")
    _one_line(proc, "nvidia-some-gpu-0123456789ab", "--cluster")


def test_farm_run_refuses_what_it_cannot_run_in_one_line(tmp_path: Path) -> None:
    env = _env(tmp_path / "home")
    assert _farm(env, "run", "--", "no-such-command-here").returncode == 2
    _one_line(_farm(env, "run", "--", "no-such-command-here"), "command not found")
    _one_line(_farm(env, "run", "--json", str(tmp_path / "no" / "dir.json"), "--", "true"),
              "folder does not exist")
    proc = _farm(env, "run", "--", sys.executable, "-c", "import sys; sys.exit(7)")
    assert proc.returncode == 7 and "programs 0" in proc.stderr


def test_farm_runs_own_process_imports_none_of_the_heavy_modules() -> None:
    """``farm run``'s own process is paid on every run of an application: it must not
    import pydantic, typing, dataclasses, tenacity or importlib.abc (each was there
    once, 60 ms in all; docs/BENCHMARKS.md, "the farm's start-up trimmed"), nor
    subprocess, tempfile or pathlib (20 to 30 ms more; farm.programs.runner)."""
    heavy = ("pydantic", "typing", "dataclasses", "tenacity", "importlib.abc", "subprocess",
             "tempfile", "pathlib")
    probe = ("import sys, farm.cli.entry, farm.programs.runner\n"
             f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env=env, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == "", f"farm run's process imported {out.stdout.strip()}"
