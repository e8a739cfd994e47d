"""The client's circuit breaker: a worker whose chunks all go back is sent no more of
this build's chunks.

A worker gives a chunk back when it cannot build it for reasons that are not the
kernels' (``worker.chunks``; ``farm:build:<token>:returns`` says who, how often, and
why).
The worker pauses itself after a few in a row (``worker.readiness``), but a worker that
keeps answering its readiness probe (a store that lets it read, not write) would take
the build's chunks again after each pause, compile them, and give them back. So the
client keeps count for its build: a worker with ``TRIP_AFTER`` chunks given back and
none built, while another worker has built this build's chunks (so the fault is that
worker's, not the cluster's: a cluster-wide outage must never shut every worker out),
is put in the build's avoid set (``farm:build:<token>:avoid``), and the client says so
in one line. A worker finds itself there when it takes one of the build's chunks, and
gives it back at once, without compiling (and without counting a return).

Why not route around it instead: chunks go to the fingerprint's one queue, which every
worker of the pool consumes; the avoid set is the one thing a client can say to a worker
it cannot address.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from farm.core.keys import RETURNS_WHY

#: chunks given back, none built, before the client stops sending to a worker
TRIP_AFTER = 3


@dataclass
class Breaker:
    """Counts, per worker (``host:pid``), this build's chunks built and given back."""

    returns: dict[str, int] = field(default_factory=dict)
    built: Counter[str] = field(default_factory=Counter)
    why: dict[str, str] = field(default_factory=dict)
    tripped: set[str] = field(default_factory=set)

    def saw_returns(self, raw: dict[Any, Any]) -> None:
        """The build's returns hash (``farm:build:<token>:returns``, kept by
        ``worker.chunks``): worker -> chunks given back, ``why:<worker>`` -> reason."""
        for name, value in raw.items():
            key = name.decode() if isinstance(name, bytes) else str(name)
            text = value.decode() if isinstance(value, bytes) else str(value)
            if key.startswith(f"{RETURNS_WHY}:"):
                self.why[key.removeprefix(f"{RETURNS_WHY}:")] = text
            elif text.isdigit():
                self.returns[key] = int(text)

    def saw_built(self, worker: str) -> None:
        """A chunk of this build was built by ``worker`` (its holder)."""
        if worker:
            self.built[worker] += 1

    def trip(self) -> list[str]:
        """The workers to shut out now (each once), see the module docstring."""
        someone_builds = any(n > 0 for w, n in self.built.items() if w not in self.tripped)
        if not someone_builds:
            return []
        now = [w for w, n in self.returns.items()
               if n >= TRIP_AFTER and not self.built[w] and w not in self.tripped]
        self.tripped.update(now)
        return now

    def line(self, worker: str) -> str:
        return (f"sending no more of this build's chunks to worker {worker}: its "
                f"{self.returns[worker]} chunk(s) all went back for infrastructure "
                f"reasons ({self.why.get(worker, 'no reason given')})")
