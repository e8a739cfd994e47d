"""On an NVIDIA GPU host: existing pyopencl applications served by the farm (``farm run``)
compute what a plain run computes, and a second process compiles nothing.

Marked ``gpu`` (deselected by scripts/test). Run it on the GPU host with
``bench/nvidia_host.sh python3 -m pytest -m gpu tests/test_programs_gpu.py -v``; it
fails (never skips) when no NVIDIA OpenCL device is present. The applications pick the
first device whose name or platform says NVIDIA (``PYOPENCL_CTX`` is set to it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

APPS = Path(__file__).parent / "apps"


def _nvidia_ctx() -> str:
    """``PYOPENCL_CTX`` for the first NVIDIA device (platform:device indices)."""
    import pyopencl as cl

    for p, platform in enumerate(cl.get_platforms()):
        for d, dev in enumerate(platform.get_devices()):
            if "nvidia" in f"{platform.name} {dev.name}".lower():
                return f"{p}:{d}"
    pytest.fail("no NVIDIA OpenCL device on this host")


@pytest.mark.parametrize("app", ["array", "reikna", "loopy"])
def test_an_application_on_nvidia_is_served_and_then_loaded(app: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), PYOPENCL_CTX=_nvidia_ctx(),
               PYOPENCL_NO_CACHE="1", CUDA_CACHE_DISABLE="1")
    script = [sys.executable, str(APPS / f"app_{app}.py")]
    plain = subprocess.run([*script, str(tmp_path / "plain.npz")], env=env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    counts = []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.json"
        proc = subprocess.run([sys.executable, "-m", "farm", "run", "--json", str(out), "--",
                               *script, str(tmp_path / f"{run}.npz")], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        counts.append(json.loads(out.read_text()))
        with np.load(tmp_path / "plain.npz") as want, np.load(tmp_path / f"{run}.npz") as got:
            for name in want.files:
                assert np.allclose(got[name], want[name], rtol=1e-5, atol=1e-5), name
    first, second = counts
    assert first["compiled"] > 0 and first["fallbacks"] == first["failed"] == 0, first
    assert second["compiled"] == 0 and second["loaded"] == second["programs"], second
    print(app, first, second)
