"""Trust in artifacts (issue 19, items 1 and 2), on the local PoCL device.

* A binary is served only as the kernels its family declares: an artifact under relu's
  key holding gelu's binary (plain, or as a native container's parts) is refused, and
  the kernel is compiled instead.
* The architecture check applies on every device: a PoCL binary records the identity of
  the device it was built for (``poclbin`` header, an FNV-1 hash of the device's build
  hash, which PoCL also reports after ``HSTR:`` in the device version); a binary of
  another identity is refused before the driver parses it.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from farm.compilation.load import load_binary
from farm.compilation.native import pack
from farm.compilation.target import binary_target, device_target
from farm.core.device import DeviceContext, probe_devices, select_device
from farm.core.errors import LoadError
from farm.core.model import Artifact, Lowered
from farm.core.settings import Settings
from farm.store import SQLiteStore
from loader import ArtifactMissing, KernelLoader

UNARY = "elementwise_unary"
X = np.array([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=np.float32)


def settings_for(home: Path, **extra: Any) -> Settings:
    return Settings(home=home, environment="default", records_url=None, device=None,
                    redis_url=None, minio_endpoint=None, workers=0, **extra)


def run_unary(loader: KernelLoader, op: str) -> np.ndarray:
    """``op`` of X on the device, through the loader's kernel."""
    import pyopencl as cl

    kernel = loader.kernel(UNARY, {"op": op})
    mf = cl.mem_flags
    x = cl.Buffer(loader.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=X)
    out = cl.Buffer(loader.context, mf.WRITE_ONLY, X.nbytes)
    kernel(loader.queue, (64,), None, x, out, np.uint32(len(X)))
    got = np.empty_like(X)
    cl.enqueue_copy(loader.queue, got, out)
    loader.queue.finish()
    return got


def gelu_under_relus_key(settings: Settings, wrap: bool = False) -> None:
    """Compile gelu, then store its binary under relu's key (as a store writer could)."""
    with KernelLoader(settings) as loader:
        loader.kernel(UNARY, {"op": "gelu"})
        ns = loader.namespace
        gelu_key = loader.key_of(loader.artifact_id(UNARY, {"op": "gelu"}))
        relu_key = loader.key_of(loader.artifact_id(UNARY, {"op": "relu"}))
    store = SQLiteStore(settings.store_path)
    gelu = store.get(ns, gelu_key)
    assert gelu is not None
    binary = pack("fake_1", gelu.binary, gelu.binary) if wrap else gelu.binary
    store.put(ns, Artifact.create(relu_key, UNARY, binary, gelu.meta.source_hash))
    store.close()


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "native-container"])
def test_another_kernels_binary_under_a_key_is_never_served(tmp_path: Path,
                                                            wrap: bool) -> None:
    """Issue 19 item 2: relu's key holding gelu's binary ran as relu and gave gelu's
    values. Now the declared kernel names are checked at load: a miss, compiled."""
    settings = settings_for(tmp_path / "home")
    gelu_under_relus_key(settings, wrap)
    with KernelLoader(settings, on_miss="fail") as loader, \
            pytest.raises(ArtifactMissing):
        loader.kernel(UNARY, {"op": "relu"})
    with KernelLoader(settings) as loader:
        assert run_unary(loader, "relu").tolist() == [0.0, 0.0, 0.0, 1.0, 2.0]
        assert loader.stats.local == 0 and loader.stats.compiled == 1


def test_the_architecture_check_applies_to_pocl_binaries(tmp_path: Path) -> None:
    """Issue 19 item 2: the check was skipped on every non-NVIDIA device. A PoCL binary
    names its device (header); this device's identity comes from its version string."""
    from farm.compilation.finalize import finalize

    device = select_device(probe_devices())
    ctx, cl_device = DeviceContext(device).get()
    want = device_target(cl_device)
    assert want is not None and want.startswith("pocl:")
    with KernelLoader(settings_for(tmp_path / "home")) as loader:
        family = loader.registry.get(UNARY)
        lowered = family.lower_id(family.artifact_id({"op": "neg"}), device)
    binary = finalize(ctx, cl_device, lowered).binary
    assert binary_target(binary) == want
    assert load_binary(ctx, cl_device, binary, lowered.kernel_names).names == ("unary_neg",)

    (device_id,) = struct.unpack_from("<Q", binary, 8)
    foreign = binary[:8] + struct.pack("<Q", device_id ^ 0x5A5A) + binary[16:]
    with pytest.raises(LoadError, match="is for pocl:"):
        load_binary(ctx, cl_device, foreign, lowered.kernel_names)
    with pytest.raises(LoadError, match="is for an unknown target"):
        load_binary(ctx, cl_device, b"\x00not a pocl binary" * 8, lowered.kernel_names)
    with pytest.raises(LoadError, match=r"lacks kernel\(s\) unary_relu"):
        load_binary(ctx, cl_device, binary, ("unary_relu",))
    two = Lowered(source="__kernel void a(__global float *x) { x[0] = 1.0f; }\n"
                         "__kernel void b(__global float *x) { x[0] = 2.0f; }\n",
                  kernel_names=("a", "b"))
    both = finalize(ctx, cl_device, two).binary
    assert set(load_binary(ctx, cl_device, both, ("a", "b")).names) == {"a", "b"}
    with pytest.raises(LoadError, match=r"holds kernel\(s\) b that the family does not"):
        load_binary(ctx, cl_device, both, ("a",))


# ----------------------------------------------------------------------------------------
# item 1: a damaged binary never takes a process down, and never stays for ever
# ----------------------------------------------------------------------------------------
def farm_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), FARM_WORKERS="0", PYOPENCL_NO_CACHE="1",
               POCL_KERNEL_CACHE="0", CUDA_CACHE_DISABLE="1")
    return subprocess.run([sys.executable, "-m", "farm", *args], env=env, text=True,
                          capture_output=True, timeout=300, check=False)


def two_kernels(tmp_path: Path) -> Path:
    manifest = tmp_path / "m.toml"
    manifest.write_text('format = 1\nname = "trust"\n\n'
                        '[[kernels]]\nfamily = "elementwise_unary"\nparams = { op = "neg" }\n\n'
                        '[[kernels]]\nfamily = "elementwise_unary"\nparams = { op = "relu" }\n')
    return manifest


def truncated(binary: bytes, wrap: bool) -> bytes:
    """What PoCL 3 dies on (SIGSEGV): the first kilobyte of a real binary."""
    cut = binary[:1000]
    return pack("fake_1", cut, cut) if wrap else cut


def refused_cleanly(binary: bytes) -> bytes:
    """A milder corruption: a poclbin of format version 1, which PoCL refuses."""
    return binary[:16] + struct.pack("<I", 1) + binary[20:]


def built_store(tmp_path: Path) -> tuple[Settings, Any, Any, Any]:
    """An environment holding neg and relu, compiled here: (settings, ns, neg key, relu key)."""
    settings = settings_for(tmp_path / "built")
    with KernelLoader(settings) as loader:
        for op in ("neg", "relu"):
            loader.kernel(UNARY, {"op": op})
        keys = [loader.key_of(loader.artifact_id(UNARY, {"op": op})) for op in ("neg", "relu")]
        return settings, loader.namespace, keys[0], keys[1]


def put_damaged(settings: Settings, ns: Any, key: Any, binary: bytes, origin: str) -> None:
    """Replace what ``key`` holds by ``binary`` with a right digest (a writer could)."""
    store = SQLiteStore(settings.store_path)
    good = store.get(ns, key)
    assert good is not None
    store.delete(ns, key)
    bad = Artifact.create(key, UNARY, binary, good.meta.source_hash)
    store.put(ns, Artifact(meta=bad.meta.model_copy(update={"origin": origin}),
                           binary=binary))
    store.close()


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "native-container"])
def test_a_bundle_whose_binary_crashes_the_driver_is_refused_at_import(
        tmp_path: Path, wrap: bool) -> None:
    """Issue 19 item 1: a bundle carrying a truncated binary (right digest) imported
    fine, then every loader and ``farm warm`` died with SIGSEGV inside PoCL. Import now
    loads each artifact for a device of this machine in a child process first; one that
    kills the child (or that the device refuses) refuses the whole bundle."""
    from farm.store.bundle import export_bundle

    settings, ns, neg, _ = built_store(tmp_path)
    store = SQLiteStore(settings.store_path)
    good = store.get(ns, neg)
    assert good is not None
    evil = SQLiteStore(tmp_path / "evil.sqlite")
    for key in store.keys(ns):
        art = store.get(ns, key)
        assert art is not None
        if key == neg:
            art = Artifact.create(key, UNARY, truncated(good.binary, wrap), good.meta.source_hash)
        evil.put(ns, art)
    export_bundle(evil, [ns], tmp_path / "evil.kfb")
    store.close()
    evil.close()

    home = tmp_path / "importer"
    imported = farm_cli(home, "bundle", "import", str(tmp_path / "evil.kfb"))
    assert imported.returncode == 2, imported.stdout + imported.stderr
    assert "fails validation on this device" in imported.stderr
    assert "Traceback" not in imported.stderr and imported.stderr.count("\n") == 1
    assert not (home / "envs" / "default" / "store.sqlite").exists() or \
        list(SQLiteStore(home / "envs" / "default" / "store.sqlite").keys(ns)) == []
    warm = farm_cli(home, "warm", str(two_kernels(tmp_path)), "--json")
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert json.loads(warm.stdout)["summary"]["compiled"] == 2


def test_an_unvalidated_binary_is_loaded_in_a_child_first_and_quarantined(
        tmp_path: Path) -> None:
    """Issue 19 item 1: a binary the farm did not validate on this fingerprint (an
    import on a machine without the device, another prefix) reaches no process that
    matters unchecked: ``farm build`` and ``farm warm`` load it in a child first; the
    crash is the child's, the artifact goes to quarantine with why, and is rebuilt."""
    settings, ns, neg, _ = built_store(tmp_path)
    store = SQLiteStore(settings.store_path)
    good = store.get(ns, neg)
    assert good is not None
    store.close()
    put_damaged(settings, ns, neg, truncated(good.binary, False), origin="imported")
    manifest = two_kernels(tmp_path)

    build = farm_cli(settings.home, "build", str(manifest), "--local", "--json")
    assert build.returncode == 0, build.stderr[-2000:]
    summary = json.loads(build.stdout)["summary"]
    assert (summary["loaded"], summary["compiled"]) == (1, 1), summary
    store = SQLiteStore(settings.store_path)
    [entry] = store.quarantined(ns)
    assert entry.key == neg and "crashed" in entry.reason
    assert entry.artifact.binary[:7] == b"poclbin"
    store.close()

    put_damaged(settings, ns, neg, truncated(good.binary, True), origin="imported")
    warm = farm_cli(settings.home, "warm", str(manifest), "--json")
    assert warm.returncode == 0, warm.stderr[-2000:]
    summary = json.loads(warm.stdout)["summary"]
    assert (summary["local"], summary["compiled"]) == (1, 1), summary
    store = SQLiteStore(settings.store_path)
    assert len(store.quarantined(ns)) == 2
    fixed = store.get(ns, neg)
    assert fixed is not None and fixed.meta.origin == "compiled"
    store.close()


def test_an_artifact_its_own_device_refuses_is_replaced_and_kept_as_evidence(
        tmp_path: Path) -> None:
    """Issue 19 item 1: with a milder corruption each loader recompiled, but its repair
    was refused by first-writer-wins (the stored digest verifies), so every later
    loader compiled again. Proven bad on its own device, it is now quarantined (with
    why, and its bytes) and the repair is stored."""
    settings, ns, neg, _ = built_store(tmp_path)
    store = SQLiteStore(settings.store_path)
    good = store.get(ns, neg)
    assert good is not None
    store.close()
    bad = refused_cleanly(good.binary)
    put_damaged(settings, ns, neg, bad, origin="compiled")
    with KernelLoader(settings) as loader:
        assert run_unary(loader, "neg").tolist() == [2.0, 1.0, -0.0, -1.0, -2.0]
        assert loader.stats.compiled == 1
    with KernelLoader(settings) as loader:
        assert run_unary(loader, "neg").tolist() == [2.0, 1.0, -0.0, -1.0, -2.0]
        assert (loader.stats.local, loader.stats.compiled) == (1, 0)
    store = SQLiteStore(settings.store_path)
    [entry] = store.quarantined(ns)
    assert entry.key == neg and entry.artifact.binary == bad
    assert "refused" in entry.reason
    store.close()


# ----------------------------------------------------------------------------------------
# item 12: what comes from input is escaped before it reaches a terminal
# ----------------------------------------------------------------------------------------
def test_escape_sequences_in_a_bundle_never_reach_the_terminal(tmp_path: Path) -> None:
    """Issue 19 item 12: a bundle whose manifest has a key name holding a newline and
    ESC[2J (clear the screen) had it echoed raw in the error line."""
    import io
    import tarfile

    from farm.store.bundle import MANIFEST_MEMBER, export_bundle

    settings, ns, _, _ = built_store(tmp_path)
    store = SQLiteStore(settings.store_path)
    export_bundle(store, [ns], tmp_path / "good.kfb")
    store.close()
    with tarfile.open(tmp_path / "good.kfb", "r:") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    manifest = json.loads(members[0][1])
    manifest["artifacts"][0]["meta"]["x\n\x1b[2J\x1b]0;owned\x07"] = "hostile"
    raw = json.dumps(manifest).encode()
    with tarfile.open(tmp_path / "evil.kfb", "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST_MEMBER)
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
        for member, data in members[1:]:
            tar.addfile(member, io.BytesIO(data))
    for command in ("import", "show"):
        proc = farm_cli(tmp_path / "other", "bundle", command, str(tmp_path / "evil.kfb"))
        assert proc.returncode == 2, proc.stderr
        assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr, repr(proc.stderr)
        assert proc.stderr.count("\n") == 1, repr(proc.stderr)
        assert "\\x1b[2J" in proc.stderr and "unknown field" in proc.stderr
    # a family name is free text: shown, escaped
    del manifest["artifacts"][0]["meta"]["x\n\x1b[2J\x1b]0;owned\x07"]
    manifest["artifacts"][0]["meta"]["family"] = "fam\x1b[2J"
    raw = json.dumps(manifest).encode()
    with tarfile.open(tmp_path / "named.kfb", "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST_MEMBER)
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
        for member, data in members[1:]:
            tar.addfile(member, io.BytesIO(data))
    shown = farm_cli(tmp_path / "other", "bundle", "show", str(tmp_path / "named.kfb"))
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "fam\\x1b[2J" in shown.stdout, shown.stdout


def test_printable_escapes_every_control_character() -> None:
    from farm.core.errors import printable

    hostile = "".join(chr(c) for c in [*range(32), 127, *range(0x80, 0xA0)]) + "\u2028"
    shown = printable(f"a{hostile}b", limit=10_000)
    assert shown.isprintable() and shown.startswith("a\\x00") and shown.endswith("b")
    assert len(printable("x" * 10_000)) == 500


# ----------------------------------------------------------------------------------------
# item 10: a source over the records' limit is cut in the record, never aborts a build
# ----------------------------------------------------------------------------------------
HUGE_SOURCE_FAMILY = '''
from farm.core.model import Lowered
from farm.families.base import KernelFamily, Params


class P(Params):
    n: int = 1


class Huge(KernelFamily[P]):
    """5 MiB of source: a comment the compiler skips, then a kernel."""

    name = "huge_source"
    params_model = P

    def lower(self, params, launch, device):
        pad = "/*" + "x" * (5 * 1024 * 1024) + "*/\\n"
        return Lowered(source=pad + "__kernel void huge(__global float *x) { x[0] = 1.0f; }",
                       options=("-DHUGE=" + "1" * 5000,), kernel_names=("huge",))


FAMILIES = [Huge]
'''


def test_a_source_over_the_records_limit_is_cut_in_the_record(tmp_path: Path) -> None:
    """Issue 19 item 10: at records level full a source over 4 MiB aborted the build
    after storing the artifact (the CompilationRecord's source limit)."""
    import sqlite3

    (tmp_path / "hugefam.py").write_text(HUGE_SOURCE_FAMILY)
    manifest = tmp_path / "m.toml"
    manifest.write_text('format = 1\n\n[[kernels]]\nfamily = "huge_source"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), FARM_RECORDS_LEVEL="full",
               FARM_FAMILY_MODULES='["hugefam"]', PYTHONPATH=str(tmp_path),
               PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0")
    proc = subprocess.run([sys.executable, "-m", "farm", "build", str(manifest), "--local",
                           "--workers", "0", "--json"], env=env, text=True,
                          capture_output=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["summary"]["compiled"] == 1
    conn = sqlite3.connect(tmp_path / "home" / "envs" / "default" / "records.sqlite")
    (payload,) = conn.execute("SELECT payload FROM records WHERE family='huge_source'"
                              ).fetchone()
    conn.close()
    record = json.loads(payload)
    assert len(record["source"]) <= 4 * 1024 * 1024
    assert record["source"].startswith("/*xxxx")
    assert "source cut" in record["source"][-300:] and "sha256" in record["source"][-300:]
    assert all(len(o) <= 1000 for o in record["options"])


# ----------------------------------------------------------------------------------------
# item 11: durations are bounded like the other timeouts
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("variable", "value"), [
    ("FARM_OUTAGE_LIMIT", "1e308"), ("FARM_OUTAGE_LIMIT", "1e-300"),
    ("FARM_HEARTBEAT_INTERVAL", "1e-300"), ("FARM_HEARTBEAT_INTERVAL", "1e308"),
    ("FARM_DEAD_WORKER_GRACE", "1e-300"), ("FARM_DEAD_WORKER_GRACE", "1e308"),
])
def test_durations_out_of_bounds_are_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    """Issue 19 item 11: FARM_OUTAGE_LIMIT=1e308 waited for ever, 1e-300 was accepted,
    as were FARM_HEARTBEAT_INTERVAL and FARM_DEAD_WORKER_GRACE at 1e-300."""
    from farm.core.errors import SettingsError
    from farm.core.settings import load_settings

    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=f"setting {variable}: "):
        load_settings()


def test_a_grace_no_longer_than_the_heartbeat_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker would be dead between two of its heartbeats."""
    from farm.core.errors import SettingsError
    from farm.core.settings import load_settings

    monkeypatch.setenv("FARM_HEARTBEAT_INTERVAL", "5")
    monkeypatch.setenv("FARM_DEAD_WORKER_GRACE", "5")
    with pytest.raises(SettingsError, match=r"FARM_DEAD_WORKER_GRACE: .*FARM_HEARTBEAT_INTERVAL"):
        load_settings()


def test_the_cli_refuses_an_endless_outage_limit_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_OUTAGE_LIMIT="1e308", FARM_REDIS_URL="redis://127.0.0.1:1/0")
    proc = subprocess.run([sys.executable, "-m", "farm", "workers"], text=True, env=env,
                          capture_output=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: setting FARM_OUTAGE_LIMIT: ")
    assert proc.stderr.count("\n") == 1
