"""Benchmark: what one request costs MinIO's CPU, and the client's, by size and headers.

A compiled kernel writes two objects (its source-index entry, about 80 bytes, and its
artifact, about 32 KiB), and MinIO's CPU a kernel is the control plane's largest
(docs/BENCHMARKS.md, "Where a kernel's control-plane cost goes"): this says what each
costs and what would change it. One MinIO started here (``farm.devservices``, as
``farm cluster up`` starts it: one drive, its defaults), one client thread, ``--count``
requests per case, on one kept connection; MinIO's CPU from ``/proc/<pid>/stat`` (user +
system), the client's from ``time.thread_time``, the wall per request. Cases:

* PUTs through :class:`farm.store.s3_put.S3Writer` (the workers' writes): 80 B, 1 KiB,
  32 KiB, 128 KiB, 1 MiB, plain; 80 B and 32 KiB with ``If-None-Match: *`` (the claim,
  the artifact's write); 32 KiB with the artifact's nine ``x-amz-meta-farm-*`` headers
  too (what a worker sends); a conditional PUT refused (412: the name taken);
* the same 32 KiB conditional PUT through the SDK (``Minio._put_object``), for the
  client's side;
* GETs through the SDK: of a 32 KiB object, of a missing one (404).

    .venv/bin/python bench/bench_minio_put.py --count 500

Prints one JSON line per case and a table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

META = {f"x-amz-meta-farm-{k}": v for k, v in (
    ("format", "KFART1"), ("digest", "a" * 64), ("size", "32768"), ("build", "b" * 16),
    ("source", "c" * 64), ("family", "sim_compile"), ("host", "gpu-host-017"),
    ("worker", "gpu-host-017:12345"), ("work", "0.005012"))}


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(label: str, count: int, pid: int, one: Callable[[int], Any]) -> dict[str, Any]:
    one(-1)  # warm: the connection, the first object of a prefix
    server0, client0, wall0 = proc_cpu(pid), time.thread_time(), time.perf_counter()
    for i in range(count):
        one(i)
    server = proc_cpu(pid) - server0
    client = time.thread_time() - client0
    wall = time.perf_counter() - wall0
    return {"bench": "minio_request", "case": label, "count": count,
            "minio_cpu_ms": round(1000 * server / count, 3),
            "client_cpu_ms": round(1000 * client / count, 3),
            "wall_ms": round(1000 * wall / count, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=500, help="requests per case")
    args = parser.parse_args()
    from minio import Minio
    from minio.error import S3Error

    from farm.devservices import MinioServer
    from farm.store.s3_put import S3Writer

    rows = []
    with tempfile.TemporaryDirectory(prefix="farm-bench-minio-") as tmp, \
            MinioServer(Path(tmp)) as server:
        pid = server._process.pid  # type: ignore[union-attr]
        bucket = "bench-minio-put"
        sdk = Minio(server.endpoint, server.access_key, server.secret_key, secure=False,
                    region="us-east-1")
        sdk.make_bucket(bucket)
        writer = S3Writer(server.endpoint, False, server.access_key, server.secret_key,
                          bucket)

        def put(prefix: str, size: int, headers: dict[str, str]) -> Callable[[int], Any]:
            body = os.urandom(size)
            return lambda i: writer.put(f"{prefix}/{i}", body, headers)

        cond = {"If-None-Match": "*"}
        octet = {"Content-Type": "application/octet-stream"}
        cases: list[tuple[str, Callable[[int], Any]]] = [
            ("PUT 80 B", put("p80", 80, {})),
            ("PUT 1 KiB", put("p1k", 1024, {})),
            ("PUT 32 KiB", put("p32k", 32768, {})),
            ("PUT 128 KiB", put("p128k", 128 << 10, {})),
            ("PUT 1 MiB", put("p1m", 1 << 20, {})),
            ("PUT 80 B, If-None-Match (a claim)", put("c80", 80,
                                                      {"Content-Type": "text/plain", **cond})),
            ("PUT 32 KiB, If-None-Match", put("c32k", 32768, {**octet, **cond})),
            ("PUT 32 KiB, If-None-Match, 9 metadata (an artifact)",
             put("a32k", 32768, {**octet, **META, **cond})),
        ]
        taken = os.urandom(80)
        writer.put("taken", taken, {})

        def refused(_: int) -> None:
            try:
                writer.put("taken", taken, cond)
            except S3Error as exc:
                assert exc.code == "PreconditionFailed", exc
        cases.append(("PUT refused (412)", refused))
        body = os.urandom(32768)
        headers: dict[str, str | list[str] | tuple[str]] = {**octet, **META, **cond}
        cases.append(("PUT 32 KiB, If-None-Match, 9 metadata, through the SDK",
                      lambda i: sdk._put_object(bucket, f"s32k/{i}", body, dict(headers))))

        def get(name: str) -> Callable[[int], Any]:
            def one(_: int) -> None:
                try:
                    response = sdk.get_object(bucket, name)
                except S3Error as exc:
                    assert exc.code == "NoSuchKey", exc
                    return
                response.read()
                response.close()
                response.release_conn()
            return one
        sdk.put_object(bucket, "g32k", io.BytesIO(body), len(body))
        cases += [("GET 32 KiB (SDK)", get("g32k")), ("GET missing (SDK)", get("missing"))]
        for label, one in cases:
            row = measure(label, args.count, pid, one)
            rows.append(row)
            print(json.dumps(row), flush=True)
        writer.close()
    print(f"\n{'case':55} {'MinIO CPU ms':>12} {'client CPU ms':>13} {'wall ms':>8}")
    for r in rows:
        print(f"{r['case']:55} {r['minio_cpu_ms']:>12.3f} {r['client_cpu_ms']:>13.3f} "
              f"{r['wall_ms']:>8.2f}")


if __name__ == "__main__":
    main()
