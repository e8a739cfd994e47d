"""Outages past the limit: one line, and an end within the limit's bound.

docs/RELIABILITY.md, "Redis down longer than the limit". Real Redis, MinIO, a worker
building a client's chunks, and that client, as separate processes; Redis frozen
(SIGSTOP), killed (SIGKILL) or stopped (SIGTERM) and left away past a short outage
limit. The worker and the client each print one ``error:`` line and exit 1, within
the limit plus one socket timeout of the first failure (the outage clock starts when the
first failed attempt began, and a frozen Redis answers nothing, so only a socket timeout
tells), and the worker logs no retry storm.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import write_manifest

from farm.devservices import MinioServer, RedisServer
from farm.devservices.cluster import local_cluster
from farm.devservices.server import LocalServer

pytestmark = pytest.mark.integration

LIMIT_S = 4.0
SOCKET_S = 1.0
ENV = {"FARM_OUTAGE_LIMIT": f"{LIMIT_S:g}", "FARM_SOCKET_TIMEOUT": f"{SOCKET_S:g}",
       "FARM_CHUNK_SIZE": "1", "FARM_HEARTBEAT_INTERVAL": "0.5",
       "FARM_DEAD_WORKER_GRACE": "3", "FARM_LEASE_TTL": "5"}
#: what the end may take beyond the limit: a socket timeout, the heartbeat's look, and a
#: loaded two-core machine's scheduling (the bug was the limit plus 10 s per attempt,
#: and 35 s of Celery's result retries)
SLACK_S = SOCKET_S + 4.0
FAULTS = {"sigstop": (LocalServer.freeze, LocalServer.thaw),
          "sigkill": (LocalServer.kill, LocalServer.resume),
          "sigterm": (LocalServer.halt, LocalServer.resume)}


@pytest.fixture(scope="module")
def minio_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MinioServer]:
    with MinioServer(tmp_path_factory.mktemp("minio")) as server:
        yield server


@pytest.mark.parametrize("fault", list(FAULTS))
def test_past_the_limit_worker_and_client_say_one_line_and_exit(
        minio_own: MinioServer, tmp_path: Path, fault: str) -> None:
    with RedisServer(tmp_path / "redis") as redis, \
            local_cluster(tmp_path, redis=redis, minio=minio_own,
                          bucket=f"t-{uuid.uuid4().hex[:12]}", **ENV) as c:
        worker = c.start_worker()
        c.wait_ready()
        manifest = write_manifest(tmp_path / "m.toml", salt=61, count=12)
        client = subprocess.Popen([sys.executable, "-m", "farm", "build", str(manifest),
                                   "--cluster", "--json"], env=c.env(tmp_path / "client"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while worker.log.read_text(errors="replace").count("chunk ") < 1:
            assert time.monotonic() < deadline, worker.log.read_text(errors="replace")
            time.sleep(0.05)
        lines_before = worker.log.read_text(errors="replace").count("\n")
        failed_at = time.monotonic()
        FAULTS[fault][0](redis)
        try:
            rc = worker.process.wait(timeout=60)
            worker_took = time.monotonic() - failed_at
            _, err = client.communicate(timeout=60)
            client_took = time.monotonic() - failed_at
        finally:
            FAULTS[fault][1](redis)
        assert rc == 1 and client.returncode == 1, err
        after = worker.log.read_text(errors="replace").splitlines()[lines_before:]
        said = [line for line in after if "error: Redis at 127.0.0.1" in line]
        assert len(said) == 1 and f"more than {LIMIT_S:g} s" in said[0], after
        assert not any("Traceback" in line for line in after), after
        assert sum("Retrying" in line for line in after) <= 1, after  # Celery's, once
        assert len(after) <= 12, after  # a waiting line, a consumer line or two, the end
        [client_line] = [line for line in err.splitlines() if line.startswith("error:")]
        assert "Redis at 127.0.0.1" in client_line and "Traceback" not in err
        assert worker_took < LIMIT_S + SLACK_S, (worker_took, after)
        assert client_took < LIMIT_S + SLACK_S, (client_took, err)
        print(f"{fault}: worker exited after {worker_took:.1f} s, client after "
              f"{client_took:.1f} s (limit {LIMIT_S:g} s)")
