"""A store outage inside a served application (issue 30, item 4): one warning line, the
documented bound (docs/PYOPENCL.md: an application waits at most 2 s for the store, then
builds the plain way for the rest of the run), the setting that names the store, and the
failure's text whole.

A real MinIO is frozen (SIGSTOP: it accepts connections and answers nothing) or stopped
between an application's first build and its second, on a fresh node (an empty local
tier), through the quick path (``FARM_POCL_READY=0``: no work-group records) and through
the program server (PoCL's records); the first build was served from MinIO. The node
runs a copy of the application (one comment more): the same programs, but no plan of
its own in the store, so no prover ahead fetches them before the outage
(:mod:`farm.programs.ahead`; that path is tests/test_quick_trust.py's).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from farm.devservices import MinioServer
from farm.programs.rows import APP_OUTAGE_LIMIT_S

pytestmark = pytest.mark.integration

APP = Path(__file__).parent / "apps" / "app_outage.py"
#: what a loaded machine may add to the stall's own time, in seconds (the bound is on
#: the farm's wait: the line reports it)
SLACK_S = 1.0


@pytest.mark.parametrize("outage", ["freeze", "halt"])
@pytest.mark.parametrize("ready", ["0", "1"])
def test_an_outage_mid_run_is_one_line_within_the_bound(tmp_path: Path, outage: str,
                                                        ready: str) -> None:
    with MinioServer(workdir=tmp_path) as minio:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
        env.update(FARM_MINIO_ENDPOINT=minio.endpoint, FARM_MINIO_ACCESS_KEY=minio.access_key,
                   FARM_MINIO_SECRET_KEY=minio.secret_key, FARM_MINIO_BUCKET="outage",
                   PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0", FARM_POCL_READY=ready)
        filler = tmp_path / "filler"
        filler.mkdir()
        (filler / "go").write_text("")
        subprocess.run([sys.executable, "-m", "farm", "run", "--", sys.executable, str(APP),
                        str(filler)], env={**env, "FARM_HOME": str(tmp_path / "h1")},
                       check=True, capture_output=True, timeout=600)
        node = tmp_path / "node"
        node.mkdir()
        app = tmp_path / "app_node.py"  # another application's digest: no plan stored
        app.write_text(APP.read_text() + "\n# the node's copy\n")
        counts = tmp_path / "counts.json"
        proc = subprocess.Popen(
            [sys.executable, "-m", "farm", "run", "--json", str(counts), "--",
             sys.executable, str(app), str(node)], env={**env, "FARM_HOME": str(tmp_path / "h2")},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not (node / "ready").exists() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        getattr(minio, outage)()
        (node / "go").write_text("")
        out, err = proc.communicate(timeout=300)
        if outage == "freeze":
            minio.thaw()
    assert proc.returncode == 0, out + err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1, err
    line = warnings[0]
    assert line.endswith("this run's programs are built the plain way from now on"), line
    assert "FARM_MINIO_ENDPOINT" in line and "FARM_OUTAGE_LIMIT" not in line, line
    waited = float(re.search(r"unreachable for ([0-9.]+) s", line).group(1))  # type: ignore[union-attr]
    assert waited <= APP_OUTAGE_LIMIT_S, line
    times = json.loads(out)
    assert times["second"] - times["third"] <= APP_OUTAGE_LIMIT_S + SLACK_S, (times, line)
    assert json.loads(counts.read_text()) == {"programs": 3, "loaded": 1, "compiled": 0,
                                              "fallbacks": 2, "failed": 0}
