"""Session-wide real services for the integration tests.

Each fixture starts its server once per test session, on a free loopback port, and stops
it at the end. A server that cannot start fails the tests that need it, with the reason:
it never skips them, because a skipped integration test in CI reads as a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from farm.devservices import MinioServer, PostgresServer, RedisServer

_Service = TypeVar("_Service", RedisServer, MinioServer, PostgresServer)


def _serve(name: str, make: Callable[[], _Service]) -> Iterator[_Service]:
    service = make()
    failure = None
    try:
        service.start()
    except Exception as exc:
        failure = f"could not start {name} for the integration tests: {exc}"
    if failure is not None:  # outside `except`, so the report shows the reason once
        pytest.fail(failure, pytrace=False)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real Redis server for the whole session (`.url`)."""
    yield from _serve("Redis", RedisServer)


@pytest.fixture(scope="session")
def minio_server() -> Iterator[MinioServer]:
    """A real MinIO server for the whole session (`.endpoint`, `.access_key`, `.secret_key`)."""
    yield from _serve("MinIO", MinioServer)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL server with a `farm` database for the whole session (`.url`)."""
    yield from _serve("PostgreSQL", PostgresServer)


@pytest.fixture(scope="module")
def redis_url(redis_server: RedisServer) -> str:
    """A Redis database of the test module's own on the session's server."""
    from cluster_helpers import next_redis_db

    return str(redis_server.url).rsplit("/", 1)[0] + f"/{next_redis_db()}"


@pytest.fixture
def client(redis_url: str) -> Iterator[Any]:
    """A Redis client on the module's database, flushed before each test."""
    import redis

    conn = redis.Redis.from_url(redis_url)
    conn.flushdb()
    yield conn
    conn.close()
