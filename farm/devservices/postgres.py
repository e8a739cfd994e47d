"""A throwaway PostgreSQL cluster on loopback, for development and the integration tests.

PostgreSQL is the cluster's session storage. It refuses to run as root, so when we are
root its binaries run as the `postgres` user (through `runuser`) in a folder that user
owns. Authentication is `trust`: acceptable only because the server listens on
127.0.0.1 and its unix socket sits inside a private temporary folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import signal
import subprocess
from pathlib import Path

from farm.devservices.ports import (
    LOOPBACK,
    ServiceError,
    apt_install,
    log_tail,
    port_answers,
    wait_until,
)
from farm.devservices.server import LocalServer

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
USER = "farm"
DATABASE = "farm"
SERVICE_USER = "postgres"


def _version_key(initdb: str) -> tuple[int, ...]:
    """Sort key for /usr/lib/postgresql/<version>/bin/initdb: newest version last."""
    version = Path(initdb).parent.parent.name
    return tuple(int(part) for part in re.findall(r"\d+", version))


def find_postgres_bin() -> Path | None:
    """The newest Debian PostgreSQL binary folder, or None when none is installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    return Path(found[-1]).parent if found else None


def ensure_postgres() -> Path:
    """Return the folder of PostgreSQL's server binaries, installing Debian's package if needed.

    The version folder is found, not assumed, so the same code works on Debian 12 (15)
    and later releases.
    """
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        apt_install("postgresql")
        bin_dir = find_postgres_bin()
    if bin_dir is None:
        raise ServiceError("no /usr/lib/postgresql/*/bin/initdb after installing postgresql")
    return bin_dir


def postgres_answers(port: int, dbname: str = "postgres", timeout: int = 2) -> bool:
    """Whether the server on the loopback port runs `select 1` for the `farm` user."""
    import psycopg  # the `postgres` extra; imported here so the other services need none

    try:
        with psycopg.connect(
            host=LOOPBACK, port=port, user=USER, dbname=dbname, connect_timeout=timeout
        ) as conn:
            row = conn.execute("select 1").fetchone()
            return row is not None and row[0] == 1
    except psycopg.Error:
        return False


class PostgresServer(LocalServer):
    """One PostgreSQL cluster in its own temporary folder, with a `farm` database.

    `initdb` makes `farm` the superuser, so the URL needs no password and tests may
    create and drop whatever they like. pg_ctl daemonizes the server, so there is no
    process handle: `running` means "started and not stopped since", and `stop()` uses
    pg_ctl too (fast shutdown), falling back to killing the postmaster by the pid it
    recorded. `start()` runs initdb and pg_ctl start, waits for `select 1` and creates the
    `farm` database. The folder holds the data (under `pg/`), the unix socket and the logs.
    """

    slug = "postgres"
    label = "PostgreSQL"
    log_name = "pg.log"
    start_timeout = START_TIMEOUT_S
    poll_interval = 0.1

    def __init__(self, workdir: Path | None = None) -> None:
        """`workdir` is where the cluster's temporary folder is made (system temp if None).

        When we are root, the `postgres` user must be able to reach that folder; the
        system temp folder always works, a private one (e.g. pytest's) does not.
        """
        super().__init__(workdir)
        self._bin_dir: Path | None = None
        self._started = False

    @property
    def running(self) -> bool:
        """Whether the cluster was started and not stopped since."""
        return self._started

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the `farm` database, with the psycopg 3 driver."""
        return f"postgresql+psycopg://{USER}@{LOOPBACK}:{self.port}/{DATABASE}"

    @property
    def dsn(self) -> str:
        """libpq URL of the `farm` database, for psycopg or psql directly."""
        return f"postgresql://{USER}@{LOOPBACK}:{self.port}/{DATABASE}"

    @property
    def _data(self) -> Path:
        return self.directory / "pg"

    def _install(self) -> Path:
        return ensure_postgres()

    def _launch(self, installed: Path) -> None:
        self._bin_dir = installed
        self._prepare_folder()
        self._run(
            "initdb",
            "-D", str(self._data),
            "-A", "trust",
            "-U", USER,
            "-E", "UTF8",
            "--locale=C",
            "--no-sync",
        )  # fmt: skip
        options = f"-p {self.port} -k {self.directory} -c listen_addresses={LOOPBACK}"
        # Set before pg_ctl start: a start that fails half way may leave a server behind.
        self._started = True
        self._run(
            "pg_ctl",
            "-D", str(self._data),
            "-l", str(self.log_path),
            "-o", options,
            "-w", "-t", str(int(START_TIMEOUT_S)),
            "start",
        )  # fmt: skip

    def _ready(self, port: int) -> bool:
        return postgres_answers(port)

    def _after_ready(self) -> None:
        self._create_database()

    def _shut_down(self) -> None:
        """pg_ctl stop (fast), SIGKILL if that fails, then wait until the port is free."""
        if self._started and self._directory is not None:
            try:
                self._run("pg_ctl", "-D", str(self._data), "-m", "fast", "-w",
                          "-t", str(int(STOP_TIMEOUT_S)), "stop")  # fmt: skip
            except ServiceError:
                self._kill_postmaster()
            if self._port is not None:
                port = self._port
                with contextlib.suppress(ServiceError):
                    wait_until(
                        lambda: not port_answers(port),
                        what=f"PostgreSQL on port {port} to go away",
                        timeout=STOP_TIMEOUT_S,
                    )
        self._started = False

    def _as_root(self) -> bool:
        return os.geteuid() == 0

    def _prepare_folder(self) -> None:
        """As root, hand the folder to `postgres` and check that it can get there."""
        if not self._as_root():
            return
        try:
            account = pwd.getpwnam(SERVICE_USER)
        except KeyError as exc:
            raise ServiceError(f"there is no `{SERVICE_USER}` user to run PostgreSQL as") from exc
        os.chown(self.directory, account.pw_uid, account.pw_gid)
        check = subprocess.run(
            ["runuser", "-u", SERVICE_USER, "--", "test", "-w", str(self.directory)],
            cwd="/",
            capture_output=True,
            check=False,
        )
        if check.returncode != 0:
            raise ServiceError(
                f"the `{SERVICE_USER}` user cannot write to {self.directory}: one of its "
                "parent folders is private; give PostgresServer a workdir it can reach "
                "(the default, the system temp folder, works)"
            )

    def _run(self, tool: str, *args: str) -> None:
        """Run one of PostgreSQL's tools (as `postgres` when we are root), or raise.

        Output goes to a file rather than a pipe: pg_ctl leaves the server running
        behind it, and a pipe it inherited would keep us waiting for ever.
        """
        assert self._bin_dir is not None
        command = [str(self._bin_dir / tool), *args]
        if self._as_root():
            command = ["runuser", "-u", SERVICE_USER, "--", *command]
        output = self.directory / f"{tool}.out"
        with output.open("wb") as out:
            result = subprocess.run(
                command,
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                check=False,
            )
        if result.returncode != 0:
            detail = log_tail(output) + ("\n" + log_tail(self.log_path) if tool == "pg_ctl" else "")
            raise ServiceError(f"PostgreSQL {tool} failed ({result.returncode}):\n{detail}")

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(
            host=LOOPBACK, port=self.port, user=USER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute("create database farm")

    def _kill_postmaster(self) -> None:
        """Last resort when pg_ctl cannot stop the server: SIGKILL the postmaster."""
        try:
            first_line = (self._data / "postmaster.pid").read_text().splitlines()[0]
            pid = int(first_line)
        except (OSError, ValueError, IndexError):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
