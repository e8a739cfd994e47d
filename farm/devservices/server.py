"""The lifecycle every development server shares, written once.

Redis, MinIO and PostgreSQL differ in how they are installed, started and asked whether
they are ready; everything around that (a private temporary folder, a free loopback
port, a server process in its own session with its log, a readiness wait that quotes
the log, a stop that always cleans up, the `with` protocol) is the same, and a fix to
it, say a leak on a failed start, must reach all three at once. So a service subclasses
`LocalServer` and fills in the hooks: `_install`, `_launch`, `_ready` and, where needed,
`_after_ready` and `_shut_down`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO, ClassVar, Self, TypeVar

from farm.devservices.ports import LOOPBACK, ServiceError, free_port, stop_process, wait_until

_T = TypeVar("_T")


class LocalServer:
    """One server on a free loopback port in its own temporary folder, until `stop()`.

    `start()` returns the object itself once the server really answers, and undoes
    everything it did when it fails (or is interrupted) part way, so a caller never has
    to clean up after a start that raised. `stop()` is idempotent: the `with` block, a
    fixture's teardown and an explicit call may all reach it.
    """

    slug: ClassVar[str]
    """Short name: the temporary folder is `farm-<slug>-…`."""
    label: ClassVar[str]
    """How messages name the server (`<label> on 127.0.0.1:<port>`)."""
    log_name: ClassVar[str]
    """The log's file name inside the temporary folder."""
    start_timeout: ClassVar[float]
    """Seconds the server has to become ready."""
    poll_interval: ClassVar[float] = 0.05
    """Seconds between readiness checks: a check that is itself slow deserves a longer one."""

    def __init__(self, workdir: Path | None = None) -> None:
        """`workdir` is where the server's temporary folder is made (system temp if None)."""
        self.workdir = workdir
        self._directory: Path | None = None
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        # Only the address: whatever secrets a server has must never reach a log via repr.
        state = self._describe() if self.running else "stopped"
        return f"{type(self).__name__}({state})"

    @property
    def running(self) -> bool:
        """Whether the server process we started is still alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def port(self) -> int:
        """The loopback port the server listens on."""
        return self._require(self._port)

    @property
    def directory(self) -> Path:
        """The server's temporary folder (data and log); gone after stop()."""
        return self._require(self._directory)

    @property
    def log_path(self) -> Path:
        """The server's log, whose tail goes into every start error."""
        return self.directory / self.log_name

    def start(self) -> Self:
        """Install if needed, start the server and return once it is ready."""
        if self._directory is not None or self._process is not None:
            raise ServiceError(f"{type(self).__name__} is already started")
        installed = self._install()
        base = self.workdir
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        self._directory = Path(tempfile.mkdtemp(prefix=f"farm-{self.slug}-", dir=base))
        try:
            self._port = port = free_port()
            self._launch(installed)
            self._wait_ready(port)
            self._after_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, port: int) -> None:
        """Until the launched process answers on ``port`` (or dies, or times out)."""
        wait_until(
            lambda: self._ready(port),
            what=f"{self.label} on {LOOPBACK}:{port}",
            timeout=self.start_timeout,
            process=self._process,
            log=self.log_path,
            interval=self.poll_interval,
        )

    def stop(self) -> None:
        """Stop the server and remove its folder with all its data. Idempotent."""
        self._shut_down()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
        self._port = None

    def halt(self) -> None:
        """Stop the server process only (SIGTERM, a clean shutdown), keeping its folder,
        data, port and credentials, so that :meth:`resume` brings the same server back:
        how the fault tests make an outage."""
        self._shut_down()

    def freeze(self) -> None:
        """SIGSTOP the server: it keeps its port and connections but answers nothing, as
        a hung host or a dead network path would (the fault tests' frozen peer)."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT a frozen server: it answers again, connections intact."""
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server process (no clean shutdown; its data as the disk has it),
        keeping its folder, port and credentials for :meth:`resume`."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=30)
            self._process = None

    def _signal(self, sig: signal.Signals) -> None:
        if self._process is None or self._process.poll() is not None:
            raise ServiceError(f"{type(self).__name__} is not running")
        os.kill(self._process.pid, sig)

    def resume(self) -> Self:
        """Start a halted server again on the same port, with its data; wait until ready."""
        installed = self._install()
        port = self.port
        self._launch(installed)
        self._wait_ready(port)
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # Hooks for the services.

    def _install(self) -> Path:
        """Find the server (installing or building it if needed) and return its path."""
        raise NotImplementedError

    def _launch(self, installed: Path) -> None:
        """Start the server on `self.port` in `self.directory`; `installed` is `_install()`'s."""
        raise NotImplementedError

    def _ready(self, port: int) -> bool:
        """Whether the server on the loopback port answers as it should when ready."""
        raise NotImplementedError

    def _after_ready(self) -> None:
        """Set-up that needs a running server (nothing by default)."""

    def _shut_down(self) -> None:
        """Stop the server process, if any (SIGTERM, then SIGKILL)."""
        if self._process is not None:
            stop_process(self._process)
            self._process = None

    def _describe(self) -> str:
        """What repr() shows of a running server: its address, never a credential."""
        return f"port={self._port}"

    # Helpers for the services.

    def _spawn(
        self,
        command: list[str],
        *,
        env: dict[str, str] | None = None,
        capture_output: bool = True,
    ) -> None:
        """Start the server process in its folder, in a new session, output to its log.

        A new session keeps a Ctrl-C in the terminal away from the server, so that our
        code, not the signal, stops it. `capture_output=False` is for a server that
        writes its log file itself (the file must not be opened twice).
        """
        with contextlib.ExitStack() as files:
            output: IO[bytes] | int = subprocess.DEVNULL
            if capture_output:
                output = files.enter_context(self.log_path.open("wb"))
            self._process = subprocess.Popen(
                command,
                env=env,
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _require(self, value: _T | None) -> _T:
        """`value`, which start() set, or a ServiceError saying the server is not started."""
        if value is None:
            raise ServiceError(f"{type(self).__name__} is not started")
        return value
