"""Draw docs/timeline-example.html and .png: the timeline of a real cluster build.

Starts a local cluster (Redis, MinIO, two ``farm worker --concurrency 1`` processes and
an ingester writing the records into SQLite), and builds ``tiny`` while another client
builds six of its kernels: where both ask for a kernel at once, a worker waits for the
other's compile and loads it (Loaded bars of a few milliseconds among the compiles).
Then ``farm records timeline latest`` writes the page and the picture of ``tiny``, and
Debian's chromium renders the picture 800 pixels wide for viewers that do not open HTML
(``chromium --headless --screenshot``).

Usage: ``.venv/bin/python scripts/timeline_picture.py [DOCS_FOLDER]`` (a minute or two
on 2 cores).
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from farm.devservices.cluster import local_cluster

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 800


def first_kernels(count: int, path: Path) -> Path:
    """The first ``count`` kernels of ``tiny`` as a manifest of their own."""
    tiny = tomllib.loads((ROOT / "farm" / "manifests" / "tiny.toml").read_text())
    lines = ["format = 1", 'name = "warm"', ""]
    plain = [k for k in tiny["kernels"] if set(k) <= {"family", "params"}]  # no launch
    for kernel in plain[:count]:
        params = ", ".join(f"{k} = {v!r}".replace("'", '"')
                           for k, v in kernel.get("params", {}).items())
        lines += ["[[kernels]]", f'family = "{kernel["family"]}"',
                  f"params = {{ {params} }}", ""]
    path.write_text("\n".join(lines))
    return path


def records_of(url: str, sessions: int, timeout: float = 60.0) -> None:
    """Wait until the ingester has written ``sessions`` sessions."""
    path = url.removeprefix("sqlite:///")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with sqlite3.connect(path) as conn:
                if conn.execute("SELECT count(*) FROM sessions").fetchone()[0] >= sessions:
                    time.sleep(2)  # the last records of the last session
                    return
        except sqlite3.Error:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the ingester wrote fewer than {sessions} sessions into {path}")


def main(docs: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="farm-timeline-") as tmp, \
            local_cluster(Path(tmp)) as cluster:
        url = f"sqlite:///{Path(tmp) / 'records.sqlite'}"
        for _ in range(2):
            cluster.start_worker(concurrency=1)
        cluster.start_ingester(url)
        cluster.wait_ready()
        env = cluster.env(Path(tmp) / "client")
        farm = [sys.executable, "-m", "farm"]
        warm = first_kernels(6, Path(tmp) / "warm.toml")
        other = subprocess.Popen([*farm, "build", str(warm), "--cluster", "--json"],
                                 env=env, stdout=subprocess.DEVNULL)
        time.sleep(0.5)  # tiny's session is the newer: `latest`
        subprocess.run([*farm, "build", "tiny", "--cluster", "--json"], env=env,
                       stdout=subprocess.DEVNULL, check=True)
        if other.wait(timeout=600) != 0:
            raise SystemExit("the other build failed")
        records_of(url, sessions=2 + 2)  # two builds, two workers
        reader = {**env, "FARM_RECORDS_URL": url}
        for name in ("timeline-example.html", "timeline.svg"):
            subprocess.run([*farm, "records", "timeline", "latest", "-o",
                            str(Path(tmp) / name)], env=reader, check=True)
        shutil.copy(Path(tmp) / "timeline-example.html", docs / "timeline-example.html")
        svg = (Path(tmp) / "timeline.svg").read_text()
        height = int(float(svg.split('viewBox="0 0 ')[1].split('"')[0].split()[1])
                     * WIDTH / 1000) + 1
        subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--screenshot={docs / 'timeline-example.png'}",
                        f"--window-size={WIDTH},{height}", str(Path(tmp) / "timeline.svg")],
                       check=True, capture_output=True)
    print(f"timeline pictures: {docs / 'timeline-example.html'}, "
          f"{docs / 'timeline-example.png'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs")
