"""``farm devices``: the OpenCL devices here and their fingerprints."""

from __future__ import annotations

from typing import Annotated

import typer

from farm.cli.console import out, print_json


def devices(json_out: Annotated[bool, typer.Option("--json", help="as JSON")] = False) -> None:
    """List the OpenCL devices here with their fingerprints.

    One block a device, its fingerprint whole on the first line: the value that
    --fingerprint, --device and FARM_DEVICE take (a unique prefix will do). The
    devices are probed in a child process, so this process keeps no driver state.
    """
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    from farm.cli.tables import print_title
    from farm.core.device import discover_devices

    found = discover_devices()
    if json_out:
        print_json([{**d.model_dump(mode="json"), "fingerprint": d.fingerprint}
                    for d in found])
        return
    print_title("OpenCL devices")
    for i, d in enumerate(found):
        out.print(Text(f"{i}  {d.fingerprint}", style="bold", overflow="fold"))
        grid = Table.grid(padding=(0, 2, 0, 0))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        for label, value in (
                ("device", d.device_name), ("platform", d.platform_version),
                ("driver", d.driver_version), ("OpenCL C", d.opencl_c_version),
                ("limits", f"work-group {d.max_work_group_size}, local memory "
                           f"{d.local_mem_size // 1024} KiB, fp16 "
                           f"{'yes' if d.has_fp16 else 'no'}, fp64 "
                           f"{'yes' if d.has_fp64 else 'no'}")):
            grid.add_row(label, Text(" ".join(value.split())))
        out.print(Padding(grid, (0, 0, 0, 3)))
    if not found:
        out.print("no OpenCL device found (pip install pocl-binary-distribution)")
