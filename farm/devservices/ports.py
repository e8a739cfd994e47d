"""What the three development services share: loopback ports, readiness waits, stopping.

Every service binds to 127.0.0.1 only and to a port the kernel just handed out, so that
several test runs (or a test run next to a developer's `up`) never collide on a fixed
port and nothing is ever reachable from outside the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

LOOPBACK = "127.0.0.1"


class ServiceError(RuntimeError):
    """A development service could not be installed, started or stopped.

    The message says which service, what was tried, and the end of its log, because the
    person reading it is usually looking at a failed CI run with nothing else to go on.
    """


def free_port() -> int:
    """Return a loopback TCP port that is free right now.

    The port is released before the server binds it, so another process could take it in
    between; the window is tiny and a server that loses the race exits at once, which
    `wait_until` reports with the server's log.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def port_answers(port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on the loopback port.

    Used to prove that a stopped service is really gone, not only that we stopped
    waiting for it.
    """
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout):
            return True
    except OSError:
        return False


def log_tail(path: Path, lines: int = 30) -> str:
    """The last lines of a service's log, for error messages ("" when there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_until(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    interval: float = 0.05,
) -> None:
    """Poll `ready` until it returns True, or raise `ServiceError` after `timeout` seconds.

    A server that has already exited will never become ready, so when `process` is given
    its exit is reported at once instead of after the whole timeout. The log's tail goes
    into the message: it is almost always where the reason is.
    """
    deadline = time.monotonic() + timeout
    while True:
        if ready():
            return
        if process is not None and process.poll() is not None:
            raise ServiceError(
                f"{what} exited with code {process.returncode} before it was ready" + _with_log(log)
            )
        if time.monotonic() >= deadline:
            raise ServiceError(
                f"{what} did not become ready within {timeout:.0f} s" + _with_log(log)
            )
        time.sleep(interval)


def stop_process(process: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Ask a server process to stop (SIGTERM), and kill it if it does not in time.

    Redis and MinIO both shut down cleanly on SIGTERM. The servers run in their own
    session, so signalling only the process we started is enough and safe.
    """
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait(timeout=timeout)


def chosen_binary(variable: str) -> Path | None:
    """The server binary the user named in the environment variable ``variable`` (on a
    host with no network, the one `bench/host_kit.sh` carried there), or None when it is
    unset; a name that is not an executable file is a ServiceError, never a fallback."""
    chosen = os.environ.get(variable)
    if not chosen:
        return None
    path = Path(chosen)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ServiceError(f"{variable}={chosen} is not an executable file")
    return path


def apt_install(*packages: str) -> None:
    """Install Debian packages with apt-get (after `apt-get update`), or say why we cannot.

    Only the development services call this, and only when their server is missing, so a
    fresh Debian machine can run the integration tests without a manual setup step. It
    needs root; as another user it fails with the command to run instead of prompting.
    """
    names = " ".join(packages)
    if os.geteuid() != 0:
        raise ServiceError(
            f"{names} is not installed and installing it needs root: "
            f"run `sudo apt-get install -y {names}` or scripts/bootstrap as root"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"devservices: installing {names} with apt-get", file=sys.stderr, flush=True)
    for command in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", *packages],
    ):
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            output = "\n".join((result.stdout + result.stderr).splitlines()[-20:])
            raise ServiceError(f"`{' '.join(command)}` failed ({result.returncode}):\n{output}")


def _with_log(log: Path | None) -> str:
    if log is None:
        return ""
    tail = log_tail(log)
    if not tail:
        return f" (log {log} is empty)"
    return f"; end of {log}:\n{tail}"
