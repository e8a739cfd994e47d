"""Profiles for ``bench/bench_control_plane.py --profile DIR``: py-spy samples of every
worker (main and pool processes) and of each client over the throughput phase, and a
summary of where their CPU goes.

py-spy (``pip install py-spy``; it reads the processes from outside, so the farm needs
no hook) records each process's stacks 100 times a second, idle threads left out, as
"raw" collapsed stacks: one line per distinct stack, ``frame;frame;... count``. The
summary folds them into the *purposes* a control-plane cost can have (Celery, Redis
round trips, MinIO requests, records, pydantic, hashing, the simulated compile's sleep
is idle and not sampled), by the innermost frame that names one: so a ``socket.recv``
under the store's ``_fetch`` counts as MinIO, one under Celery's result backend as
Celery. Samples are CPU time only roughly (py-spy samples threads that hold or wait
for the GIL); the shares, not the absolute counts, are what to read.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
from pathlib import Path

#: (purpose, markers in a frame, looked for from the innermost frame outwards)
PURPOSES: list[tuple[str, tuple[str, ...]]] = [
    ("simulated compile", ("simfleet.py",)),
    ("records (recorder, stream sink)", ("records/recorder.py", "records/stream.py",
                                         "records/model.py", "records/sink.py")),
    ("compile lease (Redis)", ("cluster/lease.py",)),
    ("crash ledger, chunk checks (Redis)", ("worker/crashes.py", "worker/chunks.py")),
    ("signing / digest", ("store/signing.py", "hashlib", "cryptography")),
    ("artifact frame, pydantic", ("store/frames.py", "pydantic")),
    ("MinIO requests (minio SDK, urllib3)", ("store/minio.py", "minio/", "urllib3/")),
    ("metrics (prometheus)", ("prometheus_client", "cluster/metrics.py")),
    ("Celery result backend", ("celery/backends",)),
    ("Celery task trace, events", ("celery/app/trace.py", "celery/events",
                                   "celery/worker", "celery/app")),
    ("kombu / broker", ("kombu/",)),
    ("billiard pool", ("billiard/",)),
    ("redis-py", ("redis/",)),
    ("gatherer, holders (client)", ("cluster/gather.py", "cluster/holders.py")),
    ("client build (keys, listing)", ("cluster/client.py", "compilation/obtain.py")),
    ("payloads", ("cluster/payloads.py",)),
    ("worker execute", ("worker/execute.py", "worker/app.py")),
    ("imports", ("<frozen importlib", "importlib")),
]


def pyspy() -> str:
    """py-spy's path: beside this Python (a venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        sys.exit("--profile needs py-spy: pip install py-spy")
    return found


#: samples of threads holding the GIL only (Python's own CPU; a thread waiting for a
#: reply, or in a system call that released the GIL, is not counted): set by the bench
GIL = ["--gil"]
#: samples a second (py-spy's default is 100: too few for the shares of a short phase)
RATE = ["--rate", "400"]


def spy(pid: int, out: Path, *, subprocesses: bool = True) -> subprocess.Popen[bytes]:
    """Start sampling ``pid`` (and its children) into ``out`` until :func:`stop`."""
    argv = [pyspy(), "record", "--format", "raw", "--nonblocking", *GIL, *RATE, "-o",
            str(out), "--pid", str(pid)]
    if subprocesses:
        argv.append("--subprocesses")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wrap(argv: list[str], out: Path) -> list[str]:
    """``argv`` run under py-spy, its samples into ``out``."""
    return [pyspy(), "record", "--format", "raw", "--nonblocking", *GIL, *RATE, "-o",
            str(out), "--", *argv]


def stop(spies: list[subprocess.Popen[bytes]]) -> None:
    for p in spies:
        p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for p in spies:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def purpose(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        for name, markers in PURPOSES:
            if any(m in frame for m in markers):
                return name
    return "other: " + (frames[-1].split(" (")[0] if frames else "?")


def summarize(files: list[Path], top: int = 14) -> list[tuple[str, int, float]]:
    """(purpose, samples, share) over the collapsed stacks of ``files``, most first."""
    counts: collections.Counter[str] = collections.Counter()
    for path in files:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if n.isdigit():
                counts[purpose(stack)] += int(n)
    total = sum(counts.values()) or 1
    return [(k, v, v / total) for k, v in counts.most_common(top)]


def hot_frames(files: list[Path], top: int = 25) -> list[tuple[str, int]]:
    """The innermost farm (or library) frames by samples: where to look next."""
    counts: collections.Counter[str] = collections.Counter()
    for path in files:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            leaf = next((f for f in reversed(frames)
                         if "farm/" in f or "worker/" in f), frames[-1])
            counts[leaf] += int(n)
    return counts.most_common(top)


def report(folder: Path) -> None:
    """Print, per code and kind of process, where the samples went: by purpose, then
    the innermost farm frames."""
    files = sorted(folder.glob("*.txt"))
    groups: dict[str, list[Path]] = {}
    for path in files:
        code = path.name.split("-", 1)[0]
        kind = "client" if "-client" in path.name else "worker"
        groups.setdefault(f"{code} {kind}s", []).append(path)
    for name, paths in groups.items():
        print(f"\n{name}: samples by purpose ({folder})")
        for purpose_name, samples, share in summarize(paths):
            print(f"  {100 * share:5.1f}%  {samples:6d}  {purpose_name}")
        print(f"{name}: innermost farm frames")
        for frame, samples in hot_frames(paths, 12):
            print(f"  {samples:6d}  {frame[:110]}")
