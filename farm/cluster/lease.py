"""In-flight deduplication: a lease in Redis per (namespace, source hash).

Two builds that overlap ask the workers for the same kernels at once. The first worker
to take the lease compiles; the others wait until the lease is gone and then find the
artifact in the store. The lease has a time-to-live that a background thread renews
while the compile runs, so a worker that dies gives its lease up by simply expiring.

A worker takes the leases of a whole chunk at once (:class:`LeaseSet`): one token for
all, one ``SET name token NX PX ttl GET`` each, sent in the round trip that starts the
chunk; the process's one renewer thread renews them while they are held; they go in the
round trip that ends the chunk. That end is a plain ``DEL`` while the leases cannot
have expired: when their last take or renewal was *sent* less than a third of their
time-to-live ago, Redis still holds them (it set them no earlier than that send), so
nobody else can hold them; later than that (a chunk that ran past a renewal that
failed), the check-and-delete script instead. A lease deleted wrongly all the same (a
process frozen between that check and its ``DEL`` for two thirds of the time-to-live)
costs at most a duplicate compile, which first-writer-wins makes harmless.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from farm.core.keys import Namespace, lease_key

if TYPE_CHECKING:
    import redis
    from redis.client import Pipeline

    from farm.core.outage import Waiter

log = logging.getLogger(__name__)

T = TypeVar("T")

#: take the lease, or find it already ours: a SET whose reply was lost (a frozen Redis
#: ran it after the client's socket timed out) is retried with the same token, and must
#: not then find "someone" holding the lease and wait out its time-to-live
_ACQUIRE = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


class Lease:
    """A held lease; renewed every ``ttl/3`` until released. Use as a context manager."""

    def __init__(self, client: redis.Redis, name: str, token: str, ttl_s: float) -> None:
        self._client = client
        self.name = name
        self._token = token
        self._ttl_ms = int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True,
                                        name=f"lease-renew {name}")
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                self._client.eval(_RENEW, 1, self.name, self._token, self._ttl_ms)
            except Exception:  # a missed renewal only shortens the lease
                continue

    @property
    def token(self) -> str:
        """What proves this holder's ownership (``release_lease`` needs it)."""
        return self._token

    def release(self) -> None:
        """Give the lease up; when Redis cannot be reached it expires by itself (its
        time-to-live), so a failed release costs a waiting worker at most ``ttl``."""
        self._stop.set()
        self._thread.join(timeout=1)
        try:
            self._client.eval(_RELEASE, 1, self.name, self._token)
        except Exception as exc:  # Redis away: the lease expires on its own
            log.warning("lease %s not released (%s); it expires by itself", self.name, exc)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


_RELEASE_MANY = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('get', key) == ARGV[1] then n = n + redis.call('del', key) end
end
return n
"""
_RENEW_MANY = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('get', key) == ARGV[1] then n = n + redis.call('pexpire', key, ARGV[2]) end
end
return n
"""


def release_lease(client: redis.Redis, name: str, token: str) -> bool:
    """Release the leases ``name`` names (one, or several separated by spaces: a chunk's
    note, see :func:`kernel_note`) that ``token`` still holds (for the process that
    outlived a dead holder: its leases go now, not after their time-to-live)."""
    names = name.split()
    if len(names) == 1:
        return bool(client.eval(_RELEASE, 1, name, token))
    return bool(client.eval(_RELEASE_MANY, len(names), *names, token)) if names else False


#: more commands for the round trip that takes a lease: (pipeline, lease name, token)
Also = Callable[[Any, str, str], None]


def kernel_note(id_hash: str, lease_name: str, token: str) -> str:
    """What a pool process notes for its task when it takes a kernel's lease: the kernel
    (to blame should the process die) and the lease (to release at once then).
    ``lease_name`` may name several leases of one token, separated by spaces (a chunk's:
    :class:`LeaseSet`), and ``id_hash`` be empty (the kernel in hand is then noted on the
    worker's own host: ``worker.crashes.InHand``)."""
    return f"{id_hash}\n{lease_name}\n{token}"


def read_kernel_note(raw: bytes | str | None) -> tuple[str, str, str]:
    """(id hash, lease name, token) of a note; empty strings for what it lacks."""
    text = raw.decode() if isinstance(raw, bytes) else (raw or "")
    id_hash, _, rest = text.partition("\n")
    name, _, token = rest.partition("\n")
    return id_hash, name, token


class Leases:
    """Takes and waits on compile leases."""

    def __init__(self, client: redis.Redis, ttl_s: float = 30.0,
                 waiter: Waiter | None = None) -> None:
        self._client = client
        self.ttl_s = ttl_s
        self._waiter = waiter
        self._renewer: _Renewer | None = None
        self._renewer_lock = threading.Lock()
        #: whether Redis takes ``SET ... NX GET`` (7.0 and later); learnt on first use
        self.set_get = True

    @property
    def client(self) -> redis.Redis:
        """The Redis client the leases are taken with (a chunk's round trips use it)."""
        return self._client

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, waiting out a Redis outage when a waiter was given."""
        return self._waiter.call(fn) if self._waiter is not None else fn()

    _call = call

    def renewer(self) -> _Renewer:
        """The one thread that renews this process's chunk leases (started on first use)."""
        with self._renewer_lock:
            if self._renewer is None:
                self._renewer = _Renewer(self._client, self.ttl_s)
            return self._renewer

    def try_acquire(self, ns: Namespace, source_hash: str,
                    also: Also | None = None) -> Lease | None:
        """Take the lease if nobody holds it. ``also(pipeline, name, token)`` adds
        commands sent in the same round trip (a note of the attempt for the crash
        ledger), whether or not the lease is taken."""
        name = lease_key(ns, source_hash)
        token = uuid.uuid4().hex

        def once() -> bool:
            pipe = self._client.pipeline(transaction=False)
            pipe.eval(_ACQUIRE, 1, name, token, int(self.ttl_s * 1000))
            if also is not None:
                also(pipe, name, token)
            return bool(pipe.execute()[0])
        if self._call(once):
            return Lease(self._client, name, token, self.ttl_s)
        return None

    def wait_released(self, ns: Namespace, source_hash: str, timeout_s: float,
                      poll_s: float = 0.05) -> bool:
        """Wait until nobody holds the lease; False on timeout."""
        name = lease_key(ns, source_hash)
        deadline = time.monotonic() + timeout_s
        while self._call(lambda: self._client.exists(name)):
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True


class LeaseSet:
    """The compile leases of one chunk (see the module docstring): one token for all,
    taken with the commands :meth:`ask` adds to the chunk's first round trip, kept by the
    process's renewer, let go with :meth:`drop` in its last one."""

    def __init__(self, leases: Leases, ns: Namespace) -> None:
        self.leases = leases
        self.ns = ns
        self.token = uuid.uuid4().hex
        #: source hash -> lease name, for the leases held
        self.names: dict[str, str] = {}
        self._asked: list[tuple[str, str]] = []
        self._sent = 0.0
        #: when the last take or renewal that Redis confirmed was sent (monotonic)
        self.confirmed = 0.0
        self.lost = False

    def ask(self, pipe: Pipeline, source_hashes: list[str]) -> None:
        """Add the taking of ``source_hashes``' leases to ``pipe`` (a retried round trip
        finds its own token: taken)."""
        ttl_ms = int(self.leases.ttl_s * 1000)
        self._asked = [(h, lease_key(self.ns, h)) for h in source_hashes]
        for _, name in self._asked:
            if self.leases.set_get:
                pipe.set(name, self.token, nx=True, px=ttl_ms, get=True)
            else:  # Redis before 7.0: the script of a single lease
                pipe.eval(_ACQUIRE, 1, name, self.token, ttl_ms)
        self._sent = time.monotonic()

    def asked_note(self) -> str:
        """The crash ledger's note of the leases :meth:`ask` asked for, before their
        replies (one not taken is harmless: releasing it checks the token)."""
        return kernel_note("", " ".join(name for _, name in self._asked), self.token)

    def got(self, replies: list[Any]) -> set[str]:
        """Read the replies to :meth:`ask`'s commands: the source hashes now held."""
        for (source_hash, name), reply in zip(self._asked, replies, strict=True):
            text = reply.decode() if isinstance(reply, bytes) else reply
            mine = reply == 1 if not self.leases.set_get else (
                text is None or text == self.token)
            if mine:
                self.names[source_hash] = name
        if self.names:
            self.confirmed = self._sent
            self.leases.renewer().add(self)
        return set(self.names)

    @property
    def note(self) -> str:
        """The crash ledger's note of these leases (:func:`kernel_note`)."""
        return kernel_note("", " ".join(self.names.values()), self.token)

    def drop(self, pipe: Pipeline) -> list[str]:
        """Let the leases go in ``pipe``'s round trip: the names to ``DEL`` (the caller
        deletes them with its own keys, one command), or, when they may have expired
        since their last confirmation, none, the check-and-delete script added instead."""
        self.leases.renewer().discard(self)
        names = list(self.names.values())
        self.names.clear()
        if not names:
            return []
        if not self.lost and time.monotonic() - self.confirmed < self.leases.ttl_s / 3:
            return names
        pipe.eval(_RELEASE_MANY, len(names), *names, self.token)
        return []

    def release(self) -> None:
        """Let the leases go in a round trip of their own (best effort: they expire)."""
        pipe = self.leases.client.pipeline(transaction=False)
        names = self.drop(pipe)
        if names:
            pipe.delete(*names)
        try:
            pipe.execute()
        except Exception as exc:  # Redis away: the leases expire on their own
            log.warning("leases of a chunk not released (%s); they expire by themselves",
                        exc)


class _Renewer:
    """Renews the chunk leases of a process every third of their time-to-live, in one
    round trip for all of them; a lease found no longer ours marks its set ``lost``."""

    def __init__(self, client: redis.Redis, ttl_s: float) -> None:
        self._client = client
        self._ttl_ms = int(ttl_s * 1000)
        self._sets: set[LeaseSet] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lease-renew")
        self._thread.start()

    def add(self, leases: LeaseSet) -> None:
        with self._lock:
            self._sets.add(leases)

    def discard(self, leases: LeaseSet) -> None:
        with self._lock:
            self._sets.discard(leases)

    def _run(self) -> None:
        while True:
            time.sleep(self._ttl_ms / 3000)
            with self._lock:
                sets = [s for s in self._sets if s.names]
            if not sets:
                continue
            sent = time.monotonic()
            try:
                pipe = self._client.pipeline(transaction=False)
                for s in sets:
                    names = list(s.names.values())
                    pipe.eval(_RENEW_MANY, len(names), *names, s.token, self._ttl_ms)
                renewed = pipe.execute()
            except Exception:  # a missed renewal only shortens the leases
                continue
            for s, count in zip(sets, renewed, strict=True):
                if count == len(s.names):
                    s.confirmed = sent
                else:
                    s.lost = True
