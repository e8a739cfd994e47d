"""The ``farm`` command. Every :class:`FarmError` becomes one line and an exit status."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from farm.cli import build as build_cmd
from farm.cli import demo as demo_cmd
from farm.cli import devices as devices_cmd
from farm.cli import gc as gc_cmd
from farm.cli import ingest as ingest_cmd
from farm.cli import keygen as keygen_cmd
from farm.cli import run as run_cmd
from farm.cli import tune as tune_cmd
from farm.cli import warm as warm_cmd
from farm.cli import worker as worker_cmd
from farm.cli.bundle import app as bundle_app
from farm.cli.cluster import app as cluster_app
from farm.cli.console import print_error
from farm.cli.families import app as families_app
from farm.cli.help import EXIT_CODES, GroupedHelp, examples, new_app
from farm.cli.manifest import app as manifest_app
from farm.cli.records import app as records_app
from farm.core.errors import FarmError, one_line, printable


class _FarmHelp(GroupedHelp):
    ORDER = ("demo", "devices", "families", "manifest",  # start here
             "build", "warm", "run", "capture", "bundle",  # build and share kernels
             "records",  # look back
             "cluster", "worker", "workers", "ingest",  # run a cluster
             "gc", "keygen")  # keep the store


app = new_app("kernel-farm: a compilation farm for OpenCL kernels.\n\nSettings come from "
              "FARM_* environment variables (see the README); without FARM_REDIS_URL "
              "everything runs on this machine.",
              epilog=examples("farm build tiny", "farm records summary --build latest",
                              "farm cluster up") + f"\n\nExit status: {EXIT_CODES}",
              cls=_FarmHelp)


def _print_version(value: bool) -> None:
    if value:
        from farm.version import __version__

        typer.echo(f"kernel-farm {__version__}")
        raise typer.Exit()


@app.callback()
def _farm(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print the version and exit.")] = False) -> None:
    """kernel-farm: a compilation farm for OpenCL kernels."""


# Each command under its heading (``rich_help_panel``, which ``GroupedHelp`` prints in
# plain help, in ``_FarmHelp.ORDER``).
START, SHARE, LOOK, CLUSTER, STORE = ("Start here", "Build and share kernels",
                                      "Look back", "Run a cluster", "Keep the store")
app.command("demo", rich_help_panel=START, epilog=examples(
    "farm demo", "farm demo medium --fresh"))(demo_cmd.demo)
app.command("devices", rich_help_panel=START, epilog=examples(
    "farm devices", "farm devices --json"))(devices_cmd.devices)
app.add_typer(families_app, name="families", rich_help_panel=START,
              help="List kernel families; check them against numpy.")
app.add_typer(manifest_app, name="manifest", rich_help_panel=START,
              help="Inspect model manifests.")
app.command("build", rich_help_panel=SHARE, epilog=examples(
    "farm build tiny", "farm build model.toml --workers 4",
    "farm build medium --cluster --fingerprint pocl-pthread",
    "farm build model.toml --json > summary.json"))(build_cmd.build)
app.command("warm", rich_help_panel=SHARE, epilog=examples(
    "farm warm medium", "farm warm model.toml --on-miss farm",
    "farm warm model.toml --on-miss fail --json"))(warm_cmd.warm)
app.command("tune", rich_help_panel=SHARE, epilog=examples(
    "farm tune medium", "farm tune model.toml --json tuning.json",
    "farm tune medium --cluster --fingerprint pocl-pthread", "farm tune medium --retune"))(
    tune_cmd.tune)
app.command("run", rich_help_panel=SHARE, epilog=examples(
    "farm run -- python my_app.py", "farm run --json summary.json -- python my_app.py",
    "farm run --capture app.capture.json -- python my_app.py"))(run_cmd.run)
app.command("capture", rich_help_panel=SHARE, epilog=examples(
    "farm capture app.capture.json -- python my_app.py",
    "farm build app.capture.json --cluster"))(run_cmd.capture_cmd)
app.add_typer(bundle_app, name="bundle", rich_help_panel=SHARE,
              help="Export, import and inspect artifact bundles.")
app.add_typer(records_app, name="records", rich_help_panel=LOOK,
              help="Read sessions, records, builds and timelines.")
app.add_typer(cluster_app, name="cluster", rich_help_panel=CLUSTER,
              help="A local cluster on this machine.")
app.command("worker", rich_help_panel=CLUSTER, epilog=examples(
    "farm worker", "farm worker --fingerprint pocl-pthread --concurrency 4",
    "farm worker --metrics-port 9100 -- --max-tasks-per-child=100"))(worker_cmd.worker)
app.command("workers", rich_help_panel=CLUSTER, epilog=examples(
    "farm workers", "farm workers --json"))(worker_cmd.workers)
app.command("ingest", rich_help_panel=CLUSTER, epilog=examples(
    "farm ingest", "farm ingest --drain --json", "farm ingest --name ingester-0 "
    "--metrics-port 9102"))(ingest_cmd.ingest)
app.command("gc", rich_help_panel=STORE, epilog=examples("farm gc --dry-run", "farm gc"))(
    gc_cmd.gc)
app.command("keygen", rich_help_panel=STORE, epilog=examples("farm keygen signing.key"))(
    keygen_cmd.keygen)


def main() -> None:
    """Console entry point."""
    try:
        # Without standalone mode click returns the exit code of ``typer.Exit``.
        code = app(standalone_mode=False)
    except FarmError as exc:
        for line in exc.lines:  # one line per problem (a manifest reports each of its own)
            # nothing from input moves the cursor or forges a line (printable)
            print_error(printable(" ".join(line.split()), 4000))
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
        print_error(_os_error(exc))
        sys.exit(1)
    except ModuleNotFoundError as exc:
        # The device libraries are an extra (the ingester's image has none of them).
        if exc.name != "pyopencl":
            raise
        print_error("pyopencl is not installed: this command needs an OpenCL device "
                    "(pip install 'kernel-farm[opencl]')")
        sys.exit(1)
    except Exception as exc:
        if _is_redis_error(exc):  # an unreachable or refusing broker: one line
            from farm.core.outage import describe_refusal

            told = describe_refusal("Redis", exc, "FARM_REDIS_URL")
            print_error(told or "Redis: " + one_line(exc))
            sys.exit(1)
        # Usage errors (a bad flag value, an unknown option) are click's, raised either by
        # click itself or by the copy of click that typer carries.
        import click

        if isinstance(exc, click.ClickException | typer.TyperException) \
                and hasattr(exc, "format_message"):
            print_error(exc.format_message())
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
