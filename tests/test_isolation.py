"""Measurement isolation across processes (``farm.core.isolation``), with real file locks.

Each role runs in a process of its own (the locks are per open file, as between the
processes of a host) and prints when it got and left what it asked for, on the
system-wide monotonic clock.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from farm.core.isolation import HostLock

ROLE = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from farm.core.isolation import CPU, HostLock

    folder, role, hold = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    lock = HostLock(folder)
    asked = time.monotonic()
    with (lock.measuring(CPU) if role == "measure" else lock.compiling()) as held:
        got = time.monotonic()
        print(json.dumps({"event": "got", "at": got}), flush=True)
        time.sleep(hold)
        left = time.monotonic()
    print(json.dumps({"role": role, "held": held, "asked": asked, "got": got,
                      "left": left}), flush=True)
""")


def start(folder: Path, role: str, hold: float) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", ROLE, str(folder), role, str(hold)],
                            stdout=subprocess.PIPE, text=True)


def holding(proc: subprocess.Popen[str]) -> float:
    """Wait until ``proc`` holds its lock; when it got it."""
    assert proc.stdout is not None
    line = json.loads(proc.stdout.readline())
    assert line["event"] == "got"
    return float(line["at"])


def done(proc: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def test_a_measurement_waits_for_compiles_and_compiles_wait_for_it(tmp_path: Path) -> None:
    compiling = start(tmp_path, "compile", 1.0)
    holding(compiling)
    measuring = start(tmp_path, "measure", 1.0)
    holding(measuring)
    later = start(tmp_path, "compile", 0.0)  # comes while the measurement holds
    c, m, c2 = done(compiling), done(measuring), done(later)
    assert m["held"] and c["held"] and c2["held"]
    assert m["got"] >= c["left"]  # the measurement waited for the compile under way
    assert c2["got"] >= m["left"]  # the later compile waited for the measurement


def test_compiles_that_keep_coming_do_not_starve_a_measurement(tmp_path: Path) -> None:
    first = start(tmp_path, "compile", 1.5)
    holding(first)
    measuring = start(tmp_path, "measure", 0.5)
    time.sleep(0.3)  # the measurement is waiting at the gate by now
    second = start(tmp_path, "compile", 0.1)  # would overlap the first without the gate
    f, m, s = done(first), done(measuring), done(second)
    assert m["got"] >= f["left"]
    assert s["got"] >= m["left"]  # it queued behind the waiting measurement


def test_measurements_of_one_device_take_turns(tmp_path: Path) -> None:
    one = start(tmp_path, "measure", 1.0)
    holding(one)
    two = start(tmp_path, "measure", 0.0)
    a, b = done(one), done(two)
    assert b["got"] >= a["left"]


def test_the_compile_path_takes_a_slot(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A real compile (``finalize``) waits while another process measures the cores."""
    from farm.compilation.finalize import finalize
    from farm.core.device import open_device, probe_devices, select_device
    from farm.core.model import Lowered

    monkeypatch.setenv("FARM_ISOLATION_DIR", str(tmp_path))
    ctx, dev = open_device(select_device(probe_devices(), None))
    measuring = start(tmp_path, "measure", 1.5)
    holding(measuring)
    built = finalize(ctx, dev, Lowered(source="__kernel void k(__global float *x) "
                                              "{ x[0] = 1.0f; }", kernel_names=("k",)))
    after = time.monotonic()
    m = done(measuring)
    assert built.ok
    assert after >= m["left"]


def test_a_process_compiling_inside_its_own_measurement_does_not_wait(
        tmp_path: Path) -> None:
    lock = HostLock(tmp_path)
    with lock.measuring("cpu") as held:
        start_s = time.monotonic()
        with lock.compiling(wait_s=5) as slot:
            assert not slot
        assert time.monotonic() - start_s < 1
    assert held
    with pytest.raises(RuntimeError, match="already"), lock.measuring("cpu"), \
            lock.measuring("cpu"):
        pass


def test_an_unusable_folder_is_a_warning_not_a_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    lock = HostLock(blocker)
    with caplog.at_level(logging.WARNING):
        with lock.compiling() as slot:
            assert not slot
        with lock.measuring("cpu") as held:
            assert not held
    assert caplog.text.count("cannot use") == 2
