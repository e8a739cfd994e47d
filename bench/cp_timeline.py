"""Where a kernel's added latency goes, for ``bench/bench_control_plane.py --timeline``:
a Redis ``MONITOR`` over the latency phase, each chunk's commands found by its task id,
and the chunk's time cut at them.

Every step of a chunk's way leaves a command in Redis, stamped by Redis's clock (the
host's: the clients stamp their sends and arrivals with the same clock, ``time.time``):

* ``LPUSH`` of its message (the client's publish; its headers name the task id);
* the farm: the holder note (``SET farm:task:<id>:holder``: Celery's consumer has it),
  the pool process's first round trip (``SET farm:task:<id>:kernel``, with the leases),
  the chunk's records (``XADD farm:records:...``: the last pack that names one of the
  keys its reply names, before that reply), its reply (``XADD
  farm:build:<token>:replies ... task <id>``);
* bare Celery: its result (``SETEX`` or ``PUBLISH`` of ``celery-task-meta-<id>``).

So a chunk's added latency splits into: the client's publish (send to ``LPUSH``), the
broker to the consumer (``LPUSH`` to the holder note: the ``BRPOP``'s wake-up, kombu and
Celery's consumer), the consumer to the pool process (the holder note's round trip, the
hand-over, the pool process's prologue), the pool process before its store writes (less
the chunk's compiles), the store writes, and the reply to the client (the reply stream's
read, or the result's pub/sub). Each is printed at p50 and p99 over the chunks.
MONITOR costs Redis CPU: a run with it measures where the time goes, not the benchmark's
figures.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import cp_monitor

_TASK_ID = re.compile(r'"id": "([0-9a-f-]{36})"')
#: an artifact's key in a records pack or a reply (``<id_hash>.<build_id>``)
_KEY = re.compile(r'"key":\s*"([0-9a-f]+\.[0-9a-f]+)"')

#: the segments, in order: (name, from event, to event)
FARM = [("client publish", "sent", "lpush"), ("broker to consumer", "lpush", "holder"),
        ("consumer to pool process", "holder", "begin"),
        ("pool process, less compiles", "begin", "records"),
        ("store writes", "records", "reply"), ("reply to client", "reply", "arrived")]
BARE = [("client publish", "sent", "lpush"),
        ("broker, pool, task, less its sleep", "lpush", "result"),
        ("result to client", "result", "arrived")]


def events(commands: list[tuple[float, str, str, list[str]]]) -> dict[str, dict[str, float]]:
    """task id -> event -> time (the first of each), from the commands."""
    found: dict[str, dict[str, float]] = defaultdict(dict)
    keys_of: dict[str, list[str]] = {}  # task id -> the keys its reply names
    packs: dict[str, list[float]] = defaultdict(list)  # key -> its records packs' times
    for at, _conn, cmd, args in commands:
        key = args[0] if args else ""
        if cmd == "lpush" and len(args) > 1:
            m = _TASK_ID.search(args[1])
            if m:
                found[m.group(1)].setdefault("lpush", at)
        elif key.startswith("farm:task:") and cmd == "set":
            task, what = key.split(":")[2], key.split(":")[3]
            if what == "holder":
                found[task].setdefault("holder", at)
            elif what == "kernel":
                found[task].setdefault("begin", at)
        elif cmd == "xadd" and key.startswith("farm:records:"):
            for named in _KEY.findall(" ".join(args)):
                packs[named].append(at)
        elif cmd == "xadd" and key.endswith(":replies") and "task" in args:
            task = args[args.index("task") + 1]
            found[task].setdefault("reply", at)
            keys_of[task] = _KEY.findall(" ".join(args))
        elif key.startswith("celery-task-meta-") and cmd in ("setex", "set", "publish"):
            found[key.removeprefix("celery-task-meta-")].setdefault("result", at)
    for task, keys in keys_of.items():  # the last pack before the last write
        reply = found[task]["reply"]
        before = [t for k in keys for t in packs.get(k, []) if t <= reply]
        if before:
            found[task]["records"] = max(before)
    return found


def split(lines: list[str], chunks: list[dict[str, Any]], compiles_s: float, *,
          bare: bool) -> dict[str, Any]:
    """Segment -> {"p50": ms, "p99": ms, "n": chunks} over ``chunks`` (each: ``task``,
    ``sent``, ``arrived``, wall clock; ``first``: a client's first chunk), from the
    MONITOR ``lines``. A client's first chunks are kept apart (``first chunk...``): their
    publish pays the client's one-time costs (its broker connection, kombu's
    declarations, imports), which is what a p99 over few chunks otherwise shows."""
    found = events(cp_monitor.parse(lines))
    steps = BARE if bare else FARM
    values: dict[str, list[float]] = defaultdict(list)
    for chunk in chunks:
        ev = dict(found.get(chunk["task"], {}), sent=chunk["sent"], arrived=chunk["arrived"])
        if any(a not in ev or b not in ev for _, a, b in steps):
            continue
        total = 1000 * (ev["arrived"] - ev["sent"] - compiles_s)
        if chunk.get("first"):
            values["first chunk of a client: all"].append(total)
            values["first chunk of a client: client publish"].append(
                1000 * (ev["lpush"] - ev["sent"]))
            continue
        for name, a, b in steps:
            less = compiles_s if name.endswith(("less compiles", "less its sleep")) else 0.0
            values[name].append(1000 * (ev[b] - ev[a] - less))
        values["all, first chunks apart"].append(total)
    return {name: {"p50": round(_pct(v, 0.5), 2), "p99": round(_pct(v, 0.99), 2),
                   "n": len(v)} for name, v in values.items()}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
