"""``farm demo``: the README's main job on the embedded default.

Builds a model's kernels on the local OpenCL device, then loads every one of them from
the store in a second batch (as another process would), and prints what each step cost.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from farm.cli.build import _run_with_progress, print_failures, print_summary
from farm.cli.console import out, print_json
from farm.local import local_farm
from farm.manifest import expand, load_manifest, resolve_manifest
from farm.settings import load_settings


def demo(
    manifest: Annotated[str, typer.Argument(help="manifest file or built-in name")] = "tiny",
    workers: Annotated[int | None, typer.Option("--workers", "-w", min=0)] = None,
    fresh: Annotated[bool, typer.Option(
        help="use a new temporary environment, so the build really compiles")] = False,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Build MANIFEST on the local device, then load all its kernels from the store."""
    with tempfile.TemporaryDirectory(prefix="farm-demo-") as tmp:
        overrides: dict[str, object] = {"home": Path(tmp)} if fresh else {}
        settings = load_settings(**overrides)
        path = resolve_manifest(manifest)
        loaded = load_manifest(path)
        t0 = time.perf_counter()
        with local_farm(settings, label=f"demo {loaded.name}", workers=workers) as farm:
            t_open = time.perf_counter() - t0
            artifacts = [e.artifact for e in expand(loaded, farm.registry)]
            build = _run_with_progress(farm.batch(label=f"build {loaded.name}"), artifacts,
                                       quiet=json_out)
            # A second batch with nothing in memory: every kernel comes from the store.
            reload = _run_with_progress(farm.batch(label=f"load {loaded.name}"), artifacts,
                                        quiet=json_out)
            fingerprint = farm.device.fingerprint
        steps = {"open (device, store, pool)": t_open, "build": build.wall_s,
                 "load all from the store": reload.wall_s}
        if json_out:
            print_json({"fingerprint": fingerprint, "build": build.summary(),
                        "load": reload.summary(), "steps_s": steps})
        else:
            print_summary(build, f"1. build {loaded.name} on {fingerprint}")
            print_failures(build, strict=False)
            print_summary(reload, f"2. load every kernel of {loaded.name} from the store")
            table = Table(title="what each step cost")
            table.add_column("step")
            table.add_column("wall", justify="right")
            table.add_column("per kernel", justify="right")
            n = max(1, len(artifacts))
            for name, secs in steps.items():
                table.add_row(name, f"{secs:.3f} s", "" if name.startswith("open")
                              else f"{secs / n * 1000:.1f} ms")
            out.print(table)
            if build.wall_s > 0 and reload.wall_s > 0:
                out.print(f"loading from the store was {build.wall_s / reload.wall_s:.0f}x "
                          "faster than the build")
    if build.failed or reload.failed:
        raise typer.Exit(1)
