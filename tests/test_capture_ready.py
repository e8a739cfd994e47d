"""Issue 30, item 2: a node prepared only from a capture is ready at its first run on
PoCL.

What this file proves, on the local PoCL (the drivers' caches off, each node with a
farm home and a PoCL cache folder of its own):

* ``farm capture`` records, per program, the work-group functions its launches needed on
  the device (kernel, local size, zero offset, grid class: a local size PoCL picked, a
  grid too wide for "smallgrid" included), without touching pyopencl's launch entry
  points;
* ``farm build CAPTURE`` on another node (its own empty store) makes them and stores them
  beside the programs, and that node's first application run launches every kernel with
  no work-group function compiled: PoCL writes no ``.so`` into its cache folder during
  the launches, and each function the launches map is one the load unpacked (the means
  of ``tests/test_ready.py``, which works on every PoCL), with ``compiled 0`` and the
  values right; a rebuild makes nothing again;
* the same check fails where it should: an old capture (no launch fields) still builds,
  and that node's first launches compile;
* ``farm build CAPTURE --cluster``: a real worker makes them into MinIO (for programs
  an old capture's build stored without them), a fresh node of the cluster is ready at
  its first run, and a rebuild sends nothing;
* a function made without a launch is byte for byte the one a launch makes, and only the
  functions asked for are made;
* hostile launch fields are refused in one line naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import next_redis_db

from farm.devservices.cluster import LocalCluster, local_cluster

# Builds its programs first (pyopencl.array's elementwise one too), then launches: a
# custom program at local sizes 64 and 16, one left to PoCL, one over a grid too wide
# for "smallgrid"; and reports the .so files PoCL wrote during the launches, those the
# launches mapped (and whether each was there before: unpacked from the loaded binary),
# whether pyopencl's launch entry points are its own, and whether the values are right.
APP = r"""
import glob, json, os, sys
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
from pyopencl.elementwise import ElementwiseKernel
from farm.compilation.ready import mapped_functions

SOURCE = '''
__kernel void scale(__global float *a, float k) { int i = get_global_id(0); a[i] *= k; }
__kernel void shift(__global float *a, float k) { int i = get_global_id(0); a[i] += k; }
__kernel void never(__global float *a) { a[0] = 0; }
''' + sys.argv[1]
ctx = cl.Context([next(d for p in cl.get_platforms() if "Portable" in p.name
                      for d in p.get_devices())])
q = cl.CommandQueue(ctx)
x = np.random.default_rng(7).random(1 << 17).astype(np.float32)
prg = cl.Program(ctx, SOURCE).build()
scale, shift = cl.Kernel(prg, "scale"), cl.Kernel(prg, "shift")
lin = ElementwiseKernel(ctx, "float *z, const float *x, float k", "z[i] = k*x[i] + 1", "lin")
lin.get_kernel(False)
top = os.environ["POCL_CACHE_DIR"]
so = lambda: set(glob.glob(os.path.join(top, "**", "*.so"), recursive=True))
before, mapped = so(), mapped_functions()
gx = cla.to_device(q, x)
a, big, z = gx.copy(), gx.copy(), cla.empty_like(gx)
scale(q, (4096,), (64,), a.data, np.float32(3))
shift(q, (4096,), (16,), a.data, np.float32(1))
shift(q, (4096,), None, a.data, np.float32(1))
scale(q, (1 << 17,), (32,), big.data, np.float32(2))
lin(z, gx, np.float32(2))
q.finish()
new = sorted(mapped_functions() - mapped)
ok = (np.allclose(a.get()[:4096], x[:4096] * 3 + 2) and np.allclose(big.get(), 2 * x)
      and np.allclose(z.get(), 2 * x + 1))
print(json.dumps({"ok": bool(ok), "written": sorted(so() - before), "mapped": new,
                  "unpacked": [p in before for p in new],
                  "entry_points": [cl.enqueue_nd_range_kernel.__module__,
                                   cl.Kernel.__call__.__module__]}))
"""
#: what the application's launches need: (kernel, local size, small grid), zero offset
LAUNCHED = {("scale", (64, 1, 1), True), ("scale", (32, 1, 1), False),
            ("shift", (16, 1, 1), True), ("lin", None, True)}
LIMITS = {"FARM_COMPILE_SOFT_TIME_LIMIT": "240", "FARM_COMPILE_HARD_TIME_LIMIT": "300",
          "FARM_VISIBILITY_TIMEOUT": "600"}


def _env(home: Path, cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "POCL_"))}
    cache.mkdir(parents=True, exist_ok=True)
    env.update(FARM_HOME=str(home), POCL_CACHE_DIR=str(cache), PYOPENCL_NO_CACHE="1",
               POCL_KERNEL_CACHE="0", CUDA_CACHE_DISABLE="1", **extra)
    return env


def _farm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], env=env, text=True,
                          capture_output=True, timeout=900, check=False)


def _run(root: Path, env: dict[str, str], salt: str, *farm_args: str
         ) -> tuple[dict[str, Any], dict[str, int]]:
    """The application under ``farm run`` (or ``farm capture`` with ``farm_args``): its
    report and the run's counts."""
    app = root / "app.py"
    app.write_text(APP)
    counts = root / f"counts-{uuid.uuid4().hex[:8]}.json"
    verb = list(farm_args) or ["run", "--json", str(counts)]
    proc = _farm(env, *verb, "--", sys.executable, str(app), salt)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"], report
    return report, (json.loads(counts.read_text()) if counts.exists() else {})


def _ready(report: dict[str, Any]) -> None:
    """No work-group function compiled at the launches: nothing written, every function
    they used unpacked from what the node loaded."""
    assert report["written"] == [], report["written"]
    assert len(report["mapped"]) == len(LAUNCHED) + 1, report  # shift twice
    assert all(report["unpacked"]), report


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Node A runs the application under ``farm capture`` (its own store: nothing it
    stores reaches another node)."""
    root = tmp_path_factory.mktemp("capture-ready")
    salt = f"// {uuid.uuid4()}\n"  # programs no earlier run stored
    path = root / "app.capture.json"
    report, _ = _run(root, _env(root / "a", root / "a-pocl"), salt, "capture", str(path))
    assert len(report["written"]) == len(LAUNCHED) + 1, report  # node A compiled them
    assert not [m for m in report["entry_points"] if m.startswith("farm")], report
    return {"root": root, "salt": salt, "path": path, "data": json.loads(path.read_text())}


def test_a_capture_records_what_each_programs_launches_needed(captured: dict[str, Any]
                                                              ) -> None:
    programs = captured["data"]["programs"]
    assert len(programs) == 2
    found = set()
    for p in programs:
        (fp,) = p["fingerprints"]
        assert list(p["launches"]) == [fp]
        for x in p["launches"][fp]:
            assert x["zero_offset"] is True
            found.add((x["kernel"], tuple(x["local_size"]), x["small_grid"]))
    assert {x for x in LAUNCHED if x[1] is not None} <= found
    # shift's launch left to PoCL and the elementwise kernel's: a local size PoCL chose
    assert len([f for f in found if f[0] == "shift"]) == 2
    assert len([f for f in found if f[0] == "lin" and f[2]]) == 1
    assert len(found) == len(LAUNCHED) + 1
    # the application, by its main script's digest: farm build stores its plan
    app = hashlib.sha256((captured["root"] / "app.py").read_bytes()).hexdigest()
    assert captured["data"]["applications"] == [app]


def _plan(home: Path, fingerprint: str, app: str) -> list[str]:
    """The program keys of ``app``'s first plan slot in ``home``'s store ([]: none)."""
    from farm.core.keys import Namespace
    from farm.core.model import Key
    from farm.core.settings import Settings
    from farm.programs.plan import PLAN_BUILD_ID, decode, plan_id
    from farm.store import open_store

    store = open_store(Settings(home=home), signed=False)
    try:
        art = store.get(Namespace.for_fingerprint(fingerprint),
                        Key(id_hash=plan_id(app, 0), build_id=PLAN_BUILD_ID))
    finally:
        store.close()
    return decode(art.binary) if art is not None else []


def test_a_node_prepared_from_a_capture_compiles_no_work_group_function(
        captured: dict[str, Any]) -> None:
    root = captured["root"]
    env = _env(root / "b", root / "b-pocl")
    build = _farm(env, "build", str(captured["path"]), "--json", "--workers", "2")
    assert build.returncode == 0, build.stdout + build.stderr[-3000:]
    out = json.loads(build.stdout)["builds"][0]
    assert out["summary"]["compiled"] == 2, out
    # the application's plan, stored by the build: a fresh node proves it ahead
    app = captured["data"]["applications"][0]
    from farm.programs.capture import read_capture

    assert sorted(_plan(root / "b", out["fingerprint"], app)) == sorted(
        p.spec.key.id_hash for p in read_capture(captured["path"]).programs)
    ready = out["work_group_functions"]
    assert {k: ready[k] for k in ("programs", "made", "held", "ignored", "failed")} == {
        "programs": 2, "made": len(LAUNCHED) + 1, "held": 0, "ignored": 0, "failed": []}, out
    report, counts = _run(root, env, captured["salt"])
    _ready(report)
    assert counts["loaded"] == 2 and counts["compiled"] == 0, counts
    again = _farm(env, "build", str(captured["path"]), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    ready = json.loads(again.stdout)["builds"][0]["work_group_functions"]
    assert ready["made"] == 0 and ready["held"] == len(LAUNCHED) + 1, ready


def test_an_old_capture_without_launches_still_builds_and_its_node_compiles_at_launch(
        captured: dict[str, Any]) -> None:
    """The check above can fail: without the launch fields (a capture made before them)
    the programs build, and the node's first launches compile."""
    root = captured["root"]
    old = json.loads(json.dumps(captured["data"]))
    for p in old["programs"]:
        del p["launches"]
    path = root / "old.capture.json"
    path.write_text(json.dumps(old))
    env = _env(root / "c", root / "c-pocl")
    build = _farm(env, "build", str(path), "--json")
    assert build.returncode == 0, build.stdout + build.stderr[-3000:]
    out = json.loads(build.stdout)["builds"][0]
    assert out["summary"]["compiled"] == 2 and "work_group_functions" not in out, out
    report, counts = _run(root, env, captured["salt"])
    assert counts["compiled"] == 0, counts
    assert len(report["written"]) == len(LAUNCHED) + 1, report


# -- on the cluster ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(redis_server: Any, minio_server: Any,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("capture-cluster")
    with local_cluster(work, redis=redis_server, minio=minio_server,
                       bucket=f"w-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       **LIMITS) as c:
        c.start_worker()
        c.wait_ready()
        yield c


@pytest.mark.integration
def test_a_cluster_build_of_a_capture_makes_a_fresh_node_ready(
        captured: dict[str, Any], cluster: LocalCluster, tmp_path: Path) -> None:
    """The programs first built from the old capture (no launches: no functions), then
    the capture: the worker finds them stored and makes their functions."""
    client = cluster.env(tmp_path / "client")
    old = json.loads(json.dumps(captured["data"]))
    for p in old["programs"]:
        del p["launches"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    build = _farm(client, "build", str(tmp_path / "old.json"), "--cluster", "--json")
    assert build.returncode == 0, build.stdout + build.stderr[-3000:]
    out = json.loads(build.stdout)["builds"][0]
    assert out["summary"]["compiled"] == 2 and "work_group_functions" not in out, out
    build = _farm(client, "build", str(captured["path"]), "--cluster", "--json")
    assert build.returncode == 0, build.stdout + build.stderr[-3000:]
    out = json.loads(build.stdout)["builds"][0]
    assert out["summary"]["loaded"] == 2 and out["summary"]["tasks_sent"] >= 1, out
    assert out["work_group_functions"]["made"] == len(LAUNCHED) + 1, out
    assert out["work_group_functions"]["failed"] == [], out
    node = {k: v for k, v in cluster.env(tmp_path / "fresh").items()
            if not k.startswith("POCL_")}
    (tmp_path / "fresh-pocl").mkdir()
    node.update(POCL_CACHE_DIR=str(tmp_path / "fresh-pocl"), POCL_KERNEL_CACHE="0")
    report, counts = _run(tmp_path, node, captured["salt"])
    _ready(report)
    assert counts["loaded"] == 2 and counts["compiled"] == 0, counts
    again = _farm(client, "build", str(captured["path"]), "--cluster", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    out = json.loads(again.stdout)["builds"][0]
    assert out["summary"]["tasks_sent"] == 0, out  # nothing left to make
    assert out["work_group_functions"]["held"] == len(LAUNCHED) + 1, out


# -- making without a launch ----------------------------------------------------------------------
def test_a_function_made_without_a_launch_is_the_one_a_launch_makes(tmp_path: Path) -> None:
    """In child processes with private caches: the function PoCL makes when the binary
    is taken with the specialisation listed is the one the launch makes, byte for byte;
    only what was asked for comes back; a binary holding other kernels is refused."""
    from farm.compilation.finalize import RawSource, finalize_and_validate
    from farm.compilation.specialize import FunctionMaker
    from farm.core.device import open_device, probe_devices, select_device

    info = select_device(probe_devices(), None)
    ctx, dev = open_device(info)
    source = (f"// {uuid.uuid4()}\n" "__kernel void twice(__global float *a) "
              "{ int i = get_global_id(0); a[i] = 2 * a[i]; }\n"
              "__kernel void other(__global float *a) { a[get_global_id(0)] += 1; }\n")
    built = finalize_and_validate(ctx, dev, RawSource(source.encode(), b""), None)
    assert built.ok, built.error
    (tmp_path / "prog.bin").write_bytes(built.binary)
    device = info.model_dump_json()
    launch = ("import numpy as np, pyopencl as cl\n"
              "from farm.core.device import DeviceInfo, open_device\n"
              f"ctx, dev = open_device(DeviceInfo.model_validate_json({device!r}))\n"
              f"p = cl.Program(ctx, [dev], [open({str(tmp_path / 'prog.bin')!r}, 'rb').read()])"
              ".build()\n"
              "a = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * 1024)\n"
              "p.twice(cl.CommandQueue(ctx), (1024,), (16,), a).wait()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POCL_")}
    cache = tmp_path / "launch-cache"
    proc = subprocess.run([sys.executable, "-c", launch], env={
        **env, "POCL_CACHE_DIR": str(cache), "PYOPENCL_NO_CACHE": "1"},
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (launched,) = cache.rglob("twice/16-1-1-goffs0-smallgrid/twice.so")
    wanted = {("twice", "16-1-1-goffs0-smallgrid"), ("other", "128-1-1-goffs0")}
    with FunctionMaker(info, frozenset({"16-1-1-goffs0-smallgrid", "128-1-1-goffs0",
                                        "8-1-1-goffs0-smallgrid"})) as maker:
        made = maker.make(built.binary, ("other", "twice"), wanted)
        assert not made.error and set(made.functions) == wanted, made.error
        assert made.functions[("twice", "16-1-1-goffs0-smallgrid")] == launched.read_bytes()
        refused = maker.make(built.binary, ("twice",), {("twice", "8-1-1-goffs0-smallgrid")})
        assert "other" in refused.error and not refused.functions


# -- hostile launch fields --------------------------------------------------------------------
Edit = Callable[[dict[str, Any], str], None]


def _first(p: dict[str, Any], fp: str) -> dict[str, Any]:
    launch: dict[str, Any] = p["launches"][fp][0]
    return launch


HOSTILE: dict[str, tuple[Edit, str]] = {
    "local size 0": (lambda p, fp: _first(p, fp).update(local_size=[0, 1, 1]),
                     "local_size"),
    "local size PoCL never makes": (
        lambda p, fp: _first(p, fp).update(local_size=[99999, 1, 1]), "local_size"),
    "local size as text": (lambda p, fp: _first(p, fp).update(local_size=["16", 1, 1]),
                           "local_size"),
    "local size a path": (
        lambda p, fp: _first(p, fp).update(local_size=["16/../../x", 1, 1]), "local_size"),
    "two dimensions": (lambda p, fp: _first(p, fp).update(local_size=[16, 1]),
                       "local_size"),
    "kernel a path": (lambda p, fp: _first(p, fp).update(kernel="../../x"), "kernel"),
    "kernel too long": (lambda p, fp: _first(p, fp).update(kernel="k" * 300), "kernel"),
    "offset as text": (lambda p, fp: _first(p, fp).update(zero_offset="yes"),
                       "zero_offset"),
    "grid class missing": (lambda p, fp: _first(p, fp).pop("small_grid"), "small_grid"),
    "a field nobody declared": (lambda p, fp: _first(p, fp).update(spec="16-1-1"), "spec"),
    "launches a list": (lambda p, fp: p.update(launches=[1]), "launches"),
    "a device the program was not built for": (
        lambda p, fp: p.update(launches={"pocl-other-0123456789ab": p["launches"][fp]}),
        "launches"),
    "too many on one device": (
        lambda p, fp: p["launches"].update({fp: p["launches"][fp] * 5000}), "launches"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_launch_fields_are_refused_in_one_line(
        kind: str, captured: dict[str, Any], tmp_path: Path) -> None:
    edit, field = HOSTILE[kind]
    data = json.loads(json.dumps(captured["data"]))
    program = data["programs"][0]
    edit(program, program["fingerprints"][0])
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(data))
    proc = _farm(_env(tmp_path / "home", tmp_path / "pocl"), "build", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"capture {path}" in lines[0], lines
    assert "programs" in lines[0] and field in lines[0], lines[0]


def test_the_count_of_launches_is_bounded_before_the_models_read_them(
        captured: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.programs import capture

    monkeypatch.setattr(capture, "MAX_LAUNCHES", 3)
    with pytest.raises(capture.CaptureError, match="launches, over the limit of 3"):
        capture.read_capture(captured["path"])


def test_merged_captures_join_their_launches(captured: dict[str, Any]) -> None:
    """``farm run``'s processes each write a capture; the run's is their merge."""
    from farm.programs.capture import merge, read_capture

    one = read_capture(captured["path"])
    program = one.programs[0]
    fp = program.fingerprints[0]
    half = one.model_copy(update={"programs": (program.model_copy(update={
        "launches": {fp: program.launches[fp][:1]}}),) if program.launches else ()})
    rest = one.model_copy(update={"programs": (program.model_copy(update={
        "launches": {fp: program.launches[fp][1:]}}),) if program.launches else ()})
    joined = merge([half, rest])
    assert joined.programs[0].launched(fp) == program.launched(fp)
    assert merge([one]).programs == one.programs
