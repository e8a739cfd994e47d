"""Real pyopencl applications served by the farm with no change to their code
(``farm run``), against real MinIO, Redis and Celery workers.

For each client (pyopencl.array with clmath, a reduction, a scan, clrandom; reikna's FFT
and matrix product; loopy's tutorial kernels), in one sequence:

1. a plain run (no farm) gives the reference results;
2. ``farm run --capture`` on a node with an empty local tier and an empty bucket compiles
   every program and computes exactly the plain run's results;
3. a second process with a fresh local tier and the same bucket compiles nothing;
4. ``farm build CAPTURE --cluster`` builds the capture on the workers into the
   cluster's bucket, and a fresh application process there compiles nothing.

And a header ``#include``d through ``-I`` changed between two runs is a new key: the
second run recompiles that program and computes the new result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_helpers import next_redis_db

from farm.devservices.cluster import LocalCluster, local_cluster

pytestmark = pytest.mark.integration

APPS = Path(__file__).parent / "apps"
#: generous: the machine is shared, and PoCL's binaries cost seconds under load
LIMITS = {"FARM_COMPILE_SOFT_TIME_LIMIT": "240", "FARM_COMPILE_HARD_TIME_LIMIT": "300",
          "FARM_VISIBILITY_TIMEOUT": "600", "FARM_CHUNK_SIZE": "2"}


@pytest.fixture(scope="module")
def cluster(redis_server: Any, minio_server: Any,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("programs-cluster")
    with local_cluster(work, redis=redis_server, minio=minio_server,
                       bucket=f"p-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       **LIMITS) as c:
        c.start_worker(concurrency=2)
        c.wait_ready()
        yield c


def _env(home: Path, minio: Any = None, bucket: str = "", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               PYOPENCL_CTX="0", **extra)
    if minio is not None:
        env.update(FARM_MINIO_ENDPOINT=minio.endpoint, FARM_MINIO_ACCESS_KEY=minio.access_key,
                   FARM_MINIO_SECRET_KEY=minio.secret_key, FARM_MINIO_BUCKET=bucket)
    return env


def _run_app(app: str, out: Path, env: dict[str, str], *farm_args: str,
             plain: bool = False) -> dict[str, int]:
    """Run a test application through ``farm run`` (or ``plain``); its counts."""
    command = [sys.executable, str(APPS / f"app_{app}.py"), str(out)]
    counts = out.with_suffix(".json")
    if not plain:
        command = [sys.executable, "-m", "farm", "run", "--json", str(counts), *farm_args,
                   "--", *command]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout, proc.stdout
    return {} if plain else json.loads(counts.read_text())


def _same(a: Path, b: Path) -> None:
    with np.load(a) as x, np.load(b) as y:
        assert sorted(x.files) == sorted(y.files)
        for name in x.files:
            assert np.array_equal(x[name], y[name]), name


@pytest.mark.parametrize("app", ["array", "reikna", "loopy"])
def test_an_application_is_served_unchanged_shared_and_prebuilt_on_the_cluster(
        app: str, cluster: LocalCluster, minio_server: Any, tmp_path: Path) -> None:
    plain = tmp_path / "plain.npz"
    _run_app(app, plain, _env(tmp_path / "plain-home"), plain=True)

    bucket = f"a-{uuid.uuid4().hex[:12]}"
    capture = tmp_path / "capture.json"
    cold = _run_app(app, tmp_path / "cold.npz", _env(tmp_path / "a", minio_server, bucket),
                    "--capture", str(capture))
    assert cold["programs"] > 0 and cold["compiled"] > 0, cold
    assert cold["fallbacks"] == cold["failed"] == 0, cold
    assert cold["loaded"] + cold["compiled"] == cold["programs"]
    _same(plain, tmp_path / "cold.npz")

    warm = _run_app(app, tmp_path / "warm.npz", _env(tmp_path / "b", minio_server, bucket))
    assert warm == {**cold, "loaded": cold["programs"], "compiled": 0}, warm
    _same(plain, tmp_path / "warm.npz")

    captured = json.loads(capture.read_text())
    distinct = len(captured["programs"])
    assert distinct == cold["compiled"]
    build = subprocess.run([sys.executable, "-m", "farm", "build", str(capture), "--cluster",
                            "--json"], env=cluster.env(tmp_path / "client"),
                           capture_output=True, text=True, timeout=900, check=False)
    assert build.returncode == 0, build.stdout + build.stderr
    summary = json.loads(build.stdout)["builds"][0]["summary"]
    assert summary["failed"] == 0 and summary["compiled"] + summary["loaded"] == distinct

    served = _run_app(app, tmp_path / "served.npz",
                      cluster.env(tmp_path / "fresh", PYOPENCL_CTX="0"))
    assert served["compiled"] == 0 and served["loaded"] == cold["programs"], served
    _same(plain, tmp_path / "served.npz")


HEADER_APP = """
import sys
import numpy as np
import pyopencl as cl
ctx = cl.create_some_context(interactive=False)
q = cl.CommandQueue(ctx)
src = '#include "value.h"\\n__kernel void f(__global int *a) { a[0] = VALUE; }'
prg = cl.Program(ctx, src).build(["-I", sys.argv[1]])
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4)
prg.f(q, (1,), None, buf)
out = np.empty(1, np.int32)
cl.enqueue_copy(q, out, buf)
print("value", int(out[0]))
"""


def test_a_header_changed_between_two_runs_recompiles_and_computes_the_new_value(
        tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text(HEADER_APP)
    inc = tmp_path / "include"
    inc.mkdir()
    env = _env(tmp_path / "home")

    def run(value: int) -> dict[str, Any]:
        if value:
            (inc / "value.h").write_text(f"#define VALUE {value}\n")
        counts = tmp_path / "counts.json"
        proc = subprocess.run([sys.executable, "-m", "farm", "run", "--json", str(counts),
                               "--", sys.executable, str(script), str(inc)], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        return {"value": int(proc.stdout.split()[-1]), **json.loads(counts.read_text())}

    assert run(1) == {"value": 1, "programs": 1, "loaded": 0, "compiled": 1,
                      "fallbacks": 0, "failed": 0}
    changed = run(2)
    assert changed["value"] == 2 and changed["compiled"] == 1  # a new key
    again = run(0)  # unchanged: served
    assert again["value"] == 2 and again["loaded"] == 1 and again["compiled"] == 0


ON_MISS_APP = """
import os, sys
import numpy as np
import pyopencl as cl
ctx = cl.create_some_context(interactive=False)
q = cl.CommandQueue(ctx)
try:
    prg = cl.Program(ctx, sys.argv[1]).build()
except cl.RuntimeError as exc:
    print("pyopencl says", type(exc).__name__, exc.code, "undeclared" in str(exc))
    raise SystemExit(3)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4)
prg.f(q, (1,), None, buf)
out = np.empty(1, np.int32)
cl.enqueue_copy(q, out, buf)
print("value", int(out[0]), "pid", os.getpid())
"""


def test_with_programs_on_miss_farm_the_cluster_compiles_what_no_tier_holds(
        cluster: LocalCluster, tmp_path: Path) -> None:
    from cluster_helpers import minio_store

    from farm.core.keys import Namespace

    script = tmp_path / "app.py"
    script.write_text(ON_MISS_APP)
    value = uuid.uuid4().int % 100000  # a source no store holds yet
    source = f"__kernel void f(__global int *a) {{ a[0] = {value}; }}"

    def run(home: str, src: str) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
        counts = tmp_path / f"{home}.json"
        env = cluster.env(tmp_path / home, PYOPENCL_CTX="0", FARM_PROGRAMS_ON_MISS="farm")
        proc = subprocess.run([sys.executable, "-m", "farm", "run", "--json", str(counts),
                               "--", sys.executable, str(script), src], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        return proc, json.loads(counts.read_text())

    proc, counts = run("a", source)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[1] == str(value) and counts["compiled"] == 1, (proc.stdout, counts)
    store = minio_store(cluster)
    try:
        ns = next(n for n in store.namespaces() if store.keys(n))
        worker = {a.meta.worker for k in store.keys(ns) if (a := store.get(ns, k)) is not None
                  and a.meta.family == "program"}
        app_pid = words[3]
        assert worker and all(not w.endswith(f":{app_pid}") for w in worker), worker
        assert isinstance(ns, Namespace)
    finally:
        store.close()
    again, counts = run("b", source)
    assert again.returncode == 0 and counts["loaded"] == 1 and counts["compiled"] == 0
    bad, counts = run("c", source.replace(str(value), "undeclared_name"))
    assert bad.returncode == 3, bad.stderr
    assert "pyopencl says RuntimeError -11 True" in bad.stdout
    assert counts["failed"] == 1
