"""The outage waiter: backoff while a service is down, one line each way, a limit."""

from __future__ import annotations

import time

import pytest

from farm.core.outage import OutageError, Waiter, redis_location


def test_an_outage_shorter_than_the_limit_is_waited_out_with_one_line_each_way() -> None:
    lines: list[str] = []
    waiter = Waiter("Redis at h:1/0", 5.0, is_down=lambda e: isinstance(e, ConnectionError),
                    say=lines.append)
    back_at = time.monotonic() + 0.5

    def call() -> str:
        if time.monotonic() < back_at:
            raise ConnectionError("refused")
        return "ok"

    assert waiter.call(call) == "ok"
    assert waiter.call(call) == "ok"
    assert len(lines) == 2, lines
    assert lines[0].startswith("waiting for Redis at h:1/0") and "5 s" in lines[0]
    assert "is back after" in lines[1]
    assert waiter.outages == 1 and waiter.waited_s >= 0.4


def test_past_the_limit_one_error_and_later_calls_fail_at_once() -> None:
    waiter = Waiter("MinIO at h:2", 0.3, is_down=lambda e: isinstance(e, ConnectionError),
                    say=lambda line: None)

    def down() -> None:
        raise ConnectionError("refused")

    start = time.monotonic()
    with pytest.raises(OutageError, match=r"MinIO at h:2 unreachable for more than 0\.3 s"):
        waiter.call(down)
    assert time.monotonic() - start < 3
    start = time.monotonic()
    with pytest.raises(OutageError):  # the same outage: no second wait
        waiter.call(down)
    assert time.monotonic() - start < 0.2


def test_other_errors_are_not_waited_for() -> None:
    waiter = Waiter("x", 5.0, is_down=lambda e: isinstance(e, ConnectionError))

    def bad() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        waiter.call(bad)
    assert not waiter.down


def test_redis_location_never_shows_the_password() -> None:
    assert redis_location("redis://:s3cret@host:6380/2") == "Redis at host:6380/2"
