"""Every process of a served run is counted and harvested (issue 30, item 3).

``multiprocessing`` children end with ``os._exit`` (fork, forkserver) or are killed by
their pool's ``terminate()`` (``with Pool() as p:``), so Python's ``atexit`` never runs
there; the hook counts after every build and closes at the child's end and on that
SIGTERM (:mod:`farm.programs.hook`). Each case runs a real pool application under
``farm run`` on PoCL: every child's build is in the run's one line, the work-group
functions its launches made are stored (the harvest), and a second run loads every
program. A child killed outright is counted up to its build and reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from farm.core.keys import PLAN_FAMILY, PROGRAM_FAMILY, PROGRAM_FUNCTIONS_FAMILY
from farm.store.sqlite import SQLiteStore

APP = Path(__file__).parent / "apps" / "app_pool.py"
TASKS = 3


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0")
    return env


def _run(home: Path, method: str, how: str) -> tuple[dict[str, int], str]:
    counts = home.with_suffix(".json")
    proc = subprocess.run([sys.executable, "-m", "farm", "run", "--json", str(counts), "--",
                           sys.executable, str(APP), method, how, str(TASKS)],
                          env=_env(home), capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(counts.read_text()), proc.stderr


def _families(home: Path) -> dict[str, int]:
    store = SQLiteStore(home / "envs" / "default" / "store.sqlite")
    found: dict[str, int] = {}
    try:
        for ns in store.namespaces():
            for key in store.keys(ns):
                art = store.get(ns, key)
                assert art is not None
                found[art.meta.family] = found.get(art.meta.family, 0) + 1
    finally:
        store.close()
    return found


@pytest.mark.parametrize(("method", "how"), [
    ("fork", "with"), ("fork", "close"), ("spawn", "with"), ("spawn", "close"),
    ("forkserver", "futures"),
])
def test_a_pools_children_are_counted_and_harvested(tmp_path: Path, method: str,
                                                    how: str) -> None:
    home = tmp_path / "home"
    counts, stderr = _run(home, method, how)
    assert counts == {"programs": TASKS, "loaded": 0, "compiled": TASKS, "fallbacks": 0,
                      "failed": 0}, stderr
    assert "warning" not in stderr, stderr
    # each child's launch made a work-group function, and its end stored it; and the
    # programs it built, for the application's plan (a slot each, or one for several)
    stored = _families(home)
    assert 1 <= stored.pop(PLAN_FAMILY) <= TASKS
    assert stored == {PROGRAM_FAMILY: TASKS, PROGRAM_FUNCTIONS_FAMILY: TASKS}
    again, stderr = _run(home, method, how)
    assert again["loaded"] == TASKS and again["compiled"] == 0, stderr
    assert _families(home)[PROGRAM_FUNCTIONS_FAMILY] == TASKS  # nothing new to harvest


def test_a_child_killed_outright_is_counted_to_its_build_and_reported(
        tmp_path: Path) -> None:
    counts, stderr = _run(tmp_path / "home", "spawn", "kill")
    assert counts["programs"] == counts["compiled"] == 1, stderr
    lines = [line for line in stderr.splitlines() if "warning" in line]
    assert len(lines) == 1 and "1 served process(es) ended before the farm could close" \
        in lines[0], stderr
