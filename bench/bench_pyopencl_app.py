"""Real pyopencl applications on a fresh node: the farm against what a user has.

The workloads (``--apps``, default all three), each a fresh process per figure,
measured end to end (process start to exit, first launches included: on PoCL a
program's first launch generates its work-group functions) and in the application
(``main_s``: from its first line to its end, imports included):

* ``array``: ``bench/apps/pyopencl_array_app.py`` (pyopencl.array: elementwise
  arithmetic, clmath, reductions, scans, an ElementwiseKernel, Philox numbers; 28
  program builds);
* ``reikna``: ``bench/apps/reikna_app.py`` (2-D and 1-D FFTs, two matrix products);
* ``loopy``: ``bench/apps/loopy_app.py`` (four loopy kernels on the application's own
  context);

every result checked against numpy. Peers, side by side in every round, rounds back to
back:

* ``cold``: no cache anywhere (``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0
  CUDA_CACHE_DISABLE=1``): every node's first run today;
* ``second run``: the application run a second time on the node that ran it, with the
  defaults (PoCL's kernel cache, CUDA's compute cache, the generated-code caches of
  pyopencl and loopy, in folders of this node's own, filled by one untimed run first):
  what only the node that already paid gets today;
* ``farm, fresh node``: ``farm run -- python app`` on a node whose local caches are
  all empty (a new ``FARM_HOME``; the same defaults as the second run, in new empty
  folders: ``POCL_CACHE_DIR``, ``CUDA_CACHE_PATH``, ``XDG_CACHE_HOME``) and whose
  programs are in MinIO (put there once, untimed, by a ``farm run`` on another "node",
  with its drivers' caches off: that run also stores the work-group functions its
  launches made on PoCL, and the code pyopencl and loopy generated);

The store is signed, as a deployment that serves generated code has it: the filling
run has ``FARM_SIGNING_KEY``, every fresh node ``FARM_VERIFY_KEY`` (generated code is
Python the application runs: by default the farm serves it only from a store it
verifies; docs/SECURITY.md); ``--unsigned`` runs without keys (then no generated code
is served).

and with ``--more``: ``farm, same node`` (``farm run`` again on that node),
``farm, fresh node, caches off`` (the drivers' caches off) and ``farm, cold`` (an empty
store, the drivers' caches off: the farm's own compile of every program).

With ``--capture-row``, one more peer for ``array`` (:func:`capture_row`, issue 30 item 2):

* ``farm, node prepared from a capture``: as ``farm, fresh node``, but its programs and
  work-group functions come only from a capture: ``farm capture`` on a node whose store
  nothing else reads, then ``farm build CAPTURE`` on a build node into a bucket of its
  own (untimed, once; its wall is reported), the drivers' caches off for both.

Ratios per application: farm fresh node / second run (goal <= 1.1) and cold / farm
fresh node (goal >= 4), both for applications whose cold run takes more than twice their
second run. MinIO is started here (``farm.devservices.MinioServer``: ``FARM_MINIO_BIN``
or a ``go install``-ed binary); with ``--no-minio`` the programs are put in the fresh
node's store by a bundle import instead (for hosts without a MinIO binary), which the
output says. The farm's modules are byte-compiled first (a host that sets
``PYTHONDONTWRITEBYTECODE`` would otherwise compile them from source in every process).

    .venv/bin/python bench/bench_pyopencl_app.py [--rounds 3] [--device pocl] [--apps array,loopy]
    bench/nvidia_host.sh python3 bench/bench_pyopencl_app.py --device nvidia --rounds 3

Prints a table per application and one JSON line (``BENCH_PYOPENCL_APP {...}``).
"""

from __future__ import annotations

import argparse
import compileall
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cpu import cpu_model  # this folder

HERE = Path(__file__).resolve().parent
APPS = {"array": HERE / "apps" / "pyopencl_array_app.py",
        "reikna": HERE / "apps" / "reikna_app.py",
        "loopy": HERE / "apps" / "loopy_app.py"}
OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}
PEERS = ("cold", "second run", "farm, fresh node")
MORE = ("farm, same node", "farm, fresh node, caches off", "farm, cold")


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FARM_", "PYOPENCL_", "POCL_CACHE", "POCL_KERNEL", "CUDA_CACHE",
                                "XDG_CACHE"))}
    env.update(extra)
    return env


def node_caches(folder: Path) -> dict[str, str]:
    """The defaults, every cache of a node in folders of its own under ``folder``."""
    return {"POCL_CACHE_DIR": str(folder / "pocl"), "CUDA_CACHE_PATH": str(folder / "cuda"),
            "XDG_CACHE_HOME": str(folder / "xdg")}


def farm_cmd() -> list[str]:
    console = Path(sys.executable).with_name("farm")
    return [str(console)] if console.exists() else [sys.executable, "-m", "farm"]


def run_app(app: Path, env: dict[str, str], device: str, *, farm: Path | None = None
            ) -> dict[str, Any]:
    """One run of ``app`` in a fresh process; its wall, main_s and counts."""
    command = [sys.executable, str(app), device]
    if farm:
        command = [*farm_cmd(), "run", "--json", str(farm), "--", *command]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800,
                          check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    result = {"wall_s": round(wall, 3), "main_s": out["main_s"]}
    if farm is not None:
        result["counts"] = json.loads(farm.read_text())
        # what the farm said (a refusal, a fallback): the reason a fresh node compiled
        result["warnings"] = [line[:400] for line in proc.stderr.splitlines()
                              if line.startswith("kernel-farm: warning")][:10]
    return result


def machine(device: str) -> dict[str, str]:
    cpu = cpu_model()
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, pyopencl as cl\n"
         "for p in cl.get_platforms():\n"
         "    for d in p.get_devices():\n"
         "        name = f'{p.name} {p.vendor} {d.name}'.lower()\n"
         "        if not sys.argv[1] or sys.argv[1].lower() in name:\n"
         "            print(f'{d.name} on {p.name} {p.version}, driver {d.driver_version}')\n"
         "            raise SystemExit\n", device],
        capture_output=True, text=True, check=False)
    return {"cpus": str(os.cpu_count()), "cpu": cpu, "device": probe.stdout.strip(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def fill(work: Path, name: str, device: str, store_env: dict[str, str]) -> dict[str, Any]:
    """One farm run on another 'node': compiles every program into the shared store, with
    the drivers' caches off (pyopencl's and loopy's caches of generated code on, in a
    folder of its own: the farm stores what they hold)."""
    drivers = {k: v for k, v in OFF.items() if k != "PYOPENCL_NO_CACHE"}
    filler = work / f"filler-{name}"
    return run_app(APPS[name], base_env(**store_env, **drivers, FARM_HOME=str(filler),
                                        XDG_CACHE_HOME=str(filler / "xdg")),
                   device, farm=work / f"filler-{name}.json")


def one_round(work: Path, i: int, name: str, device: str, store_env: dict[str, str],
              seed: Path | None, more: bool) -> dict[str, dict[str, Any]]:
    """Every peer once, for one application, in a fresh process each."""
    app = APPS[name]
    tag = f"{name}-{i}"
    out: dict[str, dict[str, Any]] = {}
    out["cold"] = run_app(app, base_env(**OFF), device)
    if more:
        out["farm, cold"] = run_app(app, base_env(**OFF, FARM_HOME=str(work / f"cold-{tag}")),
                                    device, farm=work / f"cold-{tag}.json")
    default = base_env(**node_caches(work / f"driver-caches-{tag}"))
    run_app(app, default, device)  # the node's first run fills its caches
    out["second run"] = run_app(app, default, device)
    nodes = [("farm, fresh node", work / f"node-{tag}", {})]
    if more:
        nodes.append(("farm, fresh node, caches off", work / f"node-off-{tag}", OFF))
    for peer, node, drivers in nodes:
        if seed is not None:  # no MinIO here: the programs reach the node by a bundle
            subprocess.run([*farm_cmd(), "bundle", "import", str(seed)], check=True,
                           env=base_env(FARM_HOME=str(node)), capture_output=True)
        env = base_env(**store_env, **node_caches(node / "caches"), **drivers,
                       FARM_HOME=str(node))
        out[peer] = run_app(app, env, device, farm=work / f"{len(out)}-{tag}.json")
        if more and not drivers:
            out["farm, same node"] = run_app(app, env, device, farm=work / f"same-{tag}.json")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="", help="device name or platform substring")
    parser.add_argument("--apps", default=",".join(APPS),
                        help=f"comma-separated, of {', '.join(APPS)}")
    parser.add_argument("--more", action="store_true",
                        help="also farm same node, fresh node with caches off, farm cold")
    parser.add_argument("--no-minio", action="store_true",
                        help="no MinIO binary here: seed each fresh node by a bundle")
    parser.add_argument("--unsigned", action="store_true",
                        help="no signing keys (then no generated code is served)")
    parser.add_argument("--capture-row", action="store_true",
                        help="add, for array, a node prepared only from a capture (farm "
                             "capture, then farm build CAPTURE)")
    args = parser.parse_args()
    names = [n for n in args.apps.split(",") if n]
    unknown = [n for n in names if n not in APPS]
    if unknown:
        raise SystemExit(f"--apps: no application named {unknown[0]!r} ({', '.join(APPS)})")
    import farm

    compileall.compile_dir(Path(farm.__file__).parent, quiet=1)  # see the docstring
    work = Path(tempfile.mkdtemp(prefix="bench-pyopencl-app-"))
    info = machine(args.device)
    signer: dict[str, str] = {}
    verifier: dict[str, str] = {}
    if not args.unsigned:
        from farm.store.signing import generate_keypair

        private, public = generate_keypair()
        signer, verifier = {"FARM_SIGNING_KEY": private}, {"FARM_VERIFY_KEY": public}
    filled: dict[str, dict[str, Any]] = {}
    rounds: list[dict[str, dict[str, dict[str, Any]]]] = []
    prepared: dict[str, Any] | None = None
    if args.capture_row and "array" not in names:
        raise SystemExit("--capture-row: runs with the array application (--apps array)")
    try:
        if args.no_minio:
            seeds = {}
            for name in names:
                filled[name] = fill(work, name, args.device, signer)
                seeds[name] = work / f"programs-{name}.tar"
                subprocess.run([*farm_cmd(), "bundle", "export", str(seeds[name]), "--all"],
                               check=True, capture_output=True,
                               env=base_env(FARM_HOME=str(work / f"filler-{name}")))
            if args.capture_row:
                prepared = capture_prepare(work, args.device, signer)
            rounds = [{n: one_round(work, i, n, args.device, verifier, seeds[n], args.more)
                       for n in names} for i in range(args.rounds)]
            capture_rows(rounds, work, args.device, prepared, verifier)
        else:
            from farm.devservices import MinioServer

            with MinioServer(workdir=work / "minio") as minio:
                store_env = {"FARM_MINIO_ENDPOINT": minio.endpoint,
                             "FARM_MINIO_ACCESS_KEY": minio.access_key,
                             "FARM_MINIO_SECRET_KEY": minio.secret_key,
                             "FARM_MINIO_BUCKET": "bench-pyopencl-app"}
                for name in names:
                    filled[name] = fill(work, name, args.device, {**store_env, **signer})
                if args.capture_row:
                    prepared = capture_prepare(work, args.device, {
                        **store_env, **signer, "FARM_MINIO_BUCKET": "bench-capture"})
                rounds = [{n: one_round(work, i, n, args.device, {**store_env, **verifier},
                                        None, args.more)
                           for n in names} for i in range(args.rounds)]
                capture_rows(rounds, work, args.device, prepared,
                             {**store_env, **verifier, "FARM_MINIO_BUCKET": "bench-capture"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(info, args, names, filled, rounds)
    if prepared is not None:
        report_capture([r["array"] for r in rounds], prepared)


def report(info: dict[str, str], args: argparse.Namespace, names: list[str],
           filled: dict[str, dict[str, Any]],
           rounds: list[dict[str, dict[str, dict[str, Any]]]]) -> None:
    peers = PEERS + (MORE if args.more else ())
    print(f"{info['device']} | {info['cpus']} CPUs, {info['cpu']} | {info['date']}")
    print(f"store: {'bundle import (no MinIO)' if args.no_minio else 'MinIO'}, "
          f"{'unsigned' if args.unsigned else 'signed (fresh nodes verify)'}; drivers' "
          "caches off in 'cold' (and 'farm, cold', '..., caches off'), the defaults in "
          "folders of each node's own elsewhere (empty on a fresh node); first launches "
          f"included; medians of {len(rounds)} round(s), back to back")
    apps: dict[str, Any] = {}
    for name in names:
        runs = [r[name] for r in rounds]
        med = {p: {k: statistics.median(r[p][k] for r in runs) for k in ("wall_s", "main_s")}
               for p in peers}
        fresh, second, cold = (med[p]["wall_s"] for p in PEERS[::-1])
        applies = cold > 2 * second
        ratios = {"fresh_over_second": round(fresh / second, 3),
                  "cold_over_fresh": round(cold / fresh, 3), "goal_applies": applies}
        counts = [r["farm, fresh node"]["counts"] for r in runs]
        print(f"\n{name} ({filled[name]['counts']['programs']} program builds)")
        print(f"{'peer':<30} {'wall':>8} {'in app':>8}   rounds (wall)")
        for p in peers:
            walls = ", ".join(f"{r[p]['wall_s']:.2f}" for r in runs)
            print(f"{p:<30} {med[p]['wall_s']:>7.2f}s {med[p]['main_s']:>7.2f}s   {walls}")
        per_round = ", ".join(f"{r['farm, fresh node']['wall_s'] / r['second run']['wall_s']:.2f}"
                              for r in runs)
        print(f"farm fresh node / second run: {ratios['fresh_over_second']:.2f} (goal <= 1.1; "
              f"per round {per_round}); cold / farm fresh node: "
              f"{ratios['cold_over_fresh']:.2f} (goal >= 4)"
              + ("" if applies else "; goals do not apply: cold is not twice the second run"))
        print(f"filling run: {filled[name]['counts']}; fresh-node runs: {counts}")
        apps[name] = {"median": med, **ratios, "filled": filled[name]["counts"],
                      "fresh_counts": counts, "raw": runs}
    print("BENCH_PYOPENCL_APP " + json.dumps({
        **info, "rounds": len(rounds), "store": "bundle" if args.no_minio else "minio",
        "signed": not args.unsigned,
        "apps": apps}))


# -- the node prepared from a capture (--capture-row) ---------------------------------------
CAPTURED = "farm, node prepared from a capture"


def capture_prepare(work: Path, device: str, store_env: dict[str, str]) -> dict[str, Any]:
    """Once, before the rounds: ``farm capture`` on a node of its own (a local store that
    no other node reads), then ``farm build CAPTURE`` (this machine's compile pool) on a
    build node whose store is ``store_env``'s (a bucket of its own; without MinIO, its
    local tier, exported as a bundle for each prepared node); drivers' caches off."""
    capture = work / "app.capture.json"
    env = base_env(**OFF, FARM_HOME=str(work / "capturer"),
                   POCL_CACHE_DIR=str(work / "capturer" / "pocl"))
    proc = subprocess.run([*farm_cmd(), "capture", str(capture), "--", sys.executable,
                           str(APPS["array"]), device], env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"farm capture failed:\n{proc.stderr[-4000:]}")
    env = base_env(**OFF, **store_env, FARM_HOME=str(work / "builder"))
    start = time.perf_counter()
    proc = subprocess.run([*farm_cmd(), "build", str(capture), "--json"], env=env,
                          capture_output=True, text=True, check=False)
    build_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"farm build CAPTURE failed:\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout)["builds"]
    seed = None
    if "FARM_MINIO_ENDPOINT" not in store_env:
        seed = work / "capture-programs.tar"
        subprocess.run([*farm_cmd(), "bundle", "export", str(seed), "--all"], check=True,
                       env=env, capture_output=True)
    return {"store_env": store_env, "seed": seed, "build_s": round(build_s, 3),
            "builds": [{k: b.get(k) for k in ("fingerprint", "summary",
                                                "work_group_functions")} for b in out]}


def capture_rows(rounds: list[dict[str, dict[str, dict[str, Any]]]], work: Path,
                 device: str, prepared: dict[str, Any] | None, node_env: dict[str, str]
                 ) -> None:
    """Add to each round's ``array`` peers a run on a fresh node prepared from the
    capture: a new ``FARM_HOME``, the defaults in new empty folders, the build node's
    store (``node_env``: its MinIO bucket, the verifying key; without MinIO, a bundle of
    it imported). After the rounds, so the other peers' rounds stay back to back."""
    if prepared is None:
        return
    for i, peers in enumerate(rounds):
        node = work / f"node-captured-{i}"
        env = dict(node_env)
        if prepared["seed"] is not None:
            subprocess.run([*farm_cmd(), "bundle", "import", str(prepared["seed"])],
                           check=True, env=base_env(FARM_HOME=str(node)), capture_output=True)
            env = {k: v for k, v in env.items() if not k.startswith("FARM_MINIO_")}
        env = base_env(**env, **node_caches(node / "caches"), FARM_HOME=str(node))
        peers["array"][CAPTURED] = run_app(APPS["array"], env, device,
                                           farm=work / f"captured-{i}.json")


def report_capture(rounds: list[dict[str, dict[str, Any]]], prepared: dict[str, Any]
                   ) -> None:
    walls = [r[CAPTURED]["wall_s"] for r in rounds]
    p, s, c = (statistics.median(r[k]["wall_s"] for r in rounds)
               for k in (CAPTURED, "second run", "cold"))
    in_app = statistics.median(r[CAPTURED]["main_s"] for r in rounds)
    counts = [r[CAPTURED]["counts"] for r in rounds]
    for r in rounds:
        for line in r[CAPTURED].get("warnings", []):
            print(f"  {CAPTURED}: {line}")
    print(f"{CAPTURED:<30} {p:>7.2f}s {in_app:>7.2f}s   "
          f"{', '.join(f'{w:.2f}' for w in walls)}")
    print(f"capture-prepared node / second run: {p / s:.2f} (goal <= 1.1); cold / "
          f"capture-prepared node: {c / p:.2f} (goal >= 4); farm build CAPTURE "
          f"{prepared['build_s']:.2f} s: {prepared['builds']}; runs: {counts}")
    print("BENCH_PYOPENCL_APP_CAPTURE " + json.dumps({
        "median_wall_s": p, "median_main_s": in_app, "prepared_over_second": round(p / s, 3),
        "cold_over_prepared": round(c / p, 3),
        "prepare": {k: prepared[k] for k in ("build_s", "builds")},
        "counts": counts, "walls": walls}))


if __name__ == "__main__":
    main()
