"""The worker's device seam (farm/compilation/backend.py): OpenCL unless a benchmark names
a simulated backend with FARM_DEVICE_BACKEND, whose mistakes are one-line settings errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from farm.compilation.backend import OpenCLBackend, discover, open_backend
from farm.core.errors import SettingsError
from farm.core.model import Lowered
from farm.core.settings import Settings

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_a_backend_name_that_is_no_module_name_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Python module name"):
        Settings(device_backend="../evil")


def test_a_missing_or_incomplete_backend_is_named(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="FARM_DEVICE_BACKEND: cannot import nosuch"):
        discover(Settings(device_backend="nosuch_backend_module"))
    (tmp_path / "halfbackend.py").write_text("def discover():\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SettingsError, match="module halfbackend has no open_backend"):
        discover(Settings(device_backend="halfbackend"))


def test_the_simulated_fleet_compiles_by_the_clock_and_needs_no_opencl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("SIM_COMPILE_MS", "20")
    monkeypatch.setenv("SIM_BINARY_BYTES", "1000")
    settings = Settings(device_backend="simfleet")
    [device] = discover(settings)
    backend = open_backend(settings, device)
    assert not isinstance(backend, OpenCLBackend)
    built = backend.finalize(Lowered(source="__kernel void a() {}", kernel_names=("a",)),
                             native=True)
    assert built.ok and len(built.binary) == 1000 and built.work_s >= 0.02
    backend.load(built.binary)
    other = backend.finalize(Lowered(source="__kernel void b() {}", kernel_names=("b",)),
                             native=True)
    assert other.binary != built.binary  # every kernel's artifact is its own
    from farm.core.errors import LoadError

    with pytest.raises(LoadError):
        backend.load(b"\x7fELF not simulated")


def test_a_simulated_worker_process_never_imports_pyopencl() -> None:
    """What lets the control-plane benchmark run hundreds of processes: no driver."""
    code = ("import sys\n"
            "from farm.core.settings import Settings\n"
            "from farm.compilation.backend import discover, open_backend\n"
            "from farm.core.model import Lowered\n"
            "s = Settings(device_backend='simfleet')\n"
            "b = open_backend(s, discover(s)[0])\n"
            "b.load(b.finalize(Lowered(source='x', kernel_names=('x',)), True).binary)\n"
            "import worker.execute, worker.state, worker.startup\n"
            "print('pyopencl' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(BENCH), "SIM_COMPILE_MS": "0"},
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_opencl_is_the_default() -> None:
    from farm.core.device import probe_devices

    [device, *_] = probe_devices()
    backend = open_backend(Settings(), device)
    assert isinstance(backend, OpenCLBackend)
    built = backend.finalize(Lowered(source="__kernel void a(__global float *x) "
                                            "{ x[0] = 1.0f; }", kernel_names=("a",)),
                             native=False)
    assert built.ok and built.validated
    backend.load(built.binary)
