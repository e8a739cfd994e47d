"""The public API: exactly what ``farm.__all__`` names, importable without OpenCL."""

from __future__ import annotations

import subprocess
import sys

import farm

PUBLIC = [
    "ArtifactId",
    "BundleError",
    "ClusterError",
    "CompileError",
    "DeviceError",
    "DeviceInfo",
    "Example",
    "FarmError",
    "ForeignStoreError",
    "InputError",
    "KernelError",
    "KernelFamily",
    "KernelId",
    "Key",
    "LaunchArg",
    "LaunchSettings",
    "LoadError",
    "LocalMem",
    "Lowered",
    "ManifestError",
    "Namespace",
    "Outcome",
    "ParameterError",
    "Params",
    "ReadyLaunch",
    "Registry",
    "Settings",
    "SettingsError",
    "StoreError",
    "UnknownFamilyError",
    "UnsupportedFeature",
    "Variant",
    "VersionSkewError",
    "__version__",
    "discover_devices",
    "load_settings",
]


def test_all_is_pinned() -> None:
    assert sorted(farm.__all__) == PUBLIC
    assert len(set(farm.__all__)) == len(farm.__all__)


def test_every_public_name_exists() -> None:
    missing = [name for name in PUBLIC if not hasattr(farm, name)]
    assert missing == []
    assert isinstance(farm.__version__, str) and farm.__version__


def test_importing_farm_does_not_import_pyopencl() -> None:
    code = ("import sys, farm\n"
            "from farm import *  # noqa: F403\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pyopencl', 'pocl'))\n"
            "print(repr(bad))\n"
            "sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "[]"
