"""What a served process pays before and around its builds (issue 30, item 1), and what
it prints: a process whose programs are all stored and proven on its node (by an earlier
run, or by the prover ahead while it starts) imports nothing of the program server,
pydantic, the settings or the MinIO SDK (the quick path, :mod:`farm.programs.quick`),
with PoCL's work-group records too; a source that does not compile prints its
compiler's diagnostics once, as a plain run does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: what a served process must not import while every program it builds is stored
HEAVY = ("pydantic", "pydantic_settings", "minio", "urllib3", "farm.programs.serve",
         "farm.core.settings", "farm.records", "farm.core.model", "tenacity")
APP = f"""
import json, sys
import pyopencl as cl
ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
for i in range(3):
    cl.Program(ctx, "__kernel void startup_%d(__global int *a) {{ a[0] = %d; }}" % (i, i)).build()
print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
"""
BAD = """
import pyopencl as cl
ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
try:
    cl.Program(ctx, "__kernel void f(__global int *a) { a[0] = not_declared; }").build()
except cl.RuntimeError as exc:
    print("raised", "not_declared" in str(exc))
"""


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0", **extra)
    return env


def _run(env: dict[str, str], app: Path, plain: bool = False
         ) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(app)]
    if not plain:
        command = [sys.executable, "-m", "farm", "run", "--", *command]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _imported(proc: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_served_process_whose_programs_are_stored_imports_nothing_heavy(
        tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(APP)
    env = _env(tmp_path / "home", FARM_POCL_READY="0")  # PoCL's records: the server's
    first = _run(env, app)  # compiles: the server, with everything it needs
    assert "kernel-farm: programs 3, loaded 0, compiled 3" in first.stderr, first.stderr
    assert "farm.programs.serve" in _imported(first)
    again = _run(env, app)
    assert "kernel-farm: programs 3, loaded 3, compiled 0" in again.stderr, again.stderr
    assert _imported(again) == []


@pytest.mark.integration
@pytest.mark.parametrize("ready", ["0", "1"])
def test_a_fresh_node_reads_minio_without_its_sdk(tmp_path: Path, minio_server: Any,
                                                   ready: str) -> None:
    app = tmp_path / "app.py"
    app.write_text(APP)
    store = {"FARM_MINIO_ENDPOINT": minio_server.endpoint,
             "FARM_MINIO_ACCESS_KEY": minio_server.access_key,
             "FARM_MINIO_SECRET_KEY": minio_server.secret_key,
             "FARM_MINIO_BUCKET": f"startup-{ready}-{os.getpid()}", "FARM_POCL_READY": ready}
    _run(_env(tmp_path / "filler", **store), app)
    fresh = _run(_env(tmp_path / "fresh", **store), app)
    assert "kernel-farm: programs 3, loaded 3, compiled 0" in fresh.stderr, fresh.stderr
    # every program proven by the prover ahead while the application started: the quick
    # path served them all, reading PoCL's records too (the application launches nothing:
    # it has none)
    assert _imported(fresh) == [], fresh.stderr
    proofs = tmp_path / "fresh" / "proofs" / "v1"
    assert len([p for p in proofs.rglob("*") if p.is_file() and p.parent.name != "ahead"
                and not p.name.endswith(".refused")]) == 3
    if ready == "0":
        # the node kept them: a second run there needs no MinIO at all (with PoCL's
        # records on, the quick path still asks MinIO for records the node lacks)
        offline = {**store, "FARM_MINIO_ENDPOINT": "127.0.0.1:1"}
        again = _run(_env(tmp_path / "fresh", **offline), app)
        assert again.stderr.splitlines() == [
            "kernel-farm: programs 3, loaded 3, compiled 0, fallbacks 0, failed 0"]


def test_a_failing_sources_diagnostics_are_printed_once_as_in_a_plain_run(
        tmp_path: Path) -> None:
    app = tmp_path / "bad.py"
    app.write_text(BAD)
    env = _env(tmp_path / "home")
    plain = _run(env, app, plain=True)
    served = _run(env, app)
    assert plain.stdout.strip() == served.stdout.strip() == "raised True"
    said = [line for line in plain.stderr.splitlines() if line.strip()]
    assert said, plain.stderr  # PoCL says "1 error generated."
    assert [line for line in served.stderr.splitlines() if line.strip()] == [
        *said, "kernel-farm: programs 1, loaded 0, compiled 0, fallbacks 0, failed 1"]


SCAN = """
import json
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.invoker as invoker
import pyopencl.scan as scan
generated = []
def counted(fn, what):
    def wrapper(*args, **kwargs):
        generated.append(what)
        return fn(*args, **kwargs)
    return wrapper
scan.GenericScanKernel._finish_setup_impl = counted(
    scan.GenericScanKernel._finish_setup_impl, "scan")
invoker._generate_enqueue_and_set_args_module = counted(
    invoker._generate_enqueue_and_set_args_module, "invoker")
ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
q = cl.CommandQueue(ctx)
a = cla.to_device(q, np.arange(1000, dtype=np.int32))
assert (cla.cumsum(a).get() == np.cumsum(np.arange(1000))).all()
assert ((2 * a + 1).get() == 2 * np.arange(1000) + 1).all()
import sys
print(json.dumps([sorted(set(generated)), [m for m in HEAVY if m in sys.modules]]))
""".replace("HEAVY", repr(HEAVY))


@pytest.mark.integration
@pytest.mark.parametrize("store", ["signed", "unsigned", "unsigned, any"])
def test_a_fresh_node_gets_pyopencls_generated_code_from_the_farm(
        tmp_path: Path, minio_server: Any, store: str) -> None:
    """pyopencl renders its scans with Mako and generates its kernels' invokers, and keeps
    both in its own cache of generated code (``XDG_CACHE_HOME``); the farm serves them
    like binaries (:mod:`farm.programs.generated`), so a fresh node generates neither.
    They are pickles, code that runs in the application: served from a store whose
    artifacts are signed and verified (the quick path verifies the signatures itself:
    still nothing heavy imported), from an unsigned store only with
    ``FARM_GENERATED_CODE=any``."""
    from farm.store.signing import generate_keypair

    app = tmp_path / "scan.py"
    app.write_text(SCAN)
    private, public = generate_keypair()
    base = {"FARM_MINIO_ENDPOINT": minio_server.endpoint,
            "FARM_MINIO_ACCESS_KEY": minio_server.access_key,
            "FARM_MINIO_SECRET_KEY": minio_server.secret_key,
            "FARM_MINIO_BUCKET": f"generated-{store.replace(', ', '-')}-{os.getpid()}"}
    if store.endswith("any"):
        base["FARM_GENERATED_CODE"] = "any"

    def node(name: str, **keys: str) -> dict[str, str]:
        env = _env(tmp_path / name, **base, **keys,
                   XDG_CACHE_HOME=str(tmp_path / name / "xdg"))
        del env["PYOPENCL_NO_CACHE"]  # pyopencl's cache of generated code: on
        return env

    signed = store == "signed"
    first = _run(node("filler", **({"FARM_SIGNING_KEY": private} if signed else {})), app)
    assert _imported(first)[0] == ["invoker", "scan"]  # it generated both
    fresh = _run(node("fresh", **({"FARM_VERIFY_KEY": public} if signed else {})), app)
    assert "compiled 0" in fresh.stderr, fresh.stderr
    generated, heavy = _imported(fresh)
    assert generated == ([] if store != "unsigned" else ["invoker", "scan"]), fresh.stderr
    assert heavy == [], fresh.stderr  # signatures verified on the quick path too
