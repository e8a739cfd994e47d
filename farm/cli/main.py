"""The ``farm`` command. Every :class:`FarmError` becomes one line and an exit status."""

from __future__ import annotations

import sys

import typer

from farm.cli import build as build_cmd
from farm.cli import demo as demo_cmd
from farm.cli import devices as devices_cmd
from farm.cli import gc as gc_cmd
from farm.cli import ingest as ingest_cmd
from farm.cli import keygen as keygen_cmd
from farm.cli import warm as warm_cmd
from farm.cli import worker as worker_cmd
from farm.cli.bundle import app as bundle_app
from farm.cli.cluster import app as cluster_app
from farm.cli.families import app as families_app
from farm.cli.manifest import app as manifest_app
from farm.cli.records import app as records_app
from farm.core.errors import FarmError, one_line

app = typer.Typer(help="kernel-farm: a compilation farm for OpenCL kernels.",
                  pretty_exceptions_enable=False, no_args_is_help=True,
                  add_completion=False)
app.command("build")(build_cmd.build)
app.command("devices")(devices_cmd.devices)
app.command("demo")(demo_cmd.demo)
app.command("worker")(worker_cmd.worker)
app.command("workers")(worker_cmd.workers)
app.add_typer(manifest_app, name="manifest", help="Inspect model manifests.")
app.add_typer(cluster_app, name="cluster", help="A local cluster on this machine.")
app.command("ingest")(ingest_cmd.ingest)
app.command("warm")(warm_cmd.warm)
app.command("keygen")(keygen_cmd.keygen)
app.command("gc")(gc_cmd.gc)
app.add_typer(bundle_app, name="bundle", help="Export, import and inspect artifact bundles.")
app.add_typer(records_app, name="records", help="Read sessions, records, builds and timelines.")
app.add_typer(families_app, name="families", help="List kernel families; check them against numpy.")


def main() -> None:
    """Console entry point."""
    try:
        # Without standalone mode click returns the exit code of ``typer.Exit``.
        code = app(standalone_mode=False)
    except FarmError as exc:
        for line in exc.lines:  # one line per problem (a manifest reports each of its own)
            print(f"error: {' '.join(line.split())}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:
        # the machine, not the farm: a folder that cannot be made, a read-only disk, a
        # full one. One line naming the file; a bug's traceback is kept (below).
        print(f"error: {_os_error(exc)}", file=sys.stderr)
        sys.exit(1)
    except ModuleNotFoundError as exc:
        # The device libraries are an extra (the ingester's image has none of them).
        if exc.name != "pyopencl":
            raise
        print("error: pyopencl is not installed: this command needs an OpenCL device "
              "(pip install 'kernel-farm[opencl]')", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        if _is_redis_error(exc):  # an unreachable or refusing broker: one line
            print(f"error: Redis: {one_line(exc)}", file=sys.stderr)
            sys.exit(1)
        # Usage errors (a bad flag value, an unknown option) are click's, raised either by
        # click itself or by the copy of click that typer carries.
        import click

        if isinstance(exc, click.ClickException | typer.TyperException) \
                and hasattr(exc, "format_message"):
            print(f"error: {exc.format_message()}", file=sys.stderr)
            sys.exit(getattr(exc, "exit_code", 2))
        raise
    sys.exit(code if isinstance(code, int) else 0)


def _os_error(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or one_line(exc)}"


def _is_redis_error(exc: BaseException) -> bool:
    """``redis.RedisError``, without importing redis (the ``cluster`` extra) here."""
    return any(c.__module__.startswith("redis") and c.__name__ == "RedisError"
               for c in type(exc).__mro__)
