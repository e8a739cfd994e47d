"""Python's cyclic garbage collector paused while a burst of long-lived objects is made.

Reference counting frees every object that is not in a reference cycle; the cyclic
collector only finds cycles, and it runs every few hundred allocations, traversing the
young objects and now and then the whole heap. A burst that makes tens of thousands of
objects none of which is cyclic garbage (importing the farm's modules into an
application: pydantic, the MinIO SDK, their classes and schemas; a round of the records
ingester) then pays the collector for nothing: about 20 ms of the 0.25 s it takes to
import what a served program build needs, on a heap of an application's size. Cycles
made meanwhile wait for the next collection, which runs as usual once the burst ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The cyclic collector off for the ``with`` block, then as it was (a caller that
    had it off keeps it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
