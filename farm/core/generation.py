"""Environments and the process-wide generation that in-memory caches obey.

A named environment is one store plus one records storage. Switching environment bumps
the generation; every in-memory cache notes the generation it was filled under and
drops its entries when it changes, so nothing from the old environment is served.

The generation is deliberately process-wide state (a counter, nothing else): a cache
anywhere in the process must see a switch made anywhere else.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_counter = itertools.count(1)
_lock = threading.Lock()
_generation = next(_counter)


def generation() -> int:
    """The current generation."""
    return _generation


def bump_generation() -> int:
    """Called when the environment switches; returns the new generation."""
    global _generation
    with _lock:
        _generation = next(_counter)
        return _generation


class GenerationCache(Generic[K, V]):
    """A dict that empties itself when the generation changes. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen = generation()
        self._data: dict[K, V] = {}

    def _sync(self) -> None:
        now = generation()
        if now != self._gen:
            self._data.clear()
            self._gen = now

    def get(self, key: K) -> V | None:
        with self._lock:
            self._sync()
            return self._data.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._sync()
            self._data[key] = value

    def get_or_create(self, key: K, factory: Callable[[], V]) -> V:
        with self._lock:
            self._sync()
            if key not in self._data:
                self._data[key] = factory()
            return self._data[key]

    def __len__(self) -> int:
        with self._lock:
            self._sync()
            return len(self._data)
