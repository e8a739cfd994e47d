"""``farm warm MANIFEST``: every kernel of a manifest onto this machine's device now.

Fetches what the store tiers hold (local SQLite, then MinIO when configured) on threads,
loads each on the device, compiles or requests what is missing (``--on-miss``), then
launches each kernel once (``--launch``, the default), and prints where each kernel came
from, what each phase took, and the time to first result per kernel (load + first
launch) beside the load alone: on PoCL an artifact without its launch's machine code
compiles at that first launch. What it fetched from MinIO
or compiled stays in the local tier, so the application's own loader later loads
without network or compiler.
"""

from __future__ import annotations

from typing import Annotated

import typer

from farm.cli.build_report import WHOLE
from farm.cli.console import out, print_json
from farm.core.errors import SettingsError, printable
from farm.core.outcomes import Fate


def warm(
    manifest: Annotated[str, typer.Argument(
        metavar="MANIFEST", help="a manifest file, or a built-in one: tiny, medium, large")],
    json_out: Annotated[bool, typer.Option("--json", help="summary as JSON")] = False,
    on_miss: Annotated[str, typer.Option(
        metavar="compile|farm|fail",
        help="what no store tier holds: compile (here), farm (the cluster's workers), "
             "fail")] = "compile",
    threads: Annotated[int | None, typer.Option(
        metavar="N",
        help="fetch threads (default 16, 4 when every kernel is in the local tier)",
        min=1, max=256)] = None,
    strict: Annotated[bool, typer.Option(
        "--strict",
        help="count kernels the device cannot run as failures")] = False,
    device: Annotated[str | None, typer.Option(
        metavar="FINGERPRINT|NAME", help="the local device (default: FARM_DEVICE, else the "
        "first)")] = None,
    launch: Annotated[bool, typer.Option(
        help="then launch each kernel once, its declared launch: the time to first "
             "result per kernel (load + first launch) beside the load")] = True,
) -> None:
    """Load every kernel of a manifest onto this device now.

    Fetches what the store tiers hold, loads each kernel, and compiles or asks the farm
    for what is missing (--on-miss). Exit status 1 when a kernel failed.
    """
    from farm.cli.progress import progress
    from farm.core.settings import load_settings

    if on_miss not in ("compile", "farm", "fail"):
        raise SettingsError(f"--on-miss must be compile, farm or fail, not {on_miss!r}")
    settings = load_settings(**({"device": device} if device else {}))
    # The device's context first, on a thread that releases the GIL: it costs seconds on
    # a GPU, and everything below (the loader's modules, the families, the manifest,
    # the store look-ups and reads) runs meanwhile.
    from farm.core.device import DeviceContext, probe_devices
    from farm.core.device_probe import choose_device

    context = DeviceContext(choose_device(settings, probe_devices())).start()
    from loader import KernelLoader, WarmItem
    from loader.base import OnMiss

    mode: OnMiss = on_miss  # type: ignore[assignment]
    with KernelLoader(settings, device=context, on_miss=mode,
                      label=f"warm {manifest}") as loader, \
            progress(None, quiet=json_out, description="warming") as shown:

        def tick(item: WarmItem) -> None:
            shown.advance(item.source or (item.failure.kind if item.failure else ""),
                          item.label)

        from loader.warming import artifacts_of

        artifacts, label = artifacts_of(manifest, loader)
        shown.set_total(len(artifacts))
        report = loader.warm(artifacts, progress=tick, threads=threads, label=label)
        if launch:
            from loader.readiness import launch_all

            launched = [0]

            def launched_one(item: WarmItem) -> None:
                launched[0] += 1
                shown.status(f"first launches: {launched[0]}, last {item.label}")

            launch_all(loader, report.items, report.phases["launch"], notify=launched_one)
    summary = report.summary()
    failed = report.failed + (report.unsupported if strict else [])
    if json_out:
        print_json({"summary": summary,
                    Fate.UNSUPPORTED: [_item_json(i) for i in report.unsupported],
                    "failures": [_item_json(i) for i in report.failed]})
    else:
        _print_summary(summary)
        for item in report.unsupported[:20]:  # labels and messages echo input: printable
            out.print("[yellow]unsupported[/yellow] ", end="")
            out.print(printable(f"{item.label}: "
                                f"{item.failure.message if item.failure else ''}", WHOLE),
                      markup=False, soft_wrap=True)
        for item in report.failed:
            assert item.failure is not None
            out.print("[red]FAILED[/red] ", end="")
            out.print(printable(f"{item.label} ({item.failure.kind}): "
                                f"{item.failure.message}", WHOLE),
                      markup=False, soft_wrap=True)
            for line in item.failure.build_log.splitlines()[:40]:
                out.print(f"    | {printable(line, WHOLE)}", markup=False, soft_wrap=True)
    if failed:
        raise typer.Exit(1)


def _print_summary(s: dict[str, object]) -> None:
    from farm.cli.tables import Column, print_one_row, print_table
    from loader.programs import SOURCES

    cols = ("kernels", *SOURCES, Fate.UNSUPPORTED, Fate.FAILED, "wall", "per kernel")
    print_one_row([Column(c, "right") for c in cols],
                  [*(str(s[c]) for c in cols[:-2]), f"{s['wall_s']:.3f} s",
                   f"{s['per_kernel_ms']:.2f} ms"],
                  title=f"farm warm {s['manifest']} on {s['fingerprint']}")
    assert isinstance(s["phases"], dict)
    out.print()
    print_table([Column("phase"), *(Column(c, "right") for c in ("kernels", "wall", "work"))],
                [[name, str(p["kernels"]), f"{p['wall_s']:.3f} s", f"{p['work_s']:.3f} s"]
                 for name, p in s["phases"].items()],
                title="phases (wall: first start to last end; work: summed over kernels)")
    r = s["readiness"]
    assert isinstance(r, dict)
    if r.get("kernels"):
        out.print(f"time to first result per kernel (median of {r['kernels']} loaded from a "
                  f"store tier): {r['first_result_ms']:.2f} ms = load {r['load_ms']:.2f} ms "
                  f"+ first launch {r['first_launch_ms']:.2f} ms")


def _item_json(item: object) -> dict[str, object]:
    from loader import WarmItem

    assert isinstance(item, WarmItem) and item.failure is not None
    return {"kernel": item.artifact.kernel.model_dump(mode="json"), "label": item.label,
            "key": str(item.key) if item.key else None, **item.failure.model_dump()}
