"""What proving stored binaries costs a node (issue 29; docs/SECURITY.md).

Every stored binary is proven on a node before its first use there, in a child process
with a private driver cache, and the verdict is kept in the node's book
(``FARM_HOME/proofs``): a fresh node pays the child, a later run a ``stat``. Two
workloads, each a fresh process per run, side by side in every round, the stored
binaries in MinIO (put there once, untimed, by another "node"):

* **programs**: the pyopencl.array application of ``bench/bench_pyopencl_app.py`` under
  ``farm run`` (its programs and their work-group function records);
* **families**: ``farm warm MANIFEST --no-launch`` (the loader, every kernel of the
  manifest).

Peers for each: ``fresh node`` (a new ``FARM_HOME``, empty driver caches in folders of
its own: its proofs are made, for the programs by the prover ahead while the application
starts (farm/programs/ahead.py), for the families in a child), ``fresh node, book
known`` (the same, but its ``proofs`` folder is a copy of a node that proved the same
binaries, nothing else: the
difference between the two is what proving adds), and ``same node`` (the fresh node
again: its book, its local tier and its driver caches). Drivers' caches are the
defaults (on), as a user has them.

    .venv/bin/python bench/bench_proofs.py [--rounds 3] [--device pocl] [--manifest tiny]
    bench/nvidia_host.sh python3 bench/bench_proofs.py --device nvidia --rounds 2

Prints a table and one JSON line (``BENCH_PROOFS {...}``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_pyopencl_app import APPS, base_env, farm_cmd, fill, machine, node_caches, run_app

PEERS = ("fresh node", "fresh node, book known", "same node")


def warm(env: dict[str, str], manifest: str, device: str) -> dict[str, Any]:
    """One ``farm warm`` in a fresh process on ``device``: its wall and its summary."""
    command = [*farm_cmd(), "warm", manifest, "--json", "--no-launch",
               *(["--device", device] if device else [])]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800,
                          check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout)["summary"]
    return {"wall_s": round(wall, 3), "warm_s": summary["wall_s"],
            "counts": {k: summary[k] for k in ("kernels", "remote", "local", "compiled",
                                               "failed")}}


def one_round(work: Path, i: int, args: argparse.Namespace, store_env: dict[str, str],
              known: dict[str, Path]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each workload's peers once, in a fresh process each."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in ("programs", "families"):
        runs: dict[str, dict[str, Any]] = {}
        for peer, name in (("fresh node", "fresh"), ("fresh node, book known", "known")):
            node = work / f"{workload}-{name}-{i}"
            if peer == "fresh node, book known":
                shutil.copytree(known[workload], node / "proofs")
            env = base_env(**store_env, **node_caches(node / "caches"), FARM_HOME=str(node))
            runs[peer] = _run(workload, env, args, work / f"{workload}-{i}.json")
            if peer == "fresh node":
                runs["same node"] = _run(workload, env, args, work / f"{workload}-{i}.json")
        out[workload] = runs
    return out


def _run(workload: str, env: dict[str, str], args: argparse.Namespace,
         counts: Path) -> dict[str, Any]:
    if workload == "programs":
        return run_app(APPS["array"], env, args.device, farm=counts)
    return warm(env, args.manifest, args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="", help="device name or platform substring")
    parser.add_argument("--manifest", default="tiny", help="the families' workload")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-proofs-"))
    info = machine(args.device)
    from farm.devservices import MinioServer

    try:
        with MinioServer(workdir=work / "minio") as minio:
            store_env = {"FARM_MINIO_ENDPOINT": minio.endpoint,
                         "FARM_MINIO_ACCESS_KEY": minio.access_key,
                         "FARM_MINIO_SECRET_KEY": minio.secret_key,
                         "FARM_MINIO_BUCKET": "bench-proofs"}
            fill(work, "array", args.device, store_env)
            subprocess.run([*farm_cmd(), "build", args.manifest, "--local",
                            *(["--device", args.device] if args.device else [])],
                           check=True, capture_output=True, env=base_env(
                               **store_env, FARM_HOME=str(work / "filler")))
            known = {}
            for workload in ("programs", "families"):  # a node that proved them all
                node = work / f"prover-{workload}"
                _run(workload, base_env(**store_env, **node_caches(node / "caches"),
                                        FARM_HOME=str(node)), args, work / "prover.json")
                known[workload] = node / "proofs"
            rounds = [one_round(work, i, args, store_env, known)
                      for i in range(args.rounds)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(info, args, rounds)


def report(info: dict[str, str], args: argparse.Namespace,
           rounds: list[dict[str, dict[str, dict[str, Any]]]]) -> None:
    print(f"{info['device']} | {info['cpus']} CPUs, {info['cpu']} | {info['date']}")
    print(f"store: MinIO; drivers' caches the defaults, in folders of each node's own; "
          f"families: farm warm {args.manifest} --no-launch; medians of {len(rounds)} "
          "round(s)")
    summary: dict[str, Any] = {}
    for workload in ("programs", "families"):
        med = {p: statistics.median(r[workload][p]["wall_s"] for r in rounds) for p in PEERS}
        print(f"{workload}:")
        for p in PEERS:
            walls = ", ".join(f"{r[workload][p]['wall_s']:.2f}" for r in rounds)
            print(f"  {p:<26} {med[p]:>7.2f}s   {walls}")
        added = med["fresh node"] - med["fresh node, book known"]
        print(f"  proving adds {added:+.2f} s on a fresh node "
              f"({added / med['fresh node, book known']:+.0%}); counts "
              f"{rounds[-1][workload]['fresh node'].get('counts')}")
        summary[workload] = {"median_s": med, "proving_adds_s": round(added, 3)}
    print("BENCH_PROOFS " + json.dumps({**info, "rounds": len(rounds), "manifest":
                                        args.manifest, **summary, "raw": rounds}))


if __name__ == "__main__":
    main()
