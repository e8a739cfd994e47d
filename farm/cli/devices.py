"""``farm devices``: the OpenCL devices here and their fingerprints."""

from __future__ import annotations

from typing import Annotated

import typer

from farm.cli.console import out, print_json


def devices(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List OpenCL devices with their fingerprints (probed in a child process)."""
    from rich.table import Table

    from farm.core.device import discover_devices

    found = discover_devices()
    if json_out:
        print_json([{**d.model_dump(mode="json"), "fingerprint": d.fingerprint}
                    for d in found])
        return
    table = Table(title="OpenCL devices")
    for col in ("#", "fingerprint", "device", "platform", "driver", "OpenCL C", "max wg",
                "local mem", "fp16", "fp64"):
        table.add_column(col)
    for i, d in enumerate(found):
        table.add_row(str(i), d.fingerprint, d.device_name, d.platform_version,
                      d.driver_version, d.opencl_c_version, str(d.max_work_group_size),
                      f"{d.local_mem_size // 1024} KiB", "yes" if d.has_fp16 else "no",
                      "yes" if d.has_fp64 else "no")
    out.print(table)
    if not found:
        out.print("no OpenCL device found (pip install pocl-binary-distribution)")
