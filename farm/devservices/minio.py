"""A throwaway MinIO server on loopback, for development and the integration tests.

MinIO is the cluster's artifact store; first-writer-wins rests on its conditional writes,
which only a real server can show. Debian has no MinIO package, so the binary is built
once with `go install` and reused.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from farm.devservices.ports import LOOPBACK, ServiceError, chosen_binary, free_port
from farm.devservices.server import LocalServer

MINIO_MODULE = "github.com/minio/minio@latest"
START_TIMEOUT_S = 60.0

# No proxy for loopback health checks, whatever http_proxy says.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _go_bin_dir() -> Path | None:
    """Where `go install` puts binaries (GOBIN, else the first GOPATH entry's bin)."""
    go = shutil.which("go")
    if go is None:
        return None
    result = subprocess.run(
        [go, "env", "GOBIN", "GOPATH"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        return None
    gobin, _, gopath = result.stdout.partition("\n")
    if gobin.strip():
        return Path(gobin.strip())
    first = gopath.strip().split(os.pathsep)[0]
    return Path(first) / "bin" if first else None


def ensure_minio() -> Path:
    """Return a MinIO server binary, building it with `go install` when there is none.

    Order: `FARM_MINIO_BIN` (a binary the user chose; it must exist), then the one
    `go install` left in GOBIN/GOPATH, then a fresh build, which takes minutes and is
    announced so that a silent wait is not mistaken for a hang.
    """
    chosen = chosen_binary("FARM_MINIO_BIN")
    if chosen is not None:
        return chosen
    bin_dir = _go_bin_dir()
    candidates = [bin_dir / "minio"] if bin_dir is not None else []
    candidates.append(Path.home() / "go" / "bin" / "minio")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    go = shutil.which("go")
    if go is None or bin_dir is None:
        raise ServiceError(
            "no MinIO binary: set FARM_MINIO_BIN, or install Go and run "
            f"`go install {MINIO_MODULE}` (scripts/bootstrap does this)"
        )
    print(
        f"devservices: building MinIO with `go install {MINIO_MODULE}` "
        "(takes several minutes, once)",
        file=sys.stderr,
        flush=True,
    )
    result = subprocess.run(
        [go, "install", MINIO_MODULE], capture_output=True, text=True, check=False
    )
    built = bin_dir / "minio"
    if result.returncode != 0 or not built.is_file():
        output = "\n".join((result.stdout + result.stderr).splitlines()[-20:])
        raise ServiceError(f"`go install {MINIO_MODULE}` failed ({result.returncode}):\n{output}")
    return built


def minio_ready(port: int, timeout: float = 1.0) -> bool:
    """Whether MinIO on the loopback port says it is ready to serve requests."""
    url = f"http://{LOOPBACK}:{port}/minio/health/ready"
    try:
        with _DIRECT.open(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class MinioServer(LocalServer):
    """One single-drive MinIO server in its own temporary folder, on a free loopback port.

    The root credentials are random for every start and reach the server only through
    its environment; they are never written to a log or shown by repr(). The web console
    is switched off, and its address is pinned to loopback anyway so that nothing ever
    listens on another interface. The folder holds the objects (under `data/`) and the log.
    """

    slug = "minio"
    label = "MinIO"
    log_name = "minio.log"
    start_timeout = START_TIMEOUT_S
    poll_interval = 0.1

    def __init__(self, workdir: Path | None = None,
                 settings: dict[str, str] | None = None) -> None:
        """`workdir` is where the server's temporary folder is made (system temp if None);
        `settings` are more `MINIO_*` variables for the server (a benchmark's
        `MINIO_PROMETHEUS_AUTH_TYPE=public`), given here because the caller's own
        environment never reaches it."""
        super().__init__(workdir)
        bad = [name for name in settings or {} if not name.startswith("MINIO_")]
        if bad:
            raise ServiceError(f"MinIO settings must be MINIO_* variables: {bad}")
        self._settings = dict(settings or {})
        self._access_key: str | None = None
        self._secret_key: str | None = None

    @property
    def endpoint(self) -> str:
        """`host:port` as the `minio` SDK wants it (plain HTTP: `secure=False`)."""
        return f"{LOOPBACK}:{self.port}"

    @property
    def secure(self) -> bool:
        """Always False: a loopback test server speaks plain HTTP."""
        return False

    @property
    def access_key(self) -> str:
        """The root user, random per start."""
        return self._require(self._access_key)

    @property
    def secret_key(self) -> str:
        """The root password, random per start."""
        return self._require(self._secret_key)

    def stop(self) -> None:
        """Stop the server (SIGTERM), remove its folder with all objects, forget the keys."""
        super().stop()
        self._access_key = None
        self._secret_key = None

    def _install(self) -> Path:
        return ensure_minio()

    def _launch(self, installed: Path) -> None:
        if self._access_key is None or self._secret_key is None:  # kept by resume()
            self._access_key = "farm-" + secrets.token_hex(6)
            self._secret_key = secrets.token_urlsafe(24)
        # Only the settings given here: a developer's own MINIO_* must not leak in.
        env = {key: value for key, value in os.environ.items() if not key.startswith("MINIO_")}
        env.update(self._settings)
        env.update(
            MINIO_ROOT_USER=self._access_key,
            MINIO_ROOT_PASSWORD=self._secret_key,
            MINIO_BROWSER="off",
            MINIO_UPDATE="off",
        )
        command = [
            str(installed),
            "server", str(self.directory / "data"),
            "--address", f"{LOOPBACK}:{self.port}",
            "--console-address", f"{LOOPBACK}:{free_port()}",
            "--certs-dir", str(self.directory / "certs"),
            "--quiet",
            "--anonymous",
        ]  # fmt: skip
        self._spawn(command, env=env)

    def _ready(self, port: int) -> bool:
        return minio_ready(port)

    def _describe(self) -> str:
        return f"endpoint={self.endpoint}"
