"""The public API: exactly what ``farm.__all__`` names, importable without OpenCL."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import farm
from farm.core.lazy import type_checking_imports

#: the public API, pinned: the one literal copy (farm/__init__.py lists it once, in its
#: ``if TYPE_CHECKING:`` block, and derives ``__all__`` and the imports from that)
PUBLIC = {
    "ArtifactId", "BundleError", "ClusterError", "CompileError", "DeviceError",
    "DeviceInfo", "Example", "FarmError", "ForeignStoreError", "InputError", "KernelError",
    "KernelFamily", "KernelId", "Key", "LaunchArg", "LaunchSettings", "LoadError",
    "LocalMem", "Lowered", "ManifestError", "Namespace", "Outcome", "ParameterError",
    "Params", "ReadyLaunch", "Registry", "Settings", "SettingsError", "StoreError",
    "UnknownFamilyError", "UnsupportedFeature", "Variant", "VersionSkewError",
    "__version__", "discover_devices", "load_settings",
}


def test_all_is_pinned() -> None:
    assert set(farm.__all__) == PUBLIC
    assert farm.__all__ == sorted(farm.__all__)


#: every package whose public names are its TYPE_CHECKING block (farm.core.lazy)
PACKAGES = ("farm", "farm.programs", "farm.records", "farm.tuning", "loader")


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_exists_where_the_block_says(name: str) -> None:
    package = importlib.import_module(name)
    assert package.__file__ is not None
    with open(package.__file__, encoding="utf-8") as fh:
        where = type_checking_imports(fh.read())
    assert sorted(where) == package.__all__ and package.__all__
    for public, module in where.items():
        assert getattr(package, public) is getattr(importlib.import_module(module), public)
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'NotPublic'"):
        package.NotPublic  # noqa: B018 - the attribute access is the test


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
