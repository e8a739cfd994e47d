"""In-flight deduplication: a lease in Redis per (namespace, source hash).

Two builds that overlap ask the workers for the same kernels at once. The first worker
to take the lease compiles; the others wait until the lease is gone and then find the
artifact in the store. The lease has a time-to-live that a background thread renews
while the compile runs, so a worker that dies gives its lease up by simply expiring.
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


def release_lease(client: redis.Redis, name: str, token: str) -> bool:
    """Release the lease ``name`` if ``token`` still holds it (for the process that
    outlived a dead holder: its lease goes now, not after its time-to-live)."""
    return bool(client.eval(_RELEASE, 1, name, token))


#: more commands for the round trip that takes a lease: (pipeline, lease name, token)
Also = Callable[[Any, str, str], None]


def kernel_note(id_hash: str, lease_name: str, token: str) -> str:
    """What a pool process notes for its task when it takes a kernel's lease: the kernel
    (to blame should the process die) and the lease (to release at once then)."""
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

    def _call(self, fn: Callable[[], T]) -> T:
        return self._waiter.call(fn) if self._waiter is not None else fn()

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
