"""farm.core.gcpause: the cyclic collector off inside the block, as it was after it."""

from __future__ import annotations

import gc

import pytest

from farm.core.gcpause import cyclic_gc_paused


def test_the_collector_is_off_inside_and_back_on_after() -> None:
    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_comes_back_on_after_an_exception() -> None:
    with pytest.raises(RuntimeError), cyclic_gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_caller_that_had_it_off_keeps_it_off() -> None:
    gc.disable()
    try:
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
