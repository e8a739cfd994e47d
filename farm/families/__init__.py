"""Kernel families: registered kernel definitions and the registry that finds them."""

from farm.families.base import Example, KernelFamily, LocalMem, Params
from farm.families.registry import ENTRY_POINT_GROUP, Registry

__all__ = ["ENTRY_POINT_GROUP", "Example", "KernelFamily", "LocalMem", "Params", "Registry"]
