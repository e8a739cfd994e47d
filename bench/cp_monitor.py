"""Redis commands by purpose, for ``bench/bench_control_plane.py --monitor``: a Redis
``MONITOR`` over the throughput phase, each command put under the farm's (or Celery's)
purpose from the key it names.

MONITOR shows every command a server runs, the commands a Lua script calls included
(``[db lua]``), as ``INFO commandstats`` counts them; ``MULTI`` and ``EXEC`` are put
under the purpose of the command they wrap (the next one of the same connection, the one
before). MONITOR costs Redis CPU itself: a monitored run's CPU figures are not the
benchmark's (its counts are).
"""

from __future__ import annotations

import collections
import re
import socket
import threading
import time
from typing import Any

#: (purpose, command names or "*", key pattern or None), first match wins
RULES: list[tuple[str, set[str] | None, re.Pattern[str] | None]] = [
    ("compile lease", None, re.compile(r"^farm:lease:")),
    ("crash ledger (task deliveries, kernel note)", None,
     re.compile(r"^farm:task:[^:]+:(deliveries|kernel|crashes)")),
    ("holder note (task received)", None, re.compile(r"^farm:task:[^:]+:holder")),
    ("chunks given back", None, re.compile(r"^farm:task:[^:]+:returns")),
    ("build heartbeat, avoid set, returns", None, re.compile(r"^farm:build:")),
    ("records streams", None, re.compile(r"^farm:records:")),
    ("worker registry, heartbeats", None, re.compile(r"^farm:workers")),
    ("results (Celery)", None, re.compile(r"^celery-task-meta-")),
    ("broker ack bookkeeping (kombu unacked)", None, re.compile(r"^unacked")),
    ("task events (Celery)", {"publish"}, re.compile(r"^celeryev")),
    ("broker queue (send, take)", {"lpush", "brpop", "rpush", "llen", "lrange"}, None),
    ("result channel (subscribe)", {"subscribe", "unsubscribe", "psubscribe"}, None),
    ("connection (hello, ping, client)", {"hello", "ping", "client", "select", "auth"}, None),
    ("kombu fanout, bindings", None, re.compile(r"^_kombu")),
]
_LINE = re.compile(r'^([0-9.]+) \[\d+ ([^\]]+)\] (.*)$')
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')


def purpose(cmd: str, args: list[str]) -> str:
    key = args[0] if args else ""
    if cmd in ("eval", "evalsha") and len(args) >= 3:
        key = args[2]
    if cmd == "mget" or cmd == "del":
        key = args[0] if args else ""
    for name, commands, pattern in RULES:
        if commands is not None and cmd not in commands:
            continue
        if pattern is not None and not pattern.search(key):
            continue
        return name
    return f"other ({cmd})"


class Monitor:
    """MONITOR on a plain socket (RESP2: one ``+...`` line per command) in a thread;
    :meth:`stop` gives (purpose, command) -> count."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        where = urlsplit(url)
        self._sock = socket.create_connection((where.hostname or "127.0.0.1",
                                               where.port or 6379))
        self._sock.sendall(b"MONITOR\r\n")
        self._file = self._sock.makefile("rb")
        if not self._file.readline().startswith(b"+OK"):
            raise RuntimeError("MONITOR refused")
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for raw in self._file:  # ends when stop() closes the socket
            if raw.startswith(b"+"):
                self.lines.append(raw[1:].rstrip(b"\r\n").decode(errors="replace"))

    def stop(self) -> collections.Counter[tuple[str, str]]:
        return classify(self.close())

    def close(self) -> list[str]:
        """Stop; the lines seen (each ``time [db connection] "command" "arg"...``)."""
        time.sleep(0.2)  # the last replies' commands
        self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)
        self._sock.close()
        return list(self.lines)


def parse(lines: list[str]) -> list[tuple[float, str, str, list[str]]]:
    """(time, connection, command in lower case, args) of MONITOR's lines."""
    out = []
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        args = [a.encode().decode("unicode_escape", errors="replace")
                for a in _ARG.findall(m.group(3))]
        if args:
            out.append((float(m.group(1)), m.group(2), args[0].lower(), args[1:]))
    return out


def classify(lines: list[str]) -> collections.Counter[tuple[str, str]]:
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    parsed = [(conn, cmd, args) for _, conn, cmd, args in parse(lines)]
    pending: dict[str, int] = {}  # connection -> MULTIs waiting for their command
    last: dict[str, str] = {}
    for conn, cmd, args in parsed:
        if cmd == "info" or cmd == "monitor":
            continue
        if cmd == "multi":
            pending[conn] = pending.get(conn, 0) + 1
            continue
        if cmd == "exec":
            counts[(last.get(conn, "other (exec)"), "exec")] += 1
            continue
        what = purpose(cmd, args)
        if conn == "lua":
            what = last.get("script", what)
        elif cmd in ("eval", "evalsha"):
            last["script"] = what
        counts[(what, cmd if conn != "lua" else f"{cmd} (in a script)")] += 1
        if pending.get(conn):
            counts[(what, "multi")] += pending.pop(conn)
        last[conn] = what
    return counts


def table(counts: collections.Counter[tuple[str, str]], kernels: int) -> dict[str, Any]:
    """purpose -> {"per_kernel": n, "commands": {command: per kernel}}, most first."""
    by: dict[str, dict[str, float]] = {}
    for (what, cmd), n in counts.items():
        by.setdefault(what, {})[cmd] = by.get(what, {}).get(cmd, 0) + n / kernels
    rows = sorted(by.items(), key=lambda kv: -sum(kv[1].values()))
    return {what: {"per_kernel": round(sum(c.values()), 3),
                   "commands": {k: round(v, 3) for k, v in sorted(c.items(),
                                                                  key=lambda kv: -kv[1])}}
            for what, c in rows}
