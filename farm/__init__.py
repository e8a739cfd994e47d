"""kernel-farm: a distributed compilation farm for OpenCL kernels.

The public API is what ``__all__`` names (a test pins it); everything else is private
to the farm and may change. Importing ``farm`` never initialises OpenCL, and imports
each name's module only when the name is first used (PEP 562), so that a command that
needs none of them (``farm --help``, ``farm records``) does not pay for numpy, the
kernel families or pydantic-settings.
"""

from __future__ import annotations

from farm.core.lazy import lazy_exports
from farm.version import __version__

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (farm run)
if TYPE_CHECKING:
    from farm.core.device import DeviceInfo, discover_devices
    from farm.core.errors import (
        BundleError,
        ClusterError,
        CompileError,
        DeviceError,
        FarmError,
        ForeignStoreError,
        InputError,
        KernelError,
        LoadError,
        ManifestError,
        ParameterError,
        SettingsError,
        StoreError,
        UnknownFamilyError,
        UnsupportedFeature,
        VersionSkewError,
    )
    from farm.core.keys import Namespace
    from farm.core.model import (
        ArtifactId,
        KernelId,
        Key,
        LaunchArg,
        LaunchSettings,
        Lowered,
        Outcome,
        ReadyLaunch,
        Variant,
    )
    from farm.core.settings import Settings, load_settings
    from farm.families import Example, KernelFamily, LocalMem, Params, Registry


_WHERE = {
    **dict.fromkeys(("DeviceInfo", "discover_devices"), "farm.core.device"),
    **dict.fromkeys(("BundleError", "ClusterError", "CompileError", "DeviceError",
                     "FarmError", "ForeignStoreError", "InputError", "KernelError",
                     "LoadError", "ManifestError", "ParameterError", "SettingsError",
                     "StoreError", "UnknownFamilyError", "UnsupportedFeature",
                     "VersionSkewError"), "farm.core.errors"),
    **dict.fromkeys(("Example", "KernelFamily", "LocalMem", "Params", "Registry"),
                    "farm.families"),
    "Namespace": "farm.core.keys",
    **dict.fromkeys(("ArtifactId", "KernelId", "Key", "LaunchArg", "LaunchSettings",
                     "Lowered", "Outcome", "ReadyLaunch", "Variant"), "farm.core.model"),
    **dict.fromkeys(("Settings", "load_settings"), "farm.core.settings"),
}


__getattr__ = lazy_exports(__name__, _WHERE)


__all__ = [
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
