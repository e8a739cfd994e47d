"""``farm demo``: the README's main job on the embedded default.

1. builds a model's kernels on the local OpenCL device into the store;
2. loads every stored kernel onto the device again, as another process would: a loader
   with a fresh context of its own, which may not compile (``on_miss="fail"``), so each
   kernel really is a program created from its stored binary; then launches each once
   (its declared launch), since a driver that compiles at first launch (PoCL, for an
   artifact without its launch's machine code) would only show it there;
3. runs one of the loaded kernels on the device and checks it against numpy;

and prints what each step cost, per kernel: a build against the time to first result
(load + first launch), beside the load alone.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from farm.cli.build_report import print_failures, print_summary
from farm.cli.console import out, print_json
from farm.cli.progress import progress
from farm.core.outcomes import Fate

if TYPE_CHECKING:
    from farm.core.model import ArtifactId
    from loader import KernelLoader


def demo(
    manifest: Annotated[str, typer.Argument(
        metavar="MANIFEST", help="a manifest file, or a built-in one: tiny, medium, "
        "large")] = "tiny",
    workers: Annotated[int | None, typer.Option(
        "--workers", "-w", min=0, metavar="N", help="local compile processes (default: "
        "FARM_WORKERS, else one per core; 0 compiles in this process)")] = None,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="use a new temporary environment, so the build really "
        "compiles")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="the results as JSON")] = False,
) -> None:
    """Build, load back and run a manifest on the local device.

    Builds MANIFEST into the store, loads every kernel back onto the device in a fresh
    context without a compiler, runs one against numpy, and prints what each step
    cost. Exit status 1 when a kernel failed or differs from numpy.
    """
    from farm.cli.tables import Column, print_one_row
    from farm.compilation.local import local_farm
    from farm.core.outcomes import Outcome
    from farm.core.settings import load_settings
    from farm.manifest import expand, load_manifest, resolve_manifest
    from loader import KernelLoader
    from loader.programs import Source

    with tempfile.TemporaryDirectory(prefix="farm-demo-") as tmp:
        overrides: dict[str, object] = {"home": Path(tmp)} if fresh else {}
        settings = load_settings(**overrides)
        loaded = load_manifest(resolve_manifest(manifest))
        with local_farm(settings, label=f"demo {loaded.label}", workers=workers) as farm:
            artifacts = [e.artifact for e in expand(loaded, farm.registry)]
            with progress(len(artifacts), quiet=json_out) as shown:
                build = farm.batch(label=f"build {loaded.label}").run(artifacts,
                                                                      progress=shown)
            fingerprint = farm.device.fingerprint
        stored = [r.artifact for r in build.results if r.outcome is not None]
        t0 = time.perf_counter()
        with KernelLoader(settings, device=fingerprint, on_miss="fail",
                          label=f"demo load {loaded.label}") as loader:
            _ = loader.queue  # the fresh context, made before the loads' clock starts
            t_context = time.perf_counter() - t0
            warm = loader.warm(stored, label=loaded.label, launch=True)
            check = _run_one(loader, stored)
        # The ratio compares like with like: a build that compiled, per kernel it
        # compiled, against a load from the store, per kernel loaded.
        n_built = build.count(Outcome.COMPILED) + build.count(Outcome.REKEYED)
        per_build = build.wall_s / n_built if n_built else 0.0
        per_load = warm.wall_s / max(1, warm.count(Source.LOCAL))
        ready = warm.summary()["readiness"]
        per_result = float(ready.get("first_result_ms", 0.0)) / 1000
        ratio = per_build / per_load if per_load > 0 and n_built else 0.0
        ready_ratio = per_build / per_result if per_result > 0 and n_built else 0.0
        if json_out:
            print_json({"fingerprint": fingerprint, "build": build.summary(),
                        "load": warm.summary(), "context_s": round(t_context, 4),
                        "check": check, "build_ms_per_kernel": round(1000 * per_build, 3),
                        "load_ms_per_kernel": round(1000 * per_load, 3),
                        "first_result_ms_per_kernel": round(1000 * per_result, 3),
                        "build_to_load": round(ratio, 1) if n_built else None,
                        "build_to_first_result": round(ready_ratio, 1) if n_built else None})
        else:
            print_summary(build, f"1. build {loaded.label} on {fingerprint}")
            print_failures(build, strict=False)
            s = warm.summary()
            print_one_row([Column(c, "right") for c in ("kernels", Fate.LOADED,
                                                        "native fallbacks", Fate.FAILED,
                                                        "wall", "per kernel")],
                          [str(s["kernels"]), str(s["local"]), str(s["native_fallbacks"]),
                           str(s[Fate.FAILED]), f"{warm.wall_s:.3f} s",
                           f"{1000 * per_load:.2f} ms"],
                          title=f"2. load every stored kernel of {loaded.label} onto the "
                                "device, in a fresh context, without a compiler")
            out.print(f"3. {check['kernel']} ran on the device: "
                      + ("matches numpy" if check["ok"] else
                         f"[red]differs from numpy[/red]: {'; '.join(check['problems'])}"))
            if n_built:
                out.print(f"building took {1000 * per_build:.1f} ms a kernel "
                          f"({build.wall_s:.2f} s for {n_built}); from the store, a kernel's "
                          f"first result took {1000 * per_result:.2f} ms (median: load "
                          f"{ready.get('load_ms', 0.0):.2f} ms + first launch "
                          f"{ready.get('first_launch_ms', 0.0):.2f} ms): {ready_ratio:.0f}x "
                          f"faster; loading alone {1000 * per_load:.2f} ms a kernel (the "
                          f"fresh context itself took {t_context:.2f} s)")
            else:
                out.print(f"the build found every kernel stored; a kernel's first result "
                          f"took {1000 * per_result:.2f} ms (load + first launch; loading "
                          f"alone {1000 * per_load:.2f} ms; run with --fresh to compile)")
    if build.failed or warm.failed or not check["ok"]:
        raise typer.Exit(1)


def _run_one(loader: KernelLoader, artifacts: list[ArtifactId]) -> dict[str, Any]:
    """Run the first loaded kernel that has an example on the device and compare it with
    numpy (``example()`` is optional for a family)."""
    import numpy as np

    from farm.families.run import check_example, run_example

    for artifact in artifacts:
        family = loader.registry.get(artifact.kernel.family)
        example = family.example(family.validate(artifact.kernel.params),
                                 artifact.kernel.launch, np.random.default_rng(0))
        if example is not None:
            break
    else:
        return {"kernel": "no kernel", "ok": False,
                "problems": ["nothing stored has an example to run"]}
    kernel = loader.kernel_for(artifact, name=example.kernel_name)
    problems = check_example(run_example(loader.queue, kernel, example), example)
    return {"kernel": artifact.kernel.label(), "ok": not problems, "problems": problems}
