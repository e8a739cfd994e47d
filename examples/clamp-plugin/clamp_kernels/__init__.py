"""Kernel families of the ``kernel-farm-clamp`` plugin.

``FAMILIES`` is what the entry point in ``pyproject.toml`` names. The whole package is
part of each family's build id, so any change to a file here gives the family new keys
and the farm never serves a binary built from the old code.
"""

from clamp_kernels.clamp import Clamp, ClampParams

FAMILIES = [Clamp]

__all__ = ["FAMILIES", "Clamp", "ClampParams"]
