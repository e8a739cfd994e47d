"""Which workers serve which fingerprints: written by workers, read by build clients.

Each worker's main process refreshes one field of ``farm:workers:<fingerprint>`` (see
``farm.core.keys``) every ``FARM_HEARTBEAT_INTERVAL`` seconds with a :class:`WorkerInfo`. A
field whose heartbeat is older than the grace (``FARM_DEAD_WORKER_GRACE``) is a dead
worker and is ignored (and cleaned up); a build client re-sends the chunks it held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from farm.core.device import DeviceInfo
from farm.core.keys import WORKERS_PATTERN, workers_key
from farm.core.outage import OutageError, Waiter

if TYPE_CHECKING:
    import redis

HEARTBEAT_S = 3.0
STALE_S = 20.0
#: how a worker's log says it consumes its queues now (``worker.readiness``), followed
#: by their names; "not consuming <queues>: <why>" when it stops or cannot start
READY_LINE = "ready: consuming "


class WorkerInfo(BaseModel):
    """One running ``farm worker``. Read from Redis, so validated like any input: a
    heartbeat of Infinity would keep a fake worker "alive" for ever."""

    model_config = ConfigDict(allow_inf_nan=False)

    host: str = Field(max_length=1000)
    pid: int = Field(ge=0, le=2**63 - 1)
    fingerprint: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,99}$")
    device_name: str = Field(max_length=1000)
    processes: int = Field(ge=0, le=2**20)
    version: str = Field(max_length=100)
    queues: list[str] = Field(max_length=1024)
    heartbeat: float = Field(default=0.0, ge=0.0, le=1e11)
    #: the device's limits, so a client can tell unsupported kernels without asking
    device: DeviceInfo | None = None
    #: pids of the pool processes that compile (refreshed each beat; empty until the
    #: pool runs, or when the worker compiles in its main process)
    pool: list[int] = Field(default_factory=list, max_length=4096)
    #: whether it consumes its queues now; when not, ``why`` (a worker that cannot reach
    #: its store, or whose processes could not open their device, takes no chunk)
    ready: bool = True
    why: str = Field(default="", max_length=500)
    #: ids of the tasks it holds now (received and not done); ``None`` from a worker that
    #: does not say (a client then cannot tell a chunk the worker dropped, farm.cluster.holders)
    tasks: list[str] | None = Field(default=None, max_length=4096)

    @property
    def field(self) -> str:
        """``host:pid`` of the worker's main process: its name in the cluster's
        bookkeeping (who holds a chunk) and in ``farm workers``."""
        return f"{self.host}:{self.pid}"

    @property
    def process_names(self) -> list[str]:
        """``host:pid`` of each process that compiles: what a build's "work by worker"
        and the records name (the main process itself when it has no pool)."""
        return [f"{self.host}:{pid}" for pid in sorted(self.pool)] or [self.field]


def served(client: redis.Redis, stale_s: float = STALE_S) -> dict[str, list[WorkerInfo]]:
    """Fingerprint -> live workers serving it (ready to consume or not: see ``ready``)."""
    now = time.time()
    out: dict[str, list[WorkerInfo]] = {}
    for name in client.scan_iter(match=WORKERS_PATTERN):
        for field, raw in client.hgetall(name).items():
            try:
                info = WorkerInfo.model_validate_json(raw)
            except ValidationError:
                client.hdel(name, field)
                continue
            if now - info.heartbeat > stale_s:
                client.hdel(name, field)
                continue
            out.setdefault(info.fingerprint, []).append(info)
    return out


class Heartbeat:
    """Background thread that keeps a worker's registration fresh until stopped.

    With a ``waiter``, the first beat waits out a Redis outage (``OutageError`` past its
    limit), and later beats that keep failing past the limit call ``on_give_up`` with
    the one line to report (the worker then stops)."""

    def __init__(self, client: redis.Redis, info: WorkerInfo, *, interval_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S, waiter: Waiter | None = None,
                 on_give_up: Callable[[str], None] | None = None,
                 on_beat: Callable[[], None] | None = None) -> None:
        self._client = client
        self._info = info
        self._interval_s = interval_s
        self._stale_s = stale_s
        self._waiter = waiter
        self._on_give_up = on_give_up
        self._on_beat = on_beat  # called after each beat that reached Redis
        #: the pids of the worker's pool processes, read at each beat (set once the
        #: worker knows its pool; ``WorkerInfo.pool``)
        self.pool_of: Callable[[], list[int]] | None = None
        #: (consuming, why not) and the ids of the tasks it holds, read at each beat
        #: (``WorkerInfo.ready``, ``why``, ``tasks``; set by the worker that knows them)
        self.status_of: Callable[[], tuple[bool, str]] | None = None
        self.tasks_of: Callable[[], list[str] | None] | None = None
        self._stop = threading.Event()
        self._watched: float | None = None
        self._gave_up = False
        self._give_up_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="farm-heartbeat")

    def start(self) -> None:
        if self._waiter is not None:
            self._waiter.call(self._beat)
        else:
            self._beat()
        self._thread.start()

    def _beat(self) -> None:
        update: dict[str, object] = {"heartbeat": time.time()}
        if self.pool_of is not None:
            update["pool"] = self.pool_of()
        if self.status_of is not None:
            ready, why = self.status_of()
            update["ready"], update["why"] = ready, why[:500]
        held = self.tasks_of() if self.tasks_of is not None else None
        update["tasks"] = held[:4096] if held is not None else None
        info = self._info.model_copy(update=update)
        name = workers_key(info.fingerprint)
        self._client.hset(name, info.field, info.model_dump_json())
        self._client.expire(name, int(max(self._stale_s * 4, 60)))
        if self._on_beat is not None:
            self._on_beat()

    def _run(self) -> None:
        while not self._stop.wait(self._pause()):
            started = time.monotonic()
            try:
                self._beat()
            except Exception as exc:  # Redis away for a moment: beat again later
                if self._waiter is None:
                    continue
                try:
                    self._waiter.check(exc, started)
                except OutageError as gone:
                    self._give_up(str(gone))
                    return
                self._watch()
                continue
            if self._waiter is not None:
                self._waiter.mark_up()

    def _watch(self) -> None:
        """Give up when the outage reaches its limit, even while a beat is blocked on a
        frozen Redis (up to a socket timeout): a timer at the outage's start + limit."""
        assert self._waiter is not None
        since = self._waiter.down_since
        if since is None or since == self._watched:
            return
        self._watched = since
        delay = max(0.0, since + self._waiter.limit_s - time.monotonic())
        timer = threading.Timer(delay, self._deadline, (since,))
        timer.daemon = True
        timer.start()

    def _deadline(self, since: float) -> None:
        if self._waiter is not None and self._waiter.down_since == since \
                and not self._stop.is_set():
            self._give_up(self._waiter.gave_up_line())

    def _give_up(self, line: str) -> None:
        with self._give_up_lock:
            if self._gave_up:
                return
            self._gave_up = True
        if self._on_give_up is not None:
            self._on_give_up(line)

    def _pause(self) -> float:
        """Seconds to the next beat: the interval, or at most 1 s while Redis is away,
        so that giving up past the limit is not late by an interval."""
        if self._waiter is not None and self._waiter.down:
            return min(self._interval_s, 1.0)
        return self._interval_s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self._client.hdel(workers_key(self._info.fingerprint), self._info.field)
        except Exception:  # best effort on the way out
            pass
