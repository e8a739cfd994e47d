"""A throwaway Redis server on loopback, for development and the integration tests.

The cluster uses Redis as Celery's broker and result backend and for the records
streams; tests need a real one, because the parts worth testing (consumer groups, pending
entries, visibility timeouts) are exactly what a fake would get wrong.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from farm.devservices.ports import LOOPBACK, ServiceError, apt_install, chosen_binary
from farm.devservices.server import LocalServer

START_TIMEOUT_S = 20.0


def ensure_redis() -> Path:
    """Return the path of `redis-server`, installing Debian's package when it is missing.

    `FARM_REDIS_BIN` names a server the user chose (it must exist): on a host with no
    network, the one `bench/host_kit.sh` carried there.
    """
    chosen = chosen_binary("FARM_REDIS_BIN")
    if chosen is not None:
        return chosen
    found = shutil.which("redis-server")
    if found is None:
        apt_install("redis-server")
        found = shutil.which("redis-server")
    if found is None:
        raise ServiceError("redis-server is still not on PATH after installing redis-server")
    return Path(found)


def redis_ping(port: int, timeout: float = 0.5) -> bool:
    """Whether a Redis server answers PING on the loopback port.

    Spoken in raw RESP so that this module needs no client library: the `redis` package
    belongs to the optional `cluster` extra.
    """
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(LocalServer):
    """One Redis server in its own temporary folder, append-only file on, on a free port.

    Runs in the foreground (not daemonized) so that we hold its process handle and
    `stop()` can be sure it is gone (SIGTERM is a clean shutdown for Redis); it starts in
    a new session so that a Ctrl-C in the terminal reaches our code, which stops it,
    rather than killing it under us. The folder holds its data, append-only file and log.
    """

    slug = "redis"
    label = "redis-server"
    log_name = "redis.log"
    start_timeout = START_TIMEOUT_S

    @property
    def url(self) -> str:
        """Connection URL for redis-py, Celery and the farm's settings (database 0)."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    def _install(self) -> Path:
        return ensure_redis()

    def _launch(self, installed: Path) -> None:
        command = [
            str(installed),
            "--port", str(self.port),
            "--bind", LOOPBACK,
            "--protected-mode", "yes",
            "--dir", str(self.directory),
            "--appendonly", "yes",
            # every cluster of a test session takes a database of its own (16 by default)
            "--databases", "1024",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        # Redis writes its own log file (--logfile), so its output is not captured.
        self._spawn(command, capture_output=False)

    def _ready(self, port: int) -> bool:
        return redis_ping(port)
