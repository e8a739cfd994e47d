"""Real Redis, MinIO and PostgreSQL servers for development and the integration tests.

Each service starts on a free loopback port in its own temporary folder, installs or
builds its server the first time it is missing, waits until the server really answers,
and removes everything on `stop()`. Nothing here is global: a service lives exactly as
long as the object (or `with` block) that started it. `python -m farm.devservices up`
runs them for a developer's shell.
"""

from farm.devservices.minio import MinioServer, ensure_minio
from farm.devservices.ports import ServiceError, free_port, port_answers
from farm.devservices.postgres import PostgresServer, ensure_postgres
from farm.devservices.redis import RedisServer, ensure_redis

__all__ = [
    "MinioServer",
    "PostgresServer",
    "RedisServer",
    "ServiceError",
    "ensure_minio",
    "ensure_postgres",
    "ensure_redis",
    "free_port",
    "port_answers",
]
