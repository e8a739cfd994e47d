"""Real Redis, MinIO and PostgreSQL servers for development and the integration tests.

Each service starts on a free loopback port in its own temporary folder, installs or
builds its server the first time it is missing, waits until the server really answers,
and removes everything on `stop()`. Nothing here is global: a service lives exactly as
long as the object (or `with` block) that started it. `python -m farm.devservices up`
runs them for a developer's shell.
"""

import re
import shlex
from collections.abc import Mapping

from farm.devservices.minio import MinioServer, ensure_minio
from farm.devservices.ports import ServiceError, free_port, port_answers
from farm.devservices.postgres import PostgresServer, ensure_postgres
from farm.devservices.redis import RedisServer, ensure_redis

_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def export_lines(settings: Mapping[str, str]) -> list[str]:
    """``export NAME='value'`` lines a shell can ``source``: every value quoted, so a
    ``$(...)`` or a backquote inside one is text, never a command run when sourced."""
    lines = []
    for name, value in settings.items():
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"not an environment variable name: {name!r}")
        lines.append(f"export {name}={shlex.quote(value)}")
    return lines


__all__ = [
    "MinioServer",
    "PostgresServer",
    "RedisServer",
    "ServiceError",
    "ensure_minio",
    "ensure_postgres",
    "ensure_redis",
    "export_lines",
    "free_port",
    "port_answers",
]
