"""A real pyopencl.array application on a fresh node: the farm against what a user has.

The workload is ``bench/apps/pyopencl_array_app.py`` (29 ``Program.build`` calls, 27
distinct sources, every result checked against numpy), each run a fresh process,
measured end to end (process start to exit, first launches included: on PoCL a
program's first launch generates its work-group functions) and in the application
(``main_s``: from its first line to its end, imports included). Peers, side by side in
every round:

* ``cold``: no cache anywhere (``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0
  CUDA_CACHE_DISABLE=1``): every node's first run today;
* ``second run``: the application run a second time on the node that ran it, with the
  defaults (PoCL's kernel cache, CUDA's compute cache and pyopencl's own small caches
  of generated code on, in folders of this node's own, filled by one untimed run
  first): what only the node that already paid gets today (pyopencl keeps no binary
  cache of its own on PoCL or NVIDIA);
* ``farm, fresh node``: ``farm run -- python app`` on a node whose local caches are
  all empty (a new ``FARM_HOME``; the same defaults as the second run, in new empty
  folders: ``POCL_CACHE_DIR``, ``CUDA_CACHE_PATH``, ``XDG_CACHE_HOME``) and whose
  programs are in MinIO (put there once, untimed, by a ``farm run`` on another "node",
  with its drivers' caches off: that run also stores the work-group functions its
  launches made on PoCL);
* ``farm, same node``: ``farm run`` again on that node (its local tier holds the
  programs, and its drivers' caches what the first run left);
* ``farm, fresh node, caches off``: as ``farm, fresh node`` with the drivers' caches
  off (``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``);
* ``farm, cold``: ``farm run`` with an empty store and the drivers' caches off: the
  farm's own compile of every program, against ``cold`` (its goal: no dearer).

With ``--capture-row``, one more peer (:func:`capture_row`, issue 30 item 2):

* ``farm, node prepared from a capture``: as ``farm, fresh node``, but its programs and
  work-group functions come only from a capture: ``farm capture`` on a node whose store
  nothing else reads, then ``farm build CAPTURE`` on a build node into a bucket of its
  own (untimed, once; its wall is reported), the drivers' caches off for both.

Ratios: farm fresh node / second run (goal <= 1.1) and cold / farm fresh node (goal
>= 4), and the same for the capture-prepared node. MinIO is started here
(``farm.devservices.MinioServer``: ``FARM_MINIO_BIN`` or a ``go install``-ed binary);
with ``--no-minio`` the programs are put in the fresh node's store by a bundle import
instead (for hosts without a MinIO binary), which the output says.

    .venv/bin/python bench/bench_pyopencl_app.py [--rounds 3] [--device pocl] [--capture-row]
    bench/nvidia_host.sh python3 bench/bench_pyopencl_app.py --device nvidia --rounds 4

Prints a table and one JSON line (``BENCH_PYOPENCL_APP {...}``).
"""

from __future__ import annotations

import argparse
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
APP = HERE / "apps" / "pyopencl_array_app.py"
OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}
PEERS = ("cold", "second run", "farm, fresh node", "farm, same node",
         "farm, fresh node, caches off", "farm, cold")


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


def run_app(env: dict[str, str], device: str, *, farm: Path | None = None) -> dict[str, Any]:
    """One run of the application in a fresh process; its wall, main_s and counts."""
    app = [sys.executable, str(APP), device]
    command = [*farm_cmd(), "run", "--json", str(farm), "--", *app] if farm else app
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


def fill(work: Path, device: str, store_env: dict[str, str]) -> dict[str, Any]:
    """One farm run on another 'node': compiles every program into the shared store."""
    return run_app(base_env(**store_env, **OFF, FARM_HOME=str(work / "filler")), device,
                   farm=work / "filler.json")


def one_round(work: Path, i: int, device: str, store_env: dict[str, str],
              seed: Path | None) -> dict[str, dict[str, Any]]:
    """Every peer once, in a fresh process each."""
    out: dict[str, dict[str, Any]] = {}
    out["cold"] = run_app(base_env(**OFF), device)
    out["farm, cold"] = run_app(base_env(**OFF, FARM_HOME=str(work / f"node-cold-{i}")),
                                device, farm=work / f"cold-{i}.json")
    default = base_env(**node_caches(work / f"driver-caches-{i}"))
    run_app(default, device)  # the node's first run fills its caches
    out["second run"] = run_app(default, device)
    for name, node, drivers in (("farm, fresh node", work / f"node-{i}", {}),
                                ("farm, fresh node, caches off", work / f"node-off-{i}", OFF)):
        if seed is not None:  # no MinIO here: the programs reach the node by a bundle
            subprocess.run([*farm_cmd(), "bundle", "import", str(seed)], check=True,
                           env=base_env(FARM_HOME=str(node)), capture_output=True)
        env = base_env(**store_env, **node_caches(node / "caches"), **drivers,
                       FARM_HOME=str(node))
        out[name] = run_app(env, device, farm=work / f"{len(out)}-{i}.json")
        if not drivers:
            out["farm, same node"] = run_app(env, device, farm=work / f"same-{i}.json")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="", help="device name or platform substring")
    parser.add_argument("--no-minio", action="store_true",
                        help="no MinIO binary here: seed each fresh node by a bundle")
    parser.add_argument("--capture-row", action="store_true",
                        help="add a node prepared only from a capture (farm capture, then "
                             "farm build CAPTURE)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pyopencl-app-"))
    info = machine(args.device)
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        if args.no_minio:
            filled = fill(work, args.device, {})
            seed: Path | None = work / "programs.tar"
            subprocess.run([*farm_cmd(), "bundle", "export", str(seed), "--all"], check=True,
                           env=base_env(FARM_HOME=str(work / "filler")), capture_output=True)
            prepared = capture_prepare(work, args.device, {}) if args.capture_row else None
            rounds = [capture_row(one_round(work, i, args.device, {}, seed), work, i,
                                  args.device, prepared) for i in range(args.rounds)]
        else:
            from farm.devservices import MinioServer

            with MinioServer(workdir=work / "minio") as minio:
                store_env = {"FARM_MINIO_ENDPOINT": minio.endpoint,
                             "FARM_MINIO_ACCESS_KEY": minio.access_key,
                             "FARM_MINIO_SECRET_KEY": minio.secret_key,
                             "FARM_MINIO_BUCKET": "bench-pyopencl-app"}
                filled = fill(work, args.device, store_env)
                prepared = capture_prepare(work, args.device, {
                    **store_env, "FARM_MINIO_BUCKET": "bench-capture"}) if args.capture_row \
                    else None
                rounds = [capture_row(one_round(work, i, args.device, store_env, None), work,
                                      i, args.device, prepared) for i in range(args.rounds)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(info, args, filled, rounds)
    if prepared is not None:
        report_capture(rounds, prepared)


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
                           str(APP), device], env=env, capture_output=True, text=True,
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
    if not store_env:
        seed = work / "capture-programs.tar"
        subprocess.run([*farm_cmd(), "bundle", "export", str(seed), "--all"], check=True,
                       env=env, capture_output=True)
    return {"store_env": store_env, "seed": seed, "build_s": round(build_s, 3),
            "builds": [{k: b.get(k) for k in ("fingerprint", "summary",
                                                "work_group_functions")} for b in out]}


def capture_row(peers: dict[str, dict[str, Any]], work: Path, i: int, device: str,
                prepared: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``peers`` (one round) with a run on a fresh node prepared from the capture: a new
    ``FARM_HOME``, the defaults in new empty folders, the build node's store."""
    if prepared is None:
        return peers
    node = work / f"node-captured-{i}"
    if prepared["seed"] is not None:
        subprocess.run([*farm_cmd(), "bundle", "import", str(prepared["seed"])], check=True,
                       env=base_env(FARM_HOME=str(node)), capture_output=True)
    env = base_env(**prepared["store_env"], **node_caches(node / "caches"),
                   FARM_HOME=str(node))
    return {**peers, CAPTURED: run_app(env, device, farm=work / f"captured-{i}.json")}


def report_capture(rounds: list[dict[str, dict[str, Any]]], prepared: dict[str, Any]
                   ) -> None:
    walls = [r[CAPTURED]["wall_s"] for r in rounds]
    p, s, c = (statistics.median(r[k]["wall_s"] for r in rounds)
               for k in (CAPTURED, "second run", "cold"))
    in_app = statistics.median(r[CAPTURED]["main_s"] for r in rounds)
    counts = [r[CAPTURED]["counts"] for r in rounds]
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


def report(info: dict[str, str], args: argparse.Namespace, filled: dict[str, Any],
           rounds: list[dict[str, dict[str, Any]]]) -> None:
    med = {p: {k: statistics.median(r[p][k] for r in rounds) for k in ("wall_s", "main_s")}
           for p in PEERS}
    fresh = [r["farm, fresh node"]["counts"] for r in rounds]
    print(f"{info['device']} | {info['cpus']} CPUs, {info['cpu']} | {info['date']}")
    print(f"store: {'bundle import (no MinIO)' if args.no_minio else 'MinIO'}; drivers' "
          "caches off in 'cold', 'farm, cold' and '..., caches off', the defaults in "
          "folders of each node's own elsewhere (empty on a fresh node); first launches "
          f"included; medians of {len(rounds)} round(s)")
    print(f"{'peer':<30} {'wall':>8} {'in app':>8}   rounds (wall)")
    for p in PEERS:
        walls = ", ".join(f"{r[p]['wall_s']:.2f}" for r in rounds)
        print(f"{p:<30} {med[p]['wall_s']:>7.2f}s {med[p]['main_s']:>7.2f}s   {walls}")
    f, s, c = (med[p]["wall_s"] for p in ("farm, fresh node", "second run", "cold"))
    fc = med["farm, cold"]["wall_s"]
    print(f"farm fresh node / second run: {f / s:.2f} (goal <= 1.1); cold / farm fresh "
          f"node: {c / f:.2f} (goal >= 4); farm cold / cold: {fc / c:.2f} (goal <= 1)")
    print(f"filling run: {filled['counts']}; fresh-node runs: {fresh}")
    print("BENCH_PYOPENCL_APP " + json.dumps({
        **info, "rounds": len(rounds), "store": "bundle" if args.no_minio else "minio",
        "median": med, "fresh_over_second": round(f / s, 3), "cold_over_fresh": round(c / f, 3),
        "farm_cold_over_cold": round(fc / c, 3),
        "filled": filled["counts"], "fresh_counts": fresh, "raw": rounds}))


if __name__ == "__main__":
    main()
