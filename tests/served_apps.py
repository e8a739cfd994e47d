"""A small pyopencl application served through ``farm run``, and hostile stored bytes
made from what a served run stored: shared by the tests of the trust rule for programs
and work-group records (tests/test_program_trust.py, tests/test_program_records.py).

The hostile variants are made from the artifacts a real run stored, whatever their
layout (a program's body, ``farm.programs.body``, is read here with ``struct`` alone, so
that the same tests can be run against an older farm whose programs were bare binaries:
each test fails there for the reason its issue item names).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.core.keys import Namespace
from farm.core.model import Artifact

#: one kernel, doubling; ``FACTOR`` and ``NAME`` are replaced to make other programs
SOURCE = ("__kernel void NAME(__global float *a) "
          "{ int i = get_global_id(0); a[i] = FACTOR * a[i]; }\n")

APP = """
import sys
import numpy as np
import pyopencl as cl
source, name, factor = open(sys.argv[1]).read(), sys.argv[2], float(sys.argv[3])
locals_ = [int(x) for x in sys.argv[4].split(",")]
ctx = cl.Context([next(d for p in cl.get_platforms() if "Portable" in p.name
                      for d in p.get_devices())])
q = cl.CommandQueue(ctx)
prg = cl.Program(ctx, source).build()
ok = True
for local in locals_:
    x = np.arange(4096, dtype=np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=x)
    getattr(prg, name)(q, (4096,), (local,), buf)
    out = np.empty_like(x)
    cl.enqueue_copy(q, out, buf)
    ok = ok and bool(np.array_equal(out, factor * np.arange(4096, dtype=np.float32)))
print("OK" if ok else "MISMATCH")
"""


def source(name: str = "twice", factor: int = 2) -> str:
    return SOURCE.replace("NAME", name).replace("FACTOR", f"{factor}.0f")


@dataclass(frozen=True)
class Run:
    """One served run: its exit status, whether its values were right, its counts and
    the farm's warning lines."""

    returncode: int
    ok: bool
    counts: dict[str, int]
    stderr: str

    @property
    def warnings(self) -> list[str]:
        return [line for line in self.stderr.splitlines()
                if line.startswith("kernel-farm: warning")]


def env(home: Path, cache: Path, minio: Any = None, bucket: str = "",
        **extra: str) -> dict[str, str]:
    """A node: its own farm home and PoCL cache folder, MinIO when given."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "POCL_"))}
    cache.mkdir(parents=True, exist_ok=True)
    out.update(FARM_HOME=str(home), POCL_CACHE_DIR=str(cache), PYOPENCL_NO_CACHE="1",
               POCL_KERNEL_CACHE="0", **extra)
    if minio is not None:
        out.update(FARM_MINIO_ENDPOINT=minio.endpoint, FARM_MINIO_ACCESS_KEY=minio.access_key,
                   FARM_MINIO_SECRET_KEY=minio.secret_key, FARM_MINIO_BUCKET=bucket)
    return out


def run(root: Path, node_env: dict[str, str], *, name: str = "twice", factor: int = 2,
        locals_: str = "16", program: str | None = None) -> Run:
    """``farm run`` of the application building ``program`` (default: ``source(name,
    factor)``) and launching kernel ``name`` at each local size of ``locals_``."""
    src = root / f"src-{name}-{factor}.cl"
    src.write_text(program if program is not None else source(name, factor))
    app = root / "app.py"
    app.write_text(APP)
    counts = root / "counts.json"
    counts.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "farm", "run", "--json", str(counts), "--",
         sys.executable, str(app), str(src), name, str(factor), locals_],
        env=node_env, capture_output=True, text=True, timeout=600, check=False)
    return Run(proc.returncode, "OK" in proc.stdout,
               json.loads(counts.read_text()) if counts.exists() else {}, proc.stderr)


# -- stored bytes ---------------------------------------------------------------------------
BODY_MAGIC = b"KFPROG01"


def device_binary(data: bytes) -> bytes:
    """The device binary of a stored program (its body's, or the bytes themselves)."""
    if not data.startswith(BODY_MAGIC):
        return data
    (size,) = struct.unpack_from(">I", data, 8)
    return data[12 + size:]


def body_header(data: bytes) -> dict[str, Any]:
    (size,) = struct.unpack_from(">I", data, 8)
    header: dict[str, Any] = json.loads(data[12:12 + size])
    return header


def with_binary(art: Artifact, binary: bytes, *, log: str | None = None) -> Artifact:
    """``art`` (a stored program) holding ``binary`` instead, in its own layout, its
    digest and size made to match; ``log``: its build log replaced too."""
    data = binary
    meta_log = art.meta.build_log
    if art.binary.startswith(BODY_MAGIC):
        header = body_header(art.binary)
        if log is not None:
            header["log"] = log
        raw = json.dumps(header).encode()
        data = BODY_MAGIC + struct.pack(">I", len(raw)) + raw + binary
    elif log is not None:
        meta_log = log
    return Artifact.create(art.meta.key, art.meta.family, data, art.meta.source_hash,
                           build_log=meta_log)


def under_key(art: Artifact, other: Artifact) -> Artifact:
    """``other``'s stored bytes (another program's, valid) under ``art``'s key."""
    return Artifact.create(art.meta.key, art.meta.family, other.binary, art.meta.source_hash,
                           build_log=other.meta.build_log)


def stored(home: Path, family: str = "program") -> list[tuple[Namespace, Artifact]]:
    """Every artifact of ``family`` in a node's local tier."""
    from farm.core.settings import Settings
    from farm.store.sqlite import SQLiteStore

    store = SQLiteStore(Settings(home=home).store_path)
    try:
        return [(ns, art) for ns in store.namespaces() for key in store.keys(ns)
                if (art := store.get(ns, key)) is not None and art.meta.family == family]
    finally:
        store.close()


def put_local(home: Path, ns: Namespace, art: Artifact, *, replace: bool = True) -> None:
    """Put ``art`` into a node's local tier, replacing what its key holds."""
    from farm.core.settings import Settings
    from farm.store.sqlite import SQLiteStore

    store = SQLiteStore(Settings(home=home).store_path)
    try:
        if replace:
            store.delete(ns, art.meta.key)
        store.put(ns, art)
    finally:
        store.close()


def flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x10
    return bytes(out)


# -- records, in the layout of the farm under test (format 2; format 1 before issue 29) ----
def record_bytes(program: Any, base: str, device: str, functions: dict[tuple[str, str], bytes],
                 launches: dict[tuple[str, str], Any] | None = None) -> bytes:
    from farm.programs import supplements

    if supplements.MAGIC == b"KFWGSUP1":  # an older farm: no device, no launches
        return bytes(supplements.encode(program, base, functions))  # type: ignore[arg-type]
    return supplements.encode(program, base, device, functions, launches)


def record_functions(data: bytes, program: Any, base: str, device: str,
                     kernels: frozenset[str]) -> dict[tuple[str, str], bytes]:
    from farm.programs import supplements

    if supplements.MAGIC == b"KFWGSUP1":
        return dict(supplements.decode(data, program, base, kernels))  # type: ignore[arg-type]
    return supplements.decode(data, program, base, device, kernels).functions
