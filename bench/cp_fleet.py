"""What ``bench/bench_control_plane.py`` measures with and runs on: the servers' counters
and processes' CPU over a phase (:class:`Phase`), the link to Redis and MinIO of one
RTT (:class:`Link`), and the code a point's workers and clients run (:class:`Code`:
this tree, or an export of another commit, ``--baseline``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
#: the MinIO server's pid (its CPU is read from /proc): set by the driver
minio_pid = 0


# -- counters --------------------------------------------------------------------------------
def redis_counters(url: str) -> dict[str, float]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
        cpu = client.info("cpu")
    finally:
        client.close()
    calls = {k: float(v["calls"]) for k, v in stats.items()}
    return {"commands": sum(calls.values()) - calls.get("cmdstat_info", 0.0),
            "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            **{k.removeprefix("cmdstat_"): v for k, v in calls.items()}}


#: MinIO's v3 metrics are read live (v2's are a snapshot cached for ten seconds)
_S3 = re.compile(r'^minio_api_requests_total\{[^}]*name="([^"]+)"[^}]*\}\s+([0-9.e+]+)', re.M)


def minio_counters(endpoint: str) -> dict[str, float]:
    with _DIRECT.open(f"http://{endpoint}/minio/metrics/v3/api/requests", timeout=10) as resp:
        text = resp.read().decode()
    apis: dict[str, float] = {}
    for api, value in _S3.findall(text):
        apis[api] = apis.get(api, 0.0) + float(value)
    return {"requests": sum(apis.values()), **apis}


def proc_cpu(pids: list[int], children_too: bool = True) -> float:
    """User + system seconds of ``pids`` and (``children_too``) their children now
    alive, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(stat.parent.name)
        stats[pid] = fields
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += (int(stats[pid][11]) + int(stats[pid][12])) / tick
        if children_too:
            todo += children.get(pid, [])
    return total


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


# -- the code a point runs ------------------------------------------------------------------------
@dataclass(frozen=True)
class Code:
    """Which farm the workers and clients of a point run: this tree (``root`` None) or
    an export of another commit."""

    label: str
    root: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


def this_code() -> Code:
    caller = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join(p for p in (str(BENCH), caller) if p)
    return Code("new", None, {"PYTHONPATH": path})


def baseline_code(ref: str, work: Path) -> Code:
    """``ref`` as a folder of its own: an export made here (``git archive``), or one
    already made (a folder with ``farm/`` and ``bench/``, e.g. carried to a host with no
    git history)."""
    given = Path(ref)
    if (given / "farm").is_dir() and (given / "bench").is_dir():
        root = given.resolve()
        label = f"baseline ({root.name})"
    else:
        root = work / ref.replace("/", "_")
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "farm", "worker",
                                  "loader", "bench"], capture_output=True, check=False)
        if archive.returncode != 0:
            sys.exit(f"--baseline {ref}: git archive failed: {archive.stderr.decode()[-300:]}")
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
        label = f"baseline ({root.name})"
    caller = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join(p for p in (str(root), str(root / "bench"), caller) if p)
    # PYTHONSAFEPATH: `python -m farm` and `python script.py` do not put the current
    # folder (this tree) or the script's folder before the export
    return Code(label, root, {"PYTHONPATH": path, "PYTHONSAFEPATH": "1"})


def code_fingerprint(code: Code, env: dict[str, str]) -> str:
    """The simulated device's fingerprint as ``code`` computes it, checking on the way
    that its processes import that code."""
    probe = ("import farm, simfleet; print(farm.__file__); print(simfleet.__file__); "
             "print(simfleet.device_info().fingerprint)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=False, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        sys.exit(f"{code.label}: cannot import its farm: {out.stderr[-500:]}")
    farm_file, sim_file, fp = out.stdout.split()
    if code.root is not None:
        for name in (farm_file, sim_file):
            if not Path(name).resolve().is_relative_to(code.root):
                sys.exit(f"{code.label}: its processes import {name}, not its own code")
    return fp


@dataclass
class Link:
    """Where the fleet of one RTT reaches Redis and MinIO (through the proxies or not)."""

    redis: Any
    minio: Any
    redis_addr: str
    minio_addr: str
    rtt_ms: float


class Phase:
    """The servers' counters and a set of processes' CPU over one throughput phase."""

    def __init__(self, link: Link, pids: list[int]) -> None:
        self.link, self.pids = link, pids
        self.r0 = redis_counters(link.redis.url)
        self.m0 = minio_counters(link.minio.endpoint)
        self.w0, self.mcpu0 = proc_cpu(pids), proc_cpu([minio_pid])
        self.main0 = proc_cpu(pids, children_too=False)

    def end(self, units: int) -> dict[str, Any]:
        """Per unit (kernel): Redis commands by name, MinIO requests by API, CPU ms."""
        link = self.link
        rd = delta(redis_counters(link.redis.url), self.r0)
        md = delta(minio_counters(link.minio.endpoint), self.m0)
        workers, mcpu = proc_cpu(self.pids) - self.w0, proc_cpu([minio_pid]) - self.mcpu0
        main = proc_cpu(self.pids, children_too=False) - self.main0
        top_redis = sorted(((k, v) for k, v in rd.items() if k not in ("commands", "cpu_s")),
                           key=lambda kv: -kv[1])
        top_minio = sorted(((k, v) for k, v in md.items() if k != "requests"),
                           key=lambda kv: -kv[1])
        return {
            "redis_commands_per_kernel": round(rd.get("commands", 0) / units, 2),
            "redis_top": {k: round(v / units, 2) for k, v in top_redis},
            "minio_requests_per_kernel": round(md.get("requests", 0) / units, 2),
            "minio_apis": {k: round(v / units, 2) for k, v in top_minio},
            "cpu_ms_per_kernel": {"workers": round(1000 * workers / units, 3),
                                  # of which the workers' main processes (Celery's consumer)
                                  "worker_main": round(1000 * main / units, 3),
                                  "redis": round(1000 * rd.get("cpu_s", 0) / units, 3),
                                  "minio": round(1000 * mcpu / units, 3)}}


