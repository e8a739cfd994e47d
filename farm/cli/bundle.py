"""``farm bundle export|import|show``: move a store's artifacts as one file.

A bundle is untrusted input: every refusal is one line and exit status 2 (a
:class:`~farm.core.errors.BundleError`), and a refused bundle leaves the store unchanged.
See :mod:`farm.store.bundle` for the format and the rules.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from farm.cli.console import err, out, print_json
from farm.cli.help import examples, new_app
from farm.cli.tables import Column, print_table, print_title
from farm.core.defaults import BUNDLE_MAX_BYTES
from farm.core.errors import InputError, printable

if TYPE_CHECKING:
    from farm.core.keys import Namespace

app = new_app("Move artifacts between stores as one file (offline machines).",
              epilog=examples("farm bundle export kernels.bundle",
                              "farm bundle show kernels.bundle",
                              "farm bundle import kernels.bundle  # on the other machine"))

MaxSize = Annotated[int, typer.Option(
    "--max-size", metavar="BYTES", min=1, help="largest bundle accepted, in bytes (it is "
    "held in memory while it is verified)")]


def _namespace(text: str) -> Namespace:
    """A full namespace (``opencl/v1/<fingerprint>``) or a bare fingerprint."""
    from farm.core.keys import Namespace
    from farm.store.bundle import parse_namespace, reason

    try:
        return parse_namespace(text) if "/" in text else Namespace.for_fingerprint(text)
    except ValueError as exc:
        raise InputError(f"--namespace {text}: {reason(exc)}") from None


def _this_device_namespace(device: str | None) -> Namespace:
    """The namespace of this machine's device, found without initialising OpenCL here."""
    from farm.core.device import discover_devices
    from farm.core.device_probe import choose_device
    from farm.core.keys import Namespace
    from farm.core.settings import load_settings

    settings = load_settings()
    chosen = choose_device(settings, discover_devices(), device)
    return Namespace.for_fingerprint(chosen.fingerprint)


@app.command("export", epilog=examples(
    "farm bundle export kernels.bundle", "farm bundle export all.bundle --all",
    "farm bundle export gpu.bundle --namespace nvidia-h200 --force"))
def export(
    out_file: Annotated[Path, typer.Argument(metavar="OUT", help="bundle file to write")],
    namespace: Annotated[list[str] | None, typer.Option(
        "--namespace", "-n", metavar="NAMESPACE", help="namespace or fingerprint to "
        "export (repeatable); default: this machine's device")] = None,
    all_namespaces: Annotated[bool, typer.Option("--all", help="every namespace")] = False,
    device: Annotated[str | None, typer.Option(
        metavar="FINGERPRINT|NAME",
        help="pick this machine's device (when no --namespace/--all)")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="summary as JSON")] = False,
) -> None:
    """Export artifacts of this environment's store to one bundle file."""
    from farm.core.settings import load_settings
    from farm.programs.bundles import blobs_of
    from farm.store import open_store
    from farm.store.bundle import export_bundle

    if namespace and all_namespaces:
        raise InputError("give --namespace or --all, not both")
    chosen: list[Namespace] | None
    if all_namespaces:
        chosen = None
    elif namespace:
        chosen = [_namespace(n) for n in namespace]
    else:
        chosen = [_this_device_namespace(device)]
    store = open_store(load_settings())
    try:
        report = export_bundle(store, chosen, out_file, overwrite=force,
                               blobs_of=blobs_of(store))
    finally:
        store.close()
    if json_out:
        print_json(report.summary())
        return
    print_title(f"exported {out_file} ({report.file_bytes} bytes)")
    for ns in report.manifest.namespaces:  # a namespace whole on a line of its own
        out.print(Text(ns.namespace, overflow="fold"))
        out.print(f"  {ns.artifacts} artifact(s), {ns.bytes} bytes", highlight=False)
    for name in report.unreadable:
        err.print(f"[yellow]left out[/yellow] {name}: fails its digest in the store",
                  highlight=False)


@app.command("import", epilog=examples("farm bundle import kernels.bundle",
                                       "farm bundle import kernels.bundle --json"))
def import_(
    bundle: Annotated[Path, typer.Argument(metavar="FILE", help="bundle file to import")],
    max_size: MaxSize = BUNDLE_MAX_BYTES,
    validate: Annotated[bool, typer.Option(
        help="load each artifact for a device of this machine in a child process before "
             "importing (--no-validate: leave it to the loaders, which do it before "
             "first use)")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="summary as JSON")] = False,
) -> None:
    """Verify a bundle, load its binaries on devices here, then import it.

    Every digest is checked, and each binary for a device of this machine is loaded in
    a child process first (--no-validate: the loaders do it before first use)."""
    from farm.core.device import discover_devices
    from farm.core.settings import load_settings
    from farm.programs.proving import Proving, prove_stored
    from farm.store import open_store
    from farm.store.bundle import Validate, import_bundle

    settings = load_settings()
    devices = {d.fingerprint: d for d in discover_devices()} if validate else {}
    proving = Proving(settings.home)  # what it proves, the node's book keeps

    def validators(ns: Namespace) -> Validate | None:
        device = devices.get(ns.fingerprint)
        if device is None:
            return None
        return lambda art: prove_stored(proving, device, art)

    store = open_store(settings)
    try:
        report = import_bundle(bundle, store, max_bytes=max_size, validators=validators)
    finally:
        proving.close()
        store.close()
    summary = report.summary()
    if json_out:
        print_json(summary)
        return
    print_title(f"imported {bundle}")
    namespaces = summary["namespaces"]
    assert isinstance(namespaces, dict)
    for ns, counts in namespaces.items():  # a namespace whole on a line of its own
        out.print(Text(ns, overflow="fold"))
        out.print(f"  imported {counts['imported']}, skipped {counts['skipped']}, refused "
                  f"{counts['refused']}", highlight=False)
    out.print(f"total: imported {report.imported}, skipped {report.skipped}, refused "
              f"{report.refused}", highlight=False)
    if report.refused:
        out.print(f"{report.refused} artifact(s) refused: the store holds another value "
                  "under the key (first writer wins; a local artifact is never replaced)")
    if report.validated:
        out.print(f"{report.validated} artifact(s) validated on this machine's device "
                  "(loaded in a child process)")
    for ns, count in sorted(report.unvalidated.items()):
        out.print(f"{count} artifact(s) of {ns} not validated here (no such device): "
                  "loaders validate each in a child process before first use",
                  markup=False, highlight=False)


@app.command("show", epilog=examples("farm bundle show kernels.bundle"))
def show(
    bundle: Annotated[Path, typer.Argument(metavar="FILE", help="bundle file")],
    max_size: MaxSize = BUNDLE_MAX_BYTES,
    json_out: Annotated[bool, typer.Option("--json", help="manifest summary as JSON")] = False,
) -> None:
    """List what a bundle holds (verifying it in full), importing nothing."""
    from farm.store.bundle import read_bundle

    read = read_bundle(bundle, max_bytes=max_size)
    m = read.manifest
    families = Counter((a.namespace, a.meta.family) for a in m.artifacts)
    if json_out:
        print_json({
            "bundle": str(bundle), "bytes": read.file_bytes, "verified": True,
            "format": m.format, "version": m.version, "farm_version": m.farm_version,
            "created_at": m.created_at.isoformat(), "created_by": m.created_by,
            "total_bytes": m.total_bytes,
            "namespaces": [n.model_dump() for n in m.namespaces],
            "artifacts": [{"namespace": a.namespace, "key": str(a.key),
                           "family": a.meta.family, "size": a.size, "digest": a.digest,
                           "origin": a.meta.origin, "created_at": a.meta.created_at}
                          for a in m.artifacts],
        })
        return
    out.print(f"{bundle}: {m.format} v{m.version}, farm {m.farm_version}, created "
              f"{m.created_at:%Y-%m-%d %H:%M:%S %Z} on {m.created_by or '?'}; "
              f"{len(m.artifacts)} artifact(s), {m.total_bytes} bytes, every digest verified",
              markup=False, highlight=False)
    sizes: Counter[tuple[str, str]] = Counter()
    for a in m.artifacts:
        sizes[(a.namespace, a.meta.family)] += a.size
    for ns in sorted({ns for ns, _ in families}):  # the namespace whole, then its families
        out.print()
        out.print(Text(ns, style="bold", overflow="fold"))
        # a family name is the bundle's text: printable
        print_table([Column("family"), Column("artifacts", "right"), Column("bytes", "right")],
                    [[printable(family), str(count), str(sizes[(n, family)])]
                     for (n, family), count in sorted(families.items()) if n == ns])
