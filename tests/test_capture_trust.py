"""Issue 29, items 7 and 8: a capture (or a task) is input. Its build options go through an
application's option rules (no include folder, no option naming a file), its includes
never reach outside the headers it carries, and its reader has limits: nesting, integer
digits, a strict version, counts; the same program listed many times is built once, and
``farm build CAPTURE`` stops its compile processes when it is killed.

Every capture here is written as JSON by the test (as a hostile one would be), for the
device of this machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SECRET = "hunter2_SECRET_of_the_build_host"
KERNEL = "__kernel void f(__global int *a) { a[0] = 1; }\n"


@pytest.fixture(scope="module")
def fingerprint() -> str:
    from farm.core.device import probe_devices, select_device

    return select_device(probe_devices(), None).fingerprint


def _farm(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0")
    return subprocess.run([sys.executable, "-m", "farm", *args], env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def _spec(source: str, **fields: Any) -> dict[str, Any]:
    data = source.encode()
    return {"format": 1, "source": hashlib.sha256(data).hexdigest(),
            "source_size": len(data), "options": [], "includes": [], "roots": 1,
            "headers": [], "portable": True, **fields}


def _capture(path: Path, fp: str, sources: list[str], **spec_fields: Any) -> Path:
    programs = [{"spec": _spec(s, **spec_fields), "fingerprints": [fp]} for s in sources]
    blobs = {hashlib.sha256(s.encode()).hexdigest(): {"text": s} for s in sources}
    path.write_text(json.dumps({"format": "kernel-farm-capture", "version": 1,
                                "programs": programs, "blobs": blobs}))
    return path


def _secret_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "host-secrets"
    folder.mkdir()
    (folder / "secret.h").write_text(f"{SECRET} x;\n")
    return folder


def _never_read(proc: subprocess.CompletedProcess[str]) -> None:
    assert SECRET not in proc.stdout + proc.stderr, "the build host's file came back"
    assert "Traceback" not in proc.stderr, proc.stderr


def test_an_include_folder_in_a_captures_options_is_refused(
        fingerprint: str, tmp_path: Path) -> None:
    """Item 7: ``-I<dir>`` made the build host read a file outside the capture and print
    it in the build log. Now the capture is refused in one line, before anything runs."""
    folder = _secret_folder(tmp_path)
    path = _capture(tmp_path / "c.json", fingerprint, ['#include "secret.h"\n' + KERNEL],
                    options=[f"-I{folder}"], includes=[["secret.h", True, []]])
    proc = _farm(tmp_path / "home", "build", str(path))
    _never_read(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"capture {path}" in lines[0] and "-I" in lines[0], lines


@pytest.mark.parametrize("option", ["-include", "-imacros", "-Xclang", "@args", "-MF"])
def test_options_naming_files_are_refused_in_a_capture(
        fingerprint: str, tmp_path: Path, option: str) -> None:
    folder = _secret_folder(tmp_path)
    tokens = [option, str(folder / "secret.h")] if not option.startswith("@") else [
        f"@{folder / 'secret.h'}"]
    path = _capture(tmp_path / "c.json", fingerprint, [KERNEL], options=tokens)
    proc = _farm(tmp_path / "home", "build", str(path))
    _never_read(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["{folder}/secret.h", "../../../../../../..{folder}/secret.h"])
def test_an_include_reaching_outside_the_captures_headers_is_never_read(
        fingerprint: str, tmp_path: Path, name: str) -> None:
    """Item 7: an absolute name, or enough ``..``, made the build host read its own file
    (nothing the application had there was found, so the capture said nothing of it)."""
    name = name.format(folder=_secret_folder(tmp_path))
    path = _capture(tmp_path / "c.json", fingerprint, [f'#include "{name}"\n' + KERNEL],
                    includes=[[name, True, []]])
    proc = _farm(tmp_path / "home", "build", str(path), "--json")
    _never_read(proc)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failure = json.loads(proc.stdout)["builds"][0]["failures"][0]
    assert failure["kind"] == "validation" and "outside" in failure["message"], failure


def test_a_task_whose_spec_names_an_include_folder_is_refused(tmp_path: Path) -> None:
    """Item 7 on a worker: a task payload is validated by the same rules."""
    from farm.cluster.payloads import PayloadError, parse_request
    from farm.programs.request import ChunkRequest

    spec = _spec(KERNEL, options=[f"-I{tmp_path}"])
    with pytest.raises(PayloadError, match="-I"):
        parse_request({"fingerprint": "pocl-x", "programs": [{"spec": spec}]}, ChunkRequest)
    parse_request({"fingerprint": "pocl-x", "programs": [{"spec": _spec(
        KERNEL, options=["-DX=1", "-cl-mad-enable"])}]}, ChunkRequest)


def _refused(home: Path, path: Path, *words: str) -> None:
    proc = _farm(home, "build", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"capture {path}" in lines[0], lines
    for word in words:
        assert word in lines[0], lines[0]


def test_deeply_nested_json_is_refused_in_one_line(tmp_path: Path) -> None:
    """Item 8: a RecursionError traceback before."""
    path = tmp_path / "deep.json"
    path.write_text('{"format": "kernel-farm-capture", "version": 1, "programs": '
                    + "[" * 100_000 + "]" * 100_000 + "}")
    _refused(tmp_path / "home", path, "nested")


def test_an_integer_of_thousands_of_digits_is_refused_in_one_line(
        fingerprint: str, tmp_path: Path) -> None:
    """Item 8: a ValueError traceback before (Python's own limit on integer digits)."""
    path = _capture(tmp_path / "c.json", fingerprint, [KERNEL])
    path.write_text(path.read_text().replace('"roots": 1', '"roots": ' + "7" * 5000))
    _refused(tmp_path / "home", path, "digits")


@pytest.mark.parametrize("version", ["true", "1.0", '"1"'])
def test_the_version_is_the_integer_one(fingerprint: str, tmp_path: Path,
                                        version: str) -> None:
    """Item 8: ``"version": true`` was read as version 1."""
    path = _capture(tmp_path / "c.json", fingerprint, [KERNEL])
    path.write_text(path.read_text().replace('"version": 1', f'"version": {version}'))
    _refused(tmp_path / "home", path, "format version")


def test_one_program_listed_many_times_is_built_once(fingerprint: str,
                                                      tmp_path: Path) -> None:
    """Item 8: 40 copies compiled 40 times."""
    path = _capture(tmp_path / "c.json", fingerprint, [KERNEL] * 40)
    proc = _farm(tmp_path / "home", "build", str(path), "--json", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["builds"][0]["summary"]
    assert summary["compiled"] == 1 and summary["kernels"] == 1, summary


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_capture_build_ends_its_compile_processes(
        fingerprint: str, tmp_path: Path, sig: signal.Signals) -> None:
    """Item 8: after ``farm build`` was killed its pool's processes stayed alive."""
    sources = [KERNEL.replace("1;", f"{i};") for i in range(400)]
    path = _capture(tmp_path / "c.json", fingerprint, sources)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0")
    # as a terminal's foreground job: SIGINT at its default, whatever this suite inherited
    # (a suite started in the background by a script has SIGINT ignored, and so would the
    # build, which would then finish instead of being interrupted)
    proc = subprocess.Popen([sys.executable, "-m", "farm", "build", str(path), "--workers",
                             "2", "--json"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        pool: list[int] = []
        while time.monotonic() < deadline and len(pool) < 2 and proc.poll() is None:
            pool = [p for p in _children(proc.pid) if _children(p) == []]
            time.sleep(0.2)
        assert proc.poll() is None and pool, "the build ended before its pool started"
        time.sleep(1.0)  # compiling now
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in pool):
            time.sleep(0.2)
        assert not [p for p in pool if _alive(p)], "compile processes outlived the build"
        assert proc.returncode != 0 and "Traceback" not in (proc.stderr.read() if
                                                            proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_capture_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    """A pipe named like a capture would be read for ever."""
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    _refused(tmp_path / "home", path, "regular file")


def test_a_header_name_the_file_system_refuses_fails_that_program_in_one_line(
        fingerprint: str, tmp_path: Path) -> None:
    """A header path the build host cannot lay out (a component over its name limit)
    fails that program as ``validation``, never a compile process's traceback."""
    header = "#define VALUE 1\n"
    name = "h" * 300 + ".h"
    digest = hashlib.sha256(header.encode()).hexdigest()
    source = f'#include "{name}"\n' + KERNEL.replace("1;", "VALUE;")
    path = _capture(tmp_path / "c.json", fingerprint, [source],
                    includes=[[name, True, [digest]]],
                    headers=[{"root": 0, "path": name, "digest": digest}])
    data = json.loads(path.read_text())
    data["blobs"][digest] = {"text": header}
    path.write_text(json.dumps(data))
    proc = _farm(tmp_path / "home", "build", str(path), "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    failure = json.loads(proc.stdout)["builds"][0]["failures"][0]
    assert failure["kind"] == "validation" and "laid out" in failure["message"], failure
