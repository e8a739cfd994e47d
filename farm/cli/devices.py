"""``farm devices``: the OpenCL devices here, their fingerprints, whether each compiles,
and which one the farm uses."""

from __future__ import annotations

from typing import Annotated

import typer

from farm.cli.console import err, out, print_json


def devices(json_out: Annotated[bool, typer.Option("--json", help="as JSON")] = False,
            probe: Annotated[bool, typer.Option(
                "--probe", help="build the trivial probe program on every device again, "
                "whatever earlier probes said")] = False,
            check: Annotated[bool, typer.Option(
                "--check", help="print one line: the device the farm uses, or why none "
                "(exit 1: none compiles, 2: FARM_DEVICE matches none)")] = False) -> None:
    """List the OpenCL devices here with their fingerprints.

    One block a device, its fingerprint whole on the first line: the value that
    --fingerprint, --device and FARM_DEVICE take (a unique prefix will do). "use" says
    whether its compiler builds a trivial program (kept per fingerprint, so probed once)
    and which device the farm uses: FARM_DEVICE's match, else the first that compiles
    (newest of two platforms of one name first). The devices are probed in child
    processes, so this process keeps no driver state.
    """
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    from farm.cli.tables import print_title
    from farm.core.device import discover_devices, select_device, usable
    from farm.core.device_probe import probe_builds
    from farm.core.errors import DeviceError, printable
    from farm.core.settings import load_settings

    settings = load_settings()
    found = discover_devices()
    probes = probe_builds(found, settings.device_probes, again=probe)
    try:
        chosen = select_device(found, settings.device, probes).fingerprint
        problem: DeviceError | None = None
    except DeviceError as exc:  # listed all the same, then said, with its exit status
        chosen, problem = "", exc
    if check:
        if problem is not None:
            raise problem
        compiling = len({d.fingerprint for d in found if usable(d, probes)})
        out.print(f"the farm uses {chosen} ({compiling} of {len({d.fingerprint for d in found})}"
                  " device fingerprint(s) here compile)", markup=False, soft_wrap=True)
        return

    def why_not(fingerprint: str) -> str:
        probe = probes.get(fingerprint)
        return printable(probe.reason, 300) if probe is not None and not probe.usable else ""

    if json_out:
        print_json([{**d.model_dump(mode="json"), "fingerprint": d.fingerprint,
                     "usable": usable(d, probes), "reason": why_not(d.fingerprint),
                     "default": d.fingerprint == chosen} for d in found])
    else:
        print_title("OpenCL devices")
    for i, d in enumerate([] if json_out else found):
        out.print(Text(f"{i}  {d.fingerprint}", style="bold", overflow="fold"))
        grid = Table.grid(padding=(0, 2, 0, 0))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        use = ("compiles; the farm uses it" + (" (FARM_DEVICE)" if settings.device else "")
               if d.fingerprint == chosen else "compiles" if usable(d, probes)
               else f"cannot compile: {why_not(d.fingerprint)}")
        for label, value in (
                ("use", use),
                ("device", d.device_name), ("platform", d.platform_version),
                ("driver", d.driver_version), ("OpenCL C", d.opencl_c_version),
                ("limits", f"work-group {d.max_work_group_size}, local memory "
                           f"{d.local_mem_size // 1024} KiB, fp16 "
                           f"{'yes' if d.has_fp16 else 'no'}, fp64 "
                           f"{'yes' if d.has_fp64 else 'no'}")):
            grid.add_row(label, Text(" ".join(value.split())))
        out.print(Padding(grid, (0, 0, 0, 3)))
    if problem is not None:
        for line in problem.lines:
            err.print(f"error: {line}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(problem.exit_code)
