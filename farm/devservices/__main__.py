"""`python -m farm.devservices up`: run the development services for a shell session.

Prints the farm's settings as `export` lines (the MinIO secret included: that is what
they are for), then holds the services until SIGINT or SIGTERM, and stops them, so a
developer or a CI script gets a real cluster back end with one command and no leftovers.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

from farm.devservices import export_lines
from farm.devservices.minio import MinioServer
from farm.devservices.ports import ServiceError
from farm.devservices.postgres import PostgresServer
from farm.devservices.redis import RedisServer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m farm.devservices",
        description="Run throwaway Redis, MinIO and PostgreSQL servers on loopback.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser(
        "up",
        help="start services, print export lines, wait for Ctrl-C or SIGTERM, then stop",
        description="Start the chosen services (all when none is chosen), print their "
        "settings as shell export lines, and stop them on SIGINT or SIGTERM.",
    )
    up.add_argument("--redis", action="store_true", help="start Redis")
    up.add_argument("--minio", action="store_true", help="start MinIO")
    up.add_argument("--postgres", action="store_true", help="start PostgreSQL")
    up.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="folder for the services' temporary folders (default: system temp)",
    )
    up.add_argument(
        "--env-file",
        type=Path,
        default=None,
        help="also write the export lines to this file (mode 0600) once all are up; "
        "it is removed on exit",
    )
    return parser


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    """Turn SIGTERM, and SIGINT, into the same clean exit path. SIGINT too, explicitly:
    a process started in the background by a non-interactive shell (`cmd &` in a
    script, nohup) inherits SIGINT ignored, and Python then installs no handler, so
    a SIGINT would never stop the services."""
    raise KeyboardInterrupt


def _exports(
    redis: RedisServer | None, minio: MinioServer | None, postgres: PostgresServer | None
) -> list[str]:
    settings: dict[str, str] = {}
    if redis is not None:
        settings["FARM_REDIS_URL"] = redis.url
    if minio is not None:
        settings["FARM_MINIO_ENDPOINT"] = minio.endpoint
        settings["FARM_MINIO_ACCESS_KEY"] = minio.access_key
        settings["FARM_MINIO_SECRET_KEY"] = minio.secret_key
        settings["FARM_MINIO_SECURE"] = "false"
    if postgres is not None:
        settings["FARM_RECORDS_URL"] = postgres.url
    return export_lines(settings)


def _write_env_file(path: Path, lines: list[str]) -> None:
    """Write atomically, so a script polling for the file never reads half of it."""
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    partial.replace(path)


def up(args: argparse.Namespace) -> int:
    """Start, report, hold until a signal, stop. Returns the process exit status."""
    everything = not (args.redis or args.minio or args.postgres)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    status = 0
    stack = ExitStack()
    try:
        redis = minio = postgres = None
        if everything or args.redis:
            print("devservices: starting Redis", file=sys.stderr, flush=True)
            redis = stack.enter_context(RedisServer(args.workdir))
        if everything or args.minio:
            print("devservices: starting MinIO", file=sys.stderr, flush=True)
            minio = stack.enter_context(MinioServer(args.workdir))
        if everything or args.postgres:
            print("devservices: starting PostgreSQL", file=sys.stderr, flush=True)
            postgres = stack.enter_context(PostgresServer(args.workdir))
        lines = _exports(redis, minio, postgres)
        print("\n".join(lines), flush=True)
        if args.env_file is not None:
            _write_env_file(args.env_file, lines)
            stack.callback(args.env_file.unlink, missing_ok=True)
        print("devservices: up; Ctrl-C or SIGTERM stops them", file=sys.stderr, flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    except ServiceError as exc:
        print(f"devservices: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        # Stopping must not be cut short by a second signal: it has its own timeouts.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("devservices: stopping", file=sys.stderr, flush=True)
        stack.close()
        print("devservices: stopped", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m farm.devservices`."""
    args = _parser().parse_args(argv)
    if args.command == "up":
        return up(args)
    raise AssertionError(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
