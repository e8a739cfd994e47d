"""``farm tune MANIFEST``: build what the manifest's tuning keys lack, time every key's
candidates on the device, keep the winners (docs/TUNING.md).

Here: the candidates are built or loaded through a ``KernelLoader`` on the local device,
then each key is measured in this process (``farm.tuning.runner``). With ``--cluster``:
the candidates are built by the fingerprint's pool (as ``farm build --cluster``), then
one task per key goes to that pool and is measured on a worker's device
(``farm.tuning.cluster``). Either way a key already tuned for this fingerprint,
candidate list and build is reused, not measured (``--retune`` measures it again).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from farm.cli.console import err, out
from farm.cli.progress import progress
from farm.cli.tables import Column, print_table
from farm.core.outcomes import Fate

if TYPE_CHECKING:
    from farm.core.settings import Settings
    from farm.families import Registry
    from farm.tuning.keys import TuningSpec
    from farm.tuning.model import MeasurePolicy
    from farm.tuning.runner import TuneOutcome


@dataclass(frozen=True)
class _Run:
    """What one ``farm tune`` asks for."""

    label: str
    policy: MeasurePolicy
    retune: bool


def tune(
    manifest: Annotated[str, typer.Argument(
        metavar="MANIFEST", help="a manifest file or a built-in one (tiny, medium, large)")],
    cluster: Annotated[bool | None, typer.Option(
        "--cluster/--local", help="measure on the fingerprint's pool, one key per task, "
        "or here (default: on the cluster when FARM_REDIS_URL is set)")] = None,
    fingerprint: Annotated[str | None, typer.Option(
        metavar="FINGERPRINT", help="cluster: the target fingerprint, whole or a unique "
        "prefix of one served (default: the local device's)")] = None,
    device: Annotated[str | None, typer.Option(
        metavar="FINGERPRINT|NAME", help="the local device (default: FARM_DEVICE, else the "
        "first)")] = None,
    retune: Annotated[bool, typer.Option(
        "--retune", help="measure keys the store holds a result for, and replace it")
    ] = False,
    json_file: Annotated[Path | None, typer.Option(
        "--json", metavar="FILE", dir_okay=False, help="also write the results there as "
        "JSON (docs/TUNING.md)")] = None,
    min_launches: Annotated[int, typer.Option(
        min=1, max=100_000, metavar="N", help="timed launches per candidate, at least")] = 10,
    min_ms: Annotated[float, typer.Option(
        min=0.0, max=1e7, metavar="MS", help="kernel time per candidate, at least")] = 50.0,
    budget: Annotated[float, typer.Option(
        min=0.1, max=86_400.0, metavar="S", help="seconds of timing one key may take")
    ] = 60.0,
) -> None:
    """Time each tuning key's candidates; keep the fastest right ones.

    A tuning key is a problem (a matrix shape) and its candidates (the manifest's
    [model.tuning] tiles). Each candidate is checked against the family's reference,
    then timed by the device's own events, the candidates taking turns; the fastest
    right one wins. Winners go to the store for every node of this device
    (KernelLoader.tuned). Exit status 1 when a key could not be tuned or a candidate
    computed wrong values.
    """
    from farm.core.errors import InputError
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest
    from farm.tuning.keys import plan
    from farm.tuning.model import MeasurePolicy

    settings = load_settings(**({"device": device} if device else {}))
    path = resolve_manifest(manifest)
    loaded = load_manifest(path)
    registry = Registry.load(settings.family_modules)
    specs = plan([e.artifact for e in expand(loaded, registry)], registry)
    if not specs:
        raise InputError(f"{path}: no tuning key: no problem of a family with a tuning "
                         "space has two candidates or more (matmul: [model.tuning] of a "
                         "[model], or [[kernels]] differing only in their tiles)")
    policy = MeasurePolicy(min_launches=min_launches, min_ms=min_ms, max_s=budget,
                           max_launches=max(1000, min_launches))
    run = _Run(label=f"tune {loaded.label}", policy=policy, retune=retune)
    use_cluster = settings.cluster if cluster is None else cluster
    start = time.perf_counter()
    if use_cluster:
        fp, outcomes = _on_cluster(settings, registry, specs, run, fingerprint)
    else:
        fp, outcomes = _here(settings, specs, run)
    _print(fp, loaded.label, outcomes, registry, time.perf_counter() - start)
    if json_file is not None:
        from farm.tuning.report import document

        json_file.write_text(json.dumps(document(fp, outcomes), indent=1) + "\n")
    if _troubles(outcomes):
        raise typer.Exit(1)


def _here(settings: Settings, specs: list[TuningSpec], run: _Run
          ) -> tuple[str, list[TuneOutcome]]:
    """Build, then measure every key on the local device."""
    from farm.compilation.finalize import worker_name
    from farm.core.isolation import HostLock
    from farm.tuning.runner import TuneOutcome, Tuner
    from loader import KernelLoader

    with KernelLoader(settings, label=run.label) as loader:
        tuner = Tuner(registry=loader.registry, device=loader.device, ctx=loader.context,
                      cl_device=loader.cl_device, store=loader.store,
                      program_of=loader.program_for, recorder=loader.recorder,
                      policy=run.policy, lock=HostLock(settings.isolation_dir),
                      worker=worker_name())
        done: dict[int, TuneOutcome] = {}
        if not run.retune:
            for i, spec in enumerate(specs):
                found = tuner.stored(spec)
                if found is not None:
                    done[i] = TuneOutcome(spec=spec, result=found, reused=True)
        todo = [(i, s) for i, s in enumerate(specs) if i not in done]
        artifacts = [a for _, s in todo for a in s.artifacts()]
        if artifacts:
            with progress(len(artifacts)) as shown:
                loader.warm(artifacts, label=run.label, progress=lambda item: shown.advance(
                    item.source or (item.failure.kind if item.failure else ""),
                    item.label))
        with progress(len(todo), description="tuning", unit="keys") \
                as shown:
            for i, spec in todo:
                done[i] = tuner.tune(spec, retune=run.retune)
                shown.advance(_what(done[i]), spec.label())
        return loader.device.fingerprint, [done[i] for i in range(len(specs))]


def _on_cluster(settings: Settings, registry: Registry, specs: list[TuningSpec], run: _Run,
                fingerprint: str | None) -> tuple[str, list[TuneOutcome]]:
    """Build on the pool, then one task per key to the pool."""
    from farm.cluster.client import BuildOptions, ClusterClient
    from farm.cluster.workers import served
    from farm.core.device import probe_devices, resolve_fingerprint, select_device
    from farm.core.keys import Namespace
    from farm.records.model import RequestedBy
    from farm.records.open import open_recorder
    from farm.tuning import store as results
    from farm.tuning.cluster import tune_on_cluster
    from farm.tuning.runner import TuneOutcome

    with ClusterClient(settings, registry=registry, say=_say, ahead=True) as client:
        if fingerprint:
            fp = resolve_fingerprint(fingerprint, client.waiter.call(
                lambda: served(client.redis, settings.dead_worker_grace)))
        else:
            fp = select_device(probe_devices(), settings.device).fingerprint
        client.served(fp)
        ns = Namespace.for_fingerprint(fp)
        done: dict[int, TuneOutcome] = {}
        if not run.retune:
            for i, spec in enumerate(specs):
                found = results.read(client.store, ns, spec)
                if found is not None:
                    done[i] = TuneOutcome(spec=spec, result=found, reused=True)
        todo = [(i, s) for i, s in enumerate(specs) if i not in done]
        recorder = open_recorder(settings, run.label)
        with recorder:  # an error on its way out stays the one shown
            if todo:
                artifacts = [a for _, s in todo for a in s.artifacts()]
                with progress(len(artifacts)) as shown:
                    client.build(artifacts, BuildOptions(fingerprint=fp, label=run.label),
                                 recorder=recorder, progress=shown, status=shown.status)
                recorder.referenced()  # the workers' tune records name this session
                with progress(len(todo), description="tuning", unit="keys") as shown:
                    got = tune_on_cluster(
                        client, [s for _, s in todo], fp, policy=run.policy,
                        retune=run.retune,
                        requested_by=RequestedBy(session=recorder.session.id, batch=0),
                        notify=lambda o: shown.advance(_what(o), o.spec.label()))
                done.update({i: o for (i, _), o in zip(todo, got, strict=True)})
    return fp, [done[i] for i in range(len(specs))]


def _say(line: str) -> None:
    err.print(line, markup=False, soft_wrap=True)


def _what(outcome: TuneOutcome) -> str:
    return "reused" if outcome.reused else "timed" if outcome.result is not None \
        else Fate.FAILED


def _troubles(outcomes: list[TuneOutcome]) -> bool:
    """A key without a result, or a candidate that computed wrong values or failed."""
    return any(o.result is None or any(f.status in ("wrong", Fate.FAILED)
                                       for f in o.result.candidates) for o in outcomes)


def _print(fp: str, label: str, outcomes: list[TuneOutcome], registry: Registry,
           wall_s: float) -> None:
    """One table per family (a row per key), the geometric-mean speedup, the troubles."""
    from farm.tuning.report import geomean, short_params, short_problem, speedups

    by_family: dict[str, list[TuneOutcome]] = defaultdict(list)
    for outcome in outcomes:
        by_family[outcome.spec.family].append(outcome)
    for family, rows in by_family.items():
        names = registry.get(family).tuning_params
        table = []
        for o in rows:
            r = o.result
            won = r.winner_figures if r is not None else None
            table.append([
                short_problem(o.spec),
                short_params(won.params, names) if won is not None else
                (Fate.FAILED if r is None else "no winner"),
                _ms(won.ms if won else None), _ms(r.first.ms if r else None),
                f"{r.speedup:.2f}x" if r is not None and r.speedup is not None else "-",
                f"{won.spread:.0%}" if won is not None and won.spread is not None else "-",
                _what(o)])
        print_table([Column("problem", wrap=True), Column("winner"),
                     Column("ms", "right"), Column("first ms", "right"),
                     Column("speedup", "right"), Column("spread", "right", optional=True),
                     Column("how", optional=True)], table,
                    title=f"farm tune {label} on {fp}: {family}, winner as "
                          f"{'/'.join(names)}")
    gains = speedups(outcomes)
    mean = geomean(gains)
    timed = sum(1 for o in outcomes if o.result is not None and not o.reused)
    reused = sum(1 for o in outcomes if o.reused)
    failed = sum(1 for o in outcomes if o.result is None)
    out.print(f"geometric-mean speedup over the first-listed candidates: "
              f"{'-' if mean is None else f'{mean:.2f}x'} over {len(gains)} key(s)"
              + (f", worst {min(gains):.2f}x, best {max(gains):.2f}x" if gains else ""),
              markup=False, highlight=False)
    out.print(f"{len(outcomes)} key(s): {timed} timed, {reused} reused, {failed} failed, "
              f"in {wall_s:.1f} s", markup=False, highlight=False)
    for o in outcomes:
        if o.result is None:
            err.print(f"{o.spec.family} {o.spec.label()}: {o.failure}", markup=False,
                      soft_wrap=True)
            continue
        if not o.result.isolated:
            err.print(f"{o.spec.family} {o.spec.label()}: measured without isolation "
                      "(the host stayed busy)", markup=False, soft_wrap=True)
        for f in o.result.candidates:
            if f.status in ("wrong", Fate.FAILED):
                err.print(f"{o.spec.family} {o.spec.label()}: candidate "
                          f"{short_params(f.params, registry.get(o.spec.family).tuning_params)}"
                          f" {f.status}: {f.note}", markup=False, soft_wrap=True)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 100 else f"{value:.1f}"
