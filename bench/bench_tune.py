"""Benchmark: tuning a manifest's keys on the local device, what it gains, how stable and
how right its winners are, how fast a fresh process gets them, and what concurrent
compiles do to a measurement.

Parts (``--parts``, comma-separated; all by default), on one manifest (``--manifest``,
its model's token buckets and element types optionally narrowed by ``--tokens`` and
``--dtypes``), in a fresh FARM_HOME, with the policy ``farm tune`` uses:

* ``tune``: build every candidate (``KernelLoader.warm``, ``--workers`` processes), then
  tune every key (:class:`farm.tuning.runner.Tuner`, as ``farm tune`` does): build wall,
  tuning wall, keys per second; each winner's speedup over the first-listed candidate
  (geometric mean, and the worst key: where the first-listed loses most);
* ``stability`` (with ``tune``): tune every key again (``--retune``): the same winner,
  or winners whose medians differ by less than their measured spreads in either run,
  for >= 95% of keys;
* ``exhaustive`` (with ``tune``): every key measured again with three times the
  launches and kernel time and no candidate dropped early: the farm's winner is the
  exhaustive winner, or within 3% of its time there, for >= 95% of keys;
* ``lookup``: a fresh process gets every winner: the problems' latest results read from
  the store (``spec_for`` + ``read_latest``, what ``KernelLoader.tuned`` does before it
  loads the kernel; no device, no launch), and, for the tuned manifest, ``tuned()`` with
  the kernels loaded. ``--lookup-manifest`` (e.g. ``large``) is looked up the same way
  from a store filled with *placeholder* results for all its keys (the read path does not
  depend on the figures; this times it for a manifest too large to tune here);
* ``interference``: ``--noise-keys`` keys measured three ways, taking turns in a
  rotating order ``--noise-rounds`` times: on a quiet host; with ``--compilers`` processes compiling
  without pause and the measurement not isolated (another isolation folder); and with
  the same compilers and the measurement isolated (they pause). Per way: winners that
  differ from the quiet rounds' winner, each candidate's median against its median over
  the quiet rounds (median and 90th percentile of the ratios), spreads, and the
  compiles the compilers got done.

Caches off (``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``), here and
in every process started. Prints lines for people, then one JSON line per manifest
(``{"bench": "tune", ...}``).

    .venv/bin/python bench/bench_tune.py --manifest medium --tokens 1,4,16 --workers 2
    bench/nvidia_host.sh python3 bench/bench_tune.py --manifest medium --workers 16 \\
        --lookup-manifest large
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cpu import cpu_model  # this folder

CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}
os.environ.update(CACHES_OFF)
PARTS = ("tune", "stability", "exhaustive", "lookup", "interference")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def derived_manifest(name: str, tokens: str | None, dtypes: str | None, folder: Path) -> Path:
    """The manifest, its model's ``tokens`` / ``dtypes`` lines replaced where asked."""
    from farm.manifest import resolve_manifest

    text = resolve_manifest(name).read_text()
    if tokens:
        text = re.sub(r"(?m)^tokens = .*$", f"tokens = [{tokens}]", text, count=1)
    if dtypes:
        listed = ", ".join(f'"{d}"' for d in dtypes.split(","))
        text = re.sub(r"(?m)^dtypes = .*$", f"dtypes = [{listed}]", text, count=1)
    path = folder / f"{Path(name).stem}.toml"
    path.write_text(text)
    return path


def specs_of(manifest: Path) -> list[Any]:
    from farm.families import Registry
    from farm.manifest import expand, load_manifest
    from farm.tuning.keys import plan

    registry = Registry.load()
    return plan([e.artifact for e in expand(load_manifest(manifest), registry)], registry)


def close(a: Any, b: Any, i: int, j: int) -> bool:
    """Whether candidates ``i`` and ``j`` of result ``a`` (or of ``b``) are within the
    noise: their medians differ by less than their spreads added."""
    for r in (a, b):
        fi, fj = r.candidates[i], r.candidates[j]
        if fi.ms and fj.ms and abs(fi.ms - fj.ms) / min(fi.ms, fj.ms) <= \
                (fi.spread or 0) + (fj.spread or 0):
            return True
    return False


def tune_parts(manifest: Path, home: Path, parts: set[str], workers: int) -> dict[str, Any]:
    """Build, tune, retune, exhaustive, in this process, on the local device."""
    from farm.core.isolation import HostLock
    from farm.core.settings import Settings
    from farm.tuning.model import MeasurePolicy
    from farm.tuning.report import geomean
    from farm.tuning.runner import Tuner
    from loader import KernelLoader

    settings = Settings(home=home, workers=workers, redis_url=None, minio_endpoint=None,
                        records_url=None)
    specs = specs_of(manifest)
    row: dict[str, Any] = {"keys": len(specs),
                           "candidates": sum(len(s.candidates) for s in specs)}
    with KernelLoader(settings, label="bench tune") as loader:
        row["device"] = loader.device.fingerprint
        start = time.perf_counter()
        report = loader.warm([a for s in specs for a in s.artifacts()])
        row["build_s"] = round(time.perf_counter() - start, 2)
        row["unsupported"] = sum(1 for i in report.items if i.failure is not None
                                 and i.failure.kind == "unsupported")
        tuner = Tuner(registry=loader.registry, device=loader.device, ctx=loader.context,
                      cl_device=loader.cl_device, store=loader.store,
                      program_of=loader.program_for, recorder=loader.recorder,
                      lock=HostLock(settings.isolation_dir), policy=MeasurePolicy())
        start = time.perf_counter()
        first = [tuner.tune(s).result for s in specs]
        row["tune_s"] = round(time.perf_counter() - start, 2)
        row["keys_per_s"] = round(len(specs) / row["tune_s"], 3)
        done = [r for r in first if r is not None and r.winner is not None]
        gains = [r.speedup for r in done if r.speedup is not None]
        row["speedup_geomean"] = round(geomean(gains) or 0, 3)
        row["speedup_worst_key"] = round(max(gains, default=0), 3)
        row["speedup_least"] = round(min(gains, default=0), 3)
        row["isolated"] = all(r.isolated for r in done)
        say(f"  built {row['candidates']} candidates in {row['build_s']} s; tuned "
            f"{len(specs)} keys in {row['tune_s']} s ({row['keys_per_s']} keys/s); speedup "
            f"geomean {row['speedup_geomean']}x, worst key {row['speedup_worst_key']}x")
        if "stability" in parts:
            again = [tuner.tune(s, retune=True).result for s in specs]
            same = near = 0
            for a, b in zip(first, again, strict=True):
                if a is None or b is None or a.winner is None or b.winner is None:
                    continue
                same += a.winner == b.winner
                near += a.winner != b.winner and close(a, b, a.winner, b.winner)
            row["stable_same"], row["stable_within_noise"] = same, near
            row["stable_share"] = round((same + near) / max(1, len(done)), 3)
            say(f"  stability: {same} same winner, {near} within the noise, of "
                f"{len(done)} ({row['stable_share']:.0%})")
        if "exhaustive" in parts:
            tuner.policy = MeasurePolicy().exhaustive(3)
            agree = within = 0
            worst = 0.0
            apart: list[dict[str, Any]] = []
            for spec, mine in zip(specs, first, strict=True):
                if mine is None or mine.winner is None:
                    continue
                deep = tuner.measure(spec)
                if deep.winner is None:
                    continue
                mine_there = deep.candidates[mine.winner].ms
                best = deep.candidates[deep.winner].ms
                loss = (mine_there or 0) / (best or 1) - 1
                worst = max(worst, loss)
                agree += mine.winner == deep.winner
                within += mine.winner != deep.winner and loss <= 0.03
                if mine.winner != deep.winner:  # what each run saw of both candidates
                    apart.append({"key": spec.label(), "loss": round(loss, 4), **{
                        f"{run}_{who}": [round(f.ms or 0, 4), round(f.spread or 0, 3),
                                         f.launches]
                        for run, r in (("farm", mine), ("exhaustive", deep))
                        for who, f in (("farm_winner", r.candidates[mine.winner]),
                                       ("exhaustive_winner", r.candidates[deep.winner]))}})
            row["exhaustive_apart"] = apart
            row["exhaustive_same"], row["exhaustive_within_3pct"] = agree, within
            row["exhaustive_share"] = round((agree + within) / max(1, len(done)), 3)
            row["exhaustive_worst_loss"] = round(worst, 4)
            say(f"  exhaustive (3x): {agree} same, {within} within 3%, of {len(done)} "
                f"({row['exhaustive_share']:.0%}); worst loss {worst:.1%}")
    return row


LOOKUP = r"""
import json, sys, time
t0 = time.perf_counter()
from farm.core.keys import Namespace
from farm.core.model import LaunchSettings, Variant
from farm.core.settings import Settings
from farm.families import Registry
from farm.store.sqlite import SQLiteStore
from farm.tuning import store as results
from farm.tuning.keys import spec_for
home, fingerprint, problems, kernels = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
items = json.loads(open(problems).read())
t1 = time.perf_counter()
registry = Registry.load()
settings = Settings(home=home, redis_url=None, minio_endpoint=None, records_url=None)
store = SQLiteStore(settings.store_path)
ns = Namespace.for_fingerprint(fingerprint)
t2 = time.perf_counter()
found = 0
for it in items:
    spec = spec_for(registry, it["family"], it["problem"], launch=LaunchSettings(**it["launch"]),
                    variant=Variant(**it["variant"]), first_only=True)
    got = results.read_latest(store, ns, spec)
    found += got is not None and got.winner is not None
t3 = time.perf_counter()
row = {"imports_s": t1 - t0, "open_s": t2 - t1, "params_s": t3 - t2, "found": found,
       "keys": len(items), "timing_imported": "farm.tuning.measure" in sys.modules}
if kernels == "1":
    from loader import KernelLoader
    with KernelLoader(settings, on_miss="fail") as loader:
        t4 = time.perf_counter()
        for it in items:
            loader.tuned(it["family"], it["problem"], launch=LaunchSettings(**it["launch"]),
                         variant=Variant(**it["variant"]), on_miss="fail")
        row["loader_s"] = time.perf_counter() - t4
        row["loads"] = loader.stats.loads
    row["timing_imported"] = "farm.tuning.measure" in sys.modules
print(json.dumps(row))
"""


def lookup(home: Path, fingerprint: str, specs: list[Any], kernels: bool) -> dict[str, Any]:
    """A fresh process gets every winner of ``specs`` (see the module docstring)."""
    problems = home / "problems.json"
    problems.write_text(json.dumps([{"family": s.family, "problem": s.problem,
                                     "launch": s.launch.model_dump(mode="json"),
                                     "variant": s.variant.model_dump(mode="json")}
                                    for s in specs]))
    env = {**os.environ, **CACHES_OFF, "FARM_HOME": str(home)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", LOOKUP, str(home), fingerprint,
                           str(problems), "1" if kernels else "0"], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"lookup failed:\n{proc.stderr[-3000:]}")
    row = {k: round(v, 4) if isinstance(v, float) else v
           for k, v in json.loads(proc.stdout).items()}
    row["process_s"] = round(time.perf_counter() - start, 3)
    return row


def placeholder_store(home: Path, fingerprint: str, specs: list[Any]) -> None:
    """Results for every key of ``specs`` (placeholder figures, marked as such)."""
    from farm.core.keys import Namespace
    from farm.store.sqlite import SQLiteStore
    from farm.tuning import store as results
    from farm.tuning.model import Figures, MeasurePolicy, TuningResult, now

    store = SQLiteStore(home / "envs" / "default" / "store.sqlite")
    ns = Namespace.for_fingerprint(fingerprint)
    for spec in specs:
        figures = tuple(Figures(params=c, status="ok", ms=1.0 + i, spread=0.0, min_ms=1.0,
                                launches=1, note="placeholder for the lookup benchmark")
                        for i, c in enumerate(spec.candidates))
        results.write(store, ns, TuningResult(
            spec=spec, fingerprint=fingerprint, candidates=figures, winner=0,
            policy=MeasurePolicy(), isolated=True, wall_s=0.0, measured_at=now(),
            host="placeholder"))
    store.close()


SPIN = r"""
import os, sys, time
from farm.compilation.finalize import finalize
from farm.core.device import open_device, probe_devices, select_device
from farm.families import Registry
mm = Registry.load().get("matmul")
info = select_device(probe_devices(), os.environ.get("FARM_DEVICE"))
ctx, dev = open_device(info)
stop, n, salt = sys.argv[1], 0, int(sys.argv[2])
print("ready", flush=True)
while not os.path.exists(stop):
    n += 1
    art = mm.artifact_id({"m": 64 + (salt * 100003 + n) % 4000, "n": 64, "k": 64})
    finalize(ctx, dev, mm.lower_id(art, info))
print(n, flush=True)
"""


#: the ways ``interference`` measures: compiling processes, and whose isolation folder
#: the measurement uses (the compilers' own: they pause; another: they do not)
WAYS = (("quiet", False, False), ("compiling, not isolated", True, False),
        ("compiling, isolated", True, True))


def interference(manifest: Path, home: Path, keys: int, compilers: int,
                 rounds: int) -> dict[str, Any]:
    """The same keys measured quiet, next to compiles unisolated, and isolated, the
    three ways taking turns ``rounds`` times; each candidate's median against its median
    over the quiet rounds, each winner against the quiet rounds' winner."""
    from farm.core.isolation import HostLock
    from farm.core.settings import Settings
    from farm.tuning.runner import Tuner
    from loader import KernelLoader

    specs = specs_of(manifest)[:keys]
    shared, apart = home / "iso-shared", home / "iso-apart"
    settings = Settings(home=home, workers=0, redis_url=None, minio_endpoint=None,
                        records_url=None)
    got: dict[str, list[list[Any]]] = {way: [] for way, _, _ in WAYS}
    walls: dict[str, float] = dict.fromkeys(got, 0.0)
    compiles: dict[str, int] = dict.fromkeys(got, 0)
    with KernelLoader(settings, label="bench interference") as loader:
        loader.warm([a for s in specs for a in s.artifacts()])
        tuner = Tuner(registry=loader.registry, device=loader.device, ctx=loader.context,
                      cl_device=loader.cl_device, store=loader.store,
                      program_of=loader.program_for)
        for turn in range(rounds):  # the order rotates: no way always comes first
            for way, busy, isolated in WAYS[turn % 3:] + WAYS[:turn % 3]:
                stop = home / f"stop-{turn}-{len(got[way])}-{busy}{isolated}"
                env = {**os.environ, **CACHES_OFF, "FARM_ISOLATION_DIR": str(shared)}
                procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(stop), str(i)],
                                          env=env, stdout=subprocess.PIPE, text=True)
                         for i in range(compilers if busy else 0)]
                for p in procs:
                    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
                tuner.lock = HostLock(shared if isolated else apart)
                start = time.perf_counter()
                got[way].append([tuner.measure(s) for s in specs])
                walls[way] += time.perf_counter() - start
                stop.write_text("")
                compiles[way] += sum(int(p.communicate(timeout=600)[0].strip() or 0)
                                     for p in procs)
    quiet = [[statistics.median(r[k].candidates[c].ms or 0.0 for r in got["quiet"])
              for c in range(len(spec.candidates))] for k, spec in enumerate(specs)]
    quiet_winner = [min(range(len(q)), key=lambda c, q=q: q[c] or float("inf"))
                    for q in quiet]
    ways: dict[str, Any] = {}
    for way, _, _ in WAYS:
        ratios = [f.ms / quiet[k][c] for run in got[way] for k, r in enumerate(run)
                  for c, f in enumerate(r.candidates) if f.ms and quiet[k][c]]
        ways[way] = {
            "wall_s": round(walls[way], 2), "compiles": compiles[way],
            "compiles_per_s": round(compiles[way] / walls[way], 2),
            "winners_changed": sum(r.winner != quiet_winner[k] for run in got[way]
                                   for k, r in enumerate(run)),
            "winners": rounds * len(specs),
            "median_ratio": round(statistics.median(ratios), 3),
            "p90_ratio": round(sorted(ratios)[int(0.9 * (len(ratios) - 1))], 3),
            "median_spread": round(statistics.median(
                f.spread for run in got[way] for r in run for f in r.candidates
                if f.spread is not None), 3)}
        say(f"  {way}: {ways[way]}")
    return {"keys": len(specs), "compilers": compilers, "rounds": rounds, "ways": ways}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", default="medium")
    parser.add_argument("--tokens", help="the model's token buckets instead, e.g. 1,4,16")
    parser.add_argument("--dtypes", help="the model's element types instead, e.g. float")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--lookup-manifest", help="also look up every key of this "
                        "manifest from placeholder results (e.g. large)")
    parser.add_argument("--noise-keys", type=int, default=6)
    parser.add_argument("--compilers", type=int, default=2)
    parser.add_argument("--noise-rounds", type=int, default=3)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    from farm.core.device import probe_devices, select_device

    device = select_device(probe_devices(), os.environ.get("FARM_DEVICE"))
    work = Path(tempfile.mkdtemp(prefix="bench-tune-"))
    manifest = derived_manifest(args.manifest, args.tokens, args.dtypes, work)
    row: dict[str, Any] = {"bench": "tune", "manifest": args.manifest,
                           "tokens": args.tokens, "dtypes": args.dtypes,
                           "device": device.fingerprint, "cpu": cpu_model(),
                           "cores": os.cpu_count(), "caches": "off",
                           "date": time.strftime("%Y-%m-%d", time.gmtime())}
    say(f"bench_tune: {args.manifest} (tokens {args.tokens or 'all'}, dtypes "
        f"{args.dtypes or 'all'}) on {device.fingerprint}, {cpu_model()}; caches off")
    home = work / "home"
    if "tune" in parts:  # stability, exhaustive and lookup start from its results
        row.update(tune_parts(manifest, home, parts, args.workers))
    if "lookup" in parts:
        if "tune" in parts:
            row["lookup"] = lookup(home, device.fingerprint, specs_of(manifest),
                                   kernels=True)
            say(f"  lookup ({row['keys']} keys): {row['lookup']}")
        if args.lookup_manifest:
            big = derived_manifest(args.lookup_manifest, None, None, work)
            big_specs = specs_of(big)
            placeholder_store(work / "big", device.fingerprint, big_specs)
            row["lookup_" + args.lookup_manifest] = lookup(
                work / "big", device.fingerprint, big_specs, kernels=False)
            say(f"  lookup of {args.lookup_manifest} ({len(big_specs)} keys, placeholder "
                f"results): {row['lookup_' + args.lookup_manifest]}")
    if "interference" in parts:
        row["interference"] = interference(manifest, work / "noise", args.noise_keys,
                                           args.compilers, args.noise_rounds)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
