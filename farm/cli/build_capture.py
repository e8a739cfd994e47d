"""``farm build CAPTURE``: the programs an application built (``farm capture``), built
ahead of time for every device type the capture names or ``--fingerprint`` names."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from farm.cli.progress import Progress
    from farm.core.settings import Settings
    from farm.programs.capture import CaptureFile
    from farm.programs.making import Readiness
    from farm.programs.prebuild import Built
    from farm.records import Recorder
    from farm.store import ArtifactStore

import typer

from farm.cli.console import err, print_json


def is_capture(name: str) -> bool:
    """Whether ``name`` is a capture file (JSON: named ``*.json`` or starting with ``{``)
    rather than a manifest (TOML)."""
    path = Path(name)
    if path.suffix == ".json":
        return True
    try:
        with path.open("rb") as fh:
            head = fh.read(64).lstrip()
    except OSError:
        return False
    return head.startswith(b"{")


def build_capture(name: str, *, workers: int | None, json_out: bool, cluster: bool | None,
                  fingerprint: str | None, device: str | None) -> None:
    """Build every program of the capture ``name``; exit 1 when one failed."""
    from farm.cli.build_report import print_failures, print_summary
    from farm.cli.progress import progress
    from farm.core.settings import load_settings
    from farm.programs.capture import read_capture
    from farm.programs.prebuild import targets
    from farm.records.open import open_recorder
    from farm.store.open import open_store

    settings = load_settings(**({"device": device} if device else {}))
    capture = read_capture(Path(name))
    use_cluster = settings.cluster if cluster is None else cluster
    plan = targets(capture, fingerprint)
    if not plan:
        err.print(f"capture {name} holds no program", markup=False)
    label = f"build {Path(name).name}"
    store = open_store(settings)
    recorder = open_recorder(settings, label)
    reports: list[tuple[str, Built]] = []
    try:
        with recorder:  # an interrupt's records problem is a warning, not its traceback
            for fp, specs in plan.items():
                with progress(len(specs), quiet=json_out) as tick, _sigterm_interrupts():
                    if use_cluster:
                        built = _on_cluster(settings, capture, fp, store, tick)
                    else:
                        built = _here(settings, capture, fp, store, recorder, workers, tick)
                reports.append((fp, built))
    finally:
        store.close()
    failed = any(b.report.failed or (b.ready and b.ready.failed) for _, b in reports)
    if json_out:
        print_json({"capture": name, "cluster": use_cluster, "builds": [
            {"fingerprint": fp, "summary": b.report.summary(),
             "failures": [{"label": x.label, "key": str(x.key), **x.failure.model_dump()}
                          for x in b.report.failed + b.report.unsupported if x.failure],
             **({"work_group_functions": b.ready.summary()} if b.ready else {})}
            for fp, b in reports]})
    else:
        for fp, built in reports:
            print_summary(built.report, title=f"farm build {Path(name).name} on {fp}")
            print_failures(built.report, strict=False)
            if built.ready is not None:
                _print_ready(built.ready)
    if failed:
        raise typer.Exit(1)


def _print_ready(ready: Readiness) -> None:
    """What was made of the capture's launches: one line, and one per program that is
    not ready."""
    from farm.cli.console import out
    from farm.core.errors import printable

    took = f" in {ready.wall_s:.2f} s" if ready.wall_s else ""
    out.print(f"work-group functions of the captured launches: {ready.made} made{took}, "
              f"{ready.held} stored already ({ready.programs} programs"
              + (f"; {ready.ignored} launches of kernels the programs lack, ignored"
                 if ready.ignored else "") + ")", markup=False, soft_wrap=True)
    for key, why in ready.failed:
        out.print("[red]NOT READY[/red] ", end="")
        out.print(printable(f"program(key={key[:16]}): {why}"), markup=False, soft_wrap=True)


def _here(settings: Settings, capture: CaptureFile, fp: str, store: ArtifactStore,
          recorder: Recorder, workers: int | None, tick: Progress) -> Built:
    from farm.core.device import probe_devices
    from farm.core.errors import DeviceError
    from farm.programs.prebuild import build_here

    local = [d for d in probe_devices() if d.fingerprint == fp]
    if not local:
        raise DeviceError(f"no device here has fingerprint {fp}: build the capture with "
                          "--cluster, or on a machine with that device")
    return build_here(settings, local[0], capture, store=store, recorder=recorder,
                      workers=settings.workers if workers is None else workers,
                      progress=tick, status=tick.status)


def _on_cluster(settings: Settings, capture: CaptureFile, fp: str, store: ArtifactStore,
                tick: Progress) -> Built:
    from farm.cluster.client import ClusterClient
    from farm.families import Registry
    from farm.programs.prebuild import build_on_cluster

    def say(line: str) -> None:
        err.print(line, markup=False, soft_wrap=True)

    with ClusterClient(settings, registry=Registry(), store=store, say=say,
                       ahead=True) as client:
        client.served(fp)  # no worker for it: one line naming those served
        return build_on_cluster(client, capture, fp, progress=tick, status=tick.status)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM interrupts the build as Ctrl-C does (``KeyboardInterrupt``), so that its
    compile processes are stopped on the way out; by default it ended this process and
    left them compiling."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
