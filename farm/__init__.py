"""kernel-farm: a distributed compilation farm for OpenCL kernels.

The public API is what the ``if TYPE_CHECKING:`` block below imports: the one list, read
for ``__all__`` (a test pins it) and for each name's module (:mod:`farm.core.lazy`);
everything else is private to the farm and may change. Importing ``farm`` never
initialises OpenCL, and imports each name's module only when the name is first used
(PEP 562), so that a command that needs none of them (``farm --help``, ``farm records``)
does not pay for numpy, the kernel families or pydantic-settings.
"""

# ruff: noqa: F401 - the TYPE_CHECKING block is the list of public names (farm.core.lazy)
from __future__ import annotations

from farm.core.lazy import public_names

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
        ReadyLaunch,
        Variant,
    )
    from farm.core.outcomes import Outcome
    from farm.core.settings import Settings, load_settings
    from farm.families import Example, KernelFamily, LocalMem, Params, Registry
    from farm.version import __version__


__getattr__, __dir__ = public_names(__name__)
