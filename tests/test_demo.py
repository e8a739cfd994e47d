"""``farm demo`` (the README's first command) tells the truth: its second step loads every
stored kernel onto the device in a fresh context with no compiler, and its third runs one
of them against numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FARM = Path(sys.executable).with_name("farm")


def test_demo_builds_loads_every_kernel_and_checks_one_against_numpy(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               CUDA_CACHE_DISABLE="1")
    proc = subprocess.run([str(FARM), "demo", "--fresh", "--json", "--workers", "2"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    result = json.loads(proc.stdout)
    build, load = result["build"], result["load"]
    stored = build["compiled"] + build["rekeyed"] + build["loaded"]
    assert build["compiled"] > 0 and build["failed"] == 0
    # every stored kernel came from the store into the loader's own context: none from
    # memory (a fresh loader), none compiled (the loader may not compile)
    assert load["kernels"] == stored == load["local"]
    assert load["compiled"] == load["memory"] == load["failed"] == 0
    assert result["check"]["ok"] is True and result["check"]["problems"] == []
    assert result["build_to_load"] > 1
    # the honest figure: load + first launch of every kernel, still far below a build
    assert 0 < result["first_result_ms_per_kernel"] < result["build_ms_per_kernel"]
    assert result["load"]["readiness"]["kernels"] == stored
