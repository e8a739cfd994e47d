"""A throwaway Redis server on loopback, for development and the integration tests.

The cluster uses Redis as Celery's broker and result backend and for the records
streams; tests need a real one, because the parts worth testing (consumer groups, pending
entries, visibility timeouts) are exactly what a fake would get wrong.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from farm.devservices.ports import (
    LOOPBACK,
    ServiceError,
    apt_install,
    free_port,
    stop_process,
    wait_until,
)

START_TIMEOUT_S = 20.0


def ensure_redis() -> Path:
    """Return the path of `redis-server`, installing Debian's package when it is missing."""
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


class RedisServer:
    """One Redis server in its own temporary folder, append-only file on, on a free port.

    Runs in the foreground (not daemonized) so that we hold its process handle and
    `stop()` can be sure it is gone; it starts in a new session so that a Ctrl-C in the
    terminal reaches our code, which stops it, rather than killing it under us.
    """

    def __init__(self, workdir: Path | None = None) -> None:
        """`workdir` is where the server's temporary folder is made (system temp if None)."""
        self.workdir = workdir
        self._directory: Path | None = None
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = f"port={self._port}" if self.running else "stopped"
        return f"RedisServer({state})"

    @property
    def running(self) -> bool:
        """Whether the server process we started is still alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def port(self) -> int:
        """The loopback port the server listens on."""
        if self._port is None:
            raise ServiceError("RedisServer is not started")
        return self._port

    @property
    def directory(self) -> Path:
        """The server's temporary folder (data, append-only file, log); gone after stop()."""
        if self._directory is None:
            raise ServiceError("RedisServer is not started")
        return self._directory

    @property
    def url(self) -> str:
        """Connection URL for redis-py, Celery and the farm's settings (database 0)."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.directory / "redis.log"

    def start(self) -> RedisServer:
        """Install if needed, start the server and return once it answers PING."""
        if self._process is not None:
            raise ServiceError("RedisServer is already started")
        binary = ensure_redis()
        base = self.workdir
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        self._directory = Path(tempfile.mkdtemp(prefix="farm-redis-", dir=base))
        self._port = free_port()
        command = [
            str(binary),
            "--port", str(self._port),
            "--bind", LOOPBACK,
            "--protected-mode", "yes",
            "--dir", str(self._directory),
            "--appendonly", "yes",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        try:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            port = self._port
            wait_until(
                lambda: redis_ping(port),
                what=f"redis-server on {LOOPBACK}:{port}",
                timeout=START_TIMEOUT_S,
                process=self._process,
                log=self.log_path,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, a clean shutdown) and remove its folder. Idempotent."""
        if self._process is not None:
            stop_process(self._process)
            self._process = None
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
        self._port = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
