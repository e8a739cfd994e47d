"""kernel-farm: a distributed compilation farm for OpenCL kernels.

The public API is what ``__all__`` names (a test pins it); everything else is private
to the farm and may change. Importing ``farm`` never initialises OpenCL.
"""

from farm.device import DeviceInfo, discover_devices
from farm.errors import (
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
from farm.families import Example, KernelFamily, LocalMem, Params, Registry
from farm.keys import Namespace
from farm.model import ArtifactId, KernelId, Key, LaunchSettings, Lowered, Outcome, Variant
from farm.settings import Settings, load_settings
from farm.version import __version__

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
    "LaunchSettings",
    "LoadError",
    "LocalMem",
    "Lowered",
    "ManifestError",
    "Namespace",
    "Outcome",
    "ParameterError",
    "Params",
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
