"""What a cluster client's first chunk pays to send, with its Celery app made at the send
or ahead (``ClusterClient(ahead=True)``, what ``farm build --cluster`` does).

    .venv/bin/python bench/probe_first_send.py [--rounds 5]

Each round a fresh process per case, on a Redis of its own (``farm.devservices``): the
client is made, asks Redis (a ping, as a build asks which workers serve) and opens a
recorder, then sends one task; printed: the time to that point and the send's, medians
over the rounds. Nothing is asserted: it is a probe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from farm.cluster.client import ClusterClient
from farm.cluster.gather import TASK_NAME
from farm.core.settings import load_settings
from farm.records.open import open_recorder
settings = load_settings()
client = ClusterClient(settings, ahead=sys.argv[1] == "ahead")
client.redis.ping()
recorder = open_recorder(settings, "probe first send")
t1 = time.perf_counter()
client.app.send_task(TASK_NAME, args=[{}], queue="probe-first-send", ignore_result=True)
t2 = time.perf_counter()
recorder.close()
client.close()
print(json.dumps({"before_s": t1 - t0, "send_s": t2 - t1}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from farm.devservices.redis import RedisServer

    with tempfile.TemporaryDirectory(prefix="probe-first-send-") as tmp, \
            RedisServer(Path(tmp) / "redis") as redis:
        env = {**os.environ, "FARM_REDIS_URL": redis.url, "FARM_HOME": str(Path(tmp) / "home")}
        rows: dict[str, list[dict[str, float]]] = {"at the send": [], "ahead": []}
        for _ in range(args.rounds):
            for case in rows:
                out = subprocess.run([sys.executable, "-c", CHILD, case], env=env, check=True,
                                     capture_output=True, text=True).stdout
                rows[case].append(json.loads(out.strip().splitlines()[-1]))
        for case, got in rows.items():
            before = statistics.median(r["before_s"] for r in got) * 1000
            send = statistics.median(r["send_s"] for r in got) * 1000
            print(f"{case:12} client made to first send {before:7.1f} ms, first send "
                  f"{send:6.1f} ms (median of {len(got)})")
        print(json.dumps({"bench": "first_send", "at": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                     time.gmtime()),
                          "rows": rows}))


if __name__ == "__main__":
    main()
