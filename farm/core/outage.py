"""Waiting out an outage of Redis or MinIO: backoff, one line saying what is waited for,
and one clear error once the outage outlasts its limit (``FARM_OUTAGE_LIMIT``).

Why one waiter per service and process rather than a retry per call: an outage spans
many calls (a poll, a lease, a heartbeat), and the limit is about the outage, not about
one call. The waiter remembers when the service stopped answering; every call made while
it is down waits with exponential backoff until the service answers again or the outage
is ``limit_s`` old, then raises :class:`OutageError`, whose text is the one line the CLI
prints before exiting 1. A success ends the outage (and says so, once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential

from farm.core.errors import ClusterError

log = logging.getLogger(__name__)

T = TypeVar("T")

Say = Callable[[str], None]


class OutageError(ClusterError):
    """A service stayed unreachable for longer than the outage limit."""


def redis_location(url: str) -> str:
    """``Redis at host:port/db``, never the password a URL may carry."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"Redis at {host}{port}{parts.path or ''}"


def is_redis_down(exc: BaseException) -> bool:
    """Whether ``exc`` means Redis (or the broker connection) is unreachable for now."""
    import redis
    from kombu.exceptions import OperationalError

    return isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError
                      | OperationalError | ConnectionError | TimeoutError)


class Waiter:
    """Waits out the outages of one service (``what``, e.g. ``Redis at host:6379/0``).

    ``say`` is where the one progress line and the recovery line go (a log by default;
    the CLI passes its console). Thread-safe: threads of one process share an outage.
    """

    def __init__(self, what: str, limit_s: float, *, is_down: Callable[[BaseException], bool],
                 say: Say | None = None, max_wait_s: float = 2.0) -> None:
        self.what = what
        self.limit_s = limit_s
        self._is_down = is_down
        self._say = say or (lambda line: log.warning("%s", line))
        self._max_wait_s = max_wait_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        #: outages waited out so far, and their total length (for the docs' figures)
        self.outages = 0
        self.waited_s = 0.0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def _mark_down(self, exc: BaseException) -> float:
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.outages += 1
                self._say(f"waiting for {self.what} (unreachable: {_short(exc)}; giving up "
                          f"after {self.limit_s:g} s)")
            return self._down_since

    def mark_up(self) -> None:
        """The service answered: end the outage, if there was one."""
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is None:
                return
            lasted = time.monotonic() - self._down_since
            self._down_since = None
            self.waited_s += lasted
        self._say(f"{self.what} is back after {lasted:.1f} s")

    def check(self, exc: BaseException) -> None:
        """For callers that retry on their own: note the failure, raise past the limit."""
        since = self._mark_down(exc)
        if time.monotonic() - since >= self.limit_s:
            raise OutageError(self._gave_up(exc)) from None

    def _gave_up(self, exc: BaseException) -> str:
        return (f"{self.what} unreachable for more than {self.limit_s:g} s "
                f"(FARM_OUTAGE_LIMIT): {_short(exc)}")

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, waiting out an outage of the service; OutageError past the limit."""
        def stop(state: RetryCallState) -> bool:
            since = self._down_since
            return since is not None and time.monotonic() - since >= self.limit_s

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if exc is not None:
                self._mark_down(exc)

        retrying = Retrying(retry=retry_if_exception(self._is_down), stop=stop,
                            wait=wait_exponential(multiplier=0.05, max=self._max_wait_s),
                            before_sleep=before_sleep, reraise=True)
        try:
            result = retrying(fn)
        except Exception as exc:
            if self._is_down(exc):
                self._mark_down(exc)
                raise OutageError(self._gave_up(exc)) from None
            raise
        self.mark_up()
        return result


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__


def redis_waiter(url: str, limit_s: float, say: Say | None = None) -> Waiter:
    """The waiter for the Redis at ``url``."""
    return Waiter(redis_location(url), limit_s, is_down=is_redis_down, say=say)
