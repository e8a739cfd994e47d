"""Waiting out an outage of Redis or MinIO: backoff, one line saying what is waited for,
and one clear error once the outage outlasts its limit (``FARM_OUTAGE_LIMIT``).

Why one waiter per service and process rather than a retry per call: an outage spans
many calls (a poll, a lease, a heartbeat), and the limit is about the outage, not about
one call. The waiter remembers when the service stopped answering; every call made while
it is down waits with exponential backoff until the service answers again or the outage
is ``limit_s`` old, then raises :class:`OutageError`, whose text is the one line the CLI
prints before exiting 1. A success ends the outage (and says so, once).

The outage starts when the first failed attempt *started*, not when it failed: a frozen
peer (SIGSTOP, a dead network path) makes every attempt block until its socket timeout
(``FARM_SOCKET_TIMEOUT``, a few seconds: :func:`redis_client`), and that time is part of
the outage. So the limit holds within one socket timeout, and "back after N s" is the
real length of the outage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypeVar
from urllib.parse import urlsplit

from farm.core.errors import ClusterError

if TYPE_CHECKING:
    import redis
    from tenacity import RetryCallState

log = logging.getLogger(__name__)

T = TypeVar("T")

Say = Callable[[str], None]

#: seconds waited after the first failed attempt of an outage (doubling, up to a cap)
_FIRST_WAIT_S = 0.05


class OutageError(ClusterError):
    """A service stayed unreachable for longer than the outage limit."""


def redis_location(url: str) -> str:
    """``Redis at host:port/db``, never the password a URL may carry."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"Redis at {host}{port}{parts.path or ''}"


#: what a failure to connect that no waiting fixes is ("" for the others)
Refusal = Literal["authentication", "tls", ""]

_AUTH_ERRORS = frozenset({"AuthenticationError", "AuthenticationWrongNumberOfArgsError"})
_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "invalid username-password pair")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it (``__cause__``, ``__context__``, urllib3's ``reason``)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop()
        if item is None or any(item is s for s in seen) or len(seen) > 16:
            continue
        seen.append(item)
        todo += [item.__cause__, item.__context__, getattr(item, "reason", None)
                 if isinstance(getattr(item, "reason", None), BaseException) else None]
    return seen


def refusal(exc: BaseException) -> Refusal:
    """``authentication`` (a wrong password or key), ``tls`` (a certificate this
    machine does not trust, a server that does not speak TLS) or "": a refusal is
    configuration, not an outage, so it is said at once, never waited out."""
    import ssl

    for item in _chain(exc):
        if any(c.__name__ in _AUTH_ERRORS for c in type(item).__mro__) or \
                any(reply in str(item) for reply in _AUTH_REPLIES):
            return "authentication"
        if isinstance(item, ssl.SSLError) or type(item).__name__ == "SSLError":
            return "tls"
    return ""


def tls_detail(exc: BaseException) -> str:
    """The TLS library's own words (``certificate verify failed: self-signed ...``)."""
    import ssl

    for item in _chain(exc):
        if isinstance(item, ssl.SSLError):
            text = getattr(item, "reason", None) or ""
            message = str(item).split("] ", 1)[-1].split(" (_ssl.c")[0]
            return message or str(text)
    return _short(exc)


TLS_HINT = ("is the server's certificate signed by a CA this machine trusts? A private "
            "CA goes in SSL_CERT_FILE (the chart: caBundle)")


def describe_refusal(what: str, exc: BaseException, setting: str) -> str | None:
    """One line for an authentication or TLS failure reaching ``what``; ``None`` for
    any other failure. Never the credentials: the setting that holds them is named."""
    kind = refusal(exc)
    if kind == "authentication":
        return f"{what}: authentication failed ({_short(exc)}): check the password in {setting}"
    if kind == "tls":
        return f"{what}: TLS failed ({tls_detail(exc)}): {TLS_HINT}"
    return None


def is_redis_down(exc: BaseException) -> bool:
    """Whether ``exc`` means Redis (or the broker connection) is unreachable for now; an
    authentication or TLS failure is not (see :func:`refusal`)."""
    import redis
    from kombu.exceptions import OperationalError

    return isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError
                      | OperationalError | ConnectionError | TimeoutError) \
        and not refusal(exc)


def redis_failure(url: str, exc: BaseException) -> str:
    """One line saying what failed reaching the Redis at ``url`` (never its password)."""
    where = redis_location(url)
    told = describe_refusal(where, exc, "FARM_REDIS_URL")
    if told is not None:
        return told
    return f"{where} is unreachable ({_short(exc)}); is it running? (FARM_REDIS_URL)"


class Waiter:
    """Waits out the outages of one service (``what``, e.g. ``Redis at host:6379/0``).

    ``say`` is where the one progress line and the recovery line go (a log by default;
    the CLI passes its console). Thread-safe: threads of one process share an outage.
    """

    def __init__(self, what: str, limit_s: float, *, is_down: Callable[[BaseException], bool],
                 say: Say | None = None, max_wait_s: float = 2.0,
                 attempt_s: float | None = None) -> None:
        self.what = what
        self.limit_s = limit_s
        #: the longest one attempt can take (its socket timeout), when known: then no
        #: attempt starts that could end past the limit, so the wait is bounded by it
        self.attempt_s = attempt_s
        self._is_down = is_down
        self._say = say or (lambda line: log.warning("%s", line))
        self._max_wait_s = max_wait_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._last_exc: BaseException | None = None
        #: outages waited out so far, and their total length (for the docs' figures)
        self.outages = 0
        self.waited_s = 0.0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    @property
    def down_since(self) -> float | None:
        """When the outage under way began (monotonic), ``None`` when none is."""
        return self._down_since

    def gave_up_line(self) -> str:
        """The one line of an outage past its limit, naming the last failure seen."""
        return self._gave_up(self._last_exc or ConnectionError("unreachable"))

    def _mark_down(self, exc: BaseException, since: float | None = None) -> float:
        """Note the service down; ``since`` is when the failed attempt started."""
        with self._lock:
            self._last_exc = exc
            if self._down_since is None:
                self._down_since = time.monotonic() if since is None else since
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

    def check(self, exc: BaseException, started: float | None = None) -> None:
        """For callers that retry on their own: note the failure (of an attempt that
        began at ``started``, monotonic), raise past the limit."""
        since = self._mark_down(exc, started)
        if self._spent(since):
            raise OutageError(self._gave_up(exc)) from None

    def _spent(self, since: float) -> bool:
        """Whether the outage begun at ``since`` has used its time: past the limit, or
        (where an attempt's longest time is known) too near it for another attempt."""
        return time.monotonic() - since + (self.attempt_s or 0.0) >= self.limit_s

    def _next_wait(self, attempt: int) -> float:
        """The wait before the attempt after ``attempt`` failed ones (doubling from
        :data:`_FIRST_WAIT_S`, at most ``max_wait_s``); where an attempt's longest time
        is known, never so long that the next attempt could end past the limit."""
        wait = min(_FIRST_WAIT_S * 2 ** attempt, self._max_wait_s)
        since = self._down_since
        if since is None or self.attempt_s is None:
            return wait
        left = self.limit_s - (time.monotonic() - since) - self.attempt_s
        return max(0.0, min(wait, left))

    def _gave_up(self, exc: BaseException) -> str:
        since = self._down_since
        lasted = (f"more than {self.limit_s:g} s" if self.attempt_s is None or since is None
                  else f"{time.monotonic() - since:.1f} s")
        return f"{self.what} unreachable for {lasted} ({self.limit_setting}): {_short(exc)}"

    #: the setting that sets the limit, named in the line that gives up (an application's
    #: served builds wait a fixed time instead: farm.programs.serve)
    limit_setting = "FARM_OUTAGE_LIMIT"

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, waiting out an outage of the service; OutageError past the limit.

        The first attempt is a plain call: the retry machinery (tenacity, which imports
        asyncio and, where it is installed, tornado: 5 to 25 ms) loads only when an
        attempt finds the service down, so an application served from a store that
        answers never pays for it."""
        started = [time.monotonic()]  # when the attempt under way began
        try:
            result = fn()
        except Exception as exc:
            if not self._is_down(exc):
                raise
            result = self._wait_out(fn, exc, started)
        self.mark_up()
        return result

    def _wait_out(self, fn: Callable[[], T], first: BaseException, started: list[float]) -> T:
        """The attempts after a first one that found the service down (begun at
        ``started[0]``): exponential backoff from :data:`_FIRST_WAIT_S`, the same waits
        as one tenacity loop over every attempt."""
        from tenacity import Retrying, retry_if_exception

        since = self._mark_down(first, started[0])
        if self._spent(since):
            raise OutageError(self._gave_up(first)) from None
        time.sleep(self._next_wait(0))

        def attempt() -> T:
            started[0] = time.monotonic()
            return fn()

        def stop(state: RetryCallState) -> bool:
            exc = state.outcome.exception() if state.outcome else None
            since = self._mark_down(exc, started[0]) if exc is not None else self._down_since
            return since is not None and self._spent(since)

        # the first wait is behind us: the next ones are 2, 4, 8... times it
        retrying = Retrying(retry=retry_if_exception(self._is_down), stop=stop,
                            wait=lambda state: self._next_wait(state.attempt_number),
                            reraise=True)
        try:
            return retrying(attempt)
        except Exception as exc:
            if self._is_down(exc):
                self._mark_down(exc, started[0])
                raise OutageError(self._gave_up(exc)) from None
            raise


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__


def redis_waiter(url: str, limit_s: float, say: Say | None = None) -> Waiter:
    """The waiter for the Redis at ``url``."""
    return Waiter(redis_location(url), limit_s, is_down=is_redis_down, say=say)


#: FARM_SOCKET_TIMEOUT's default, for callers without settings
SOCKET_TIMEOUT_S = 5.0


def redis_client(url: str, timeout_s: float = SOCKET_TIMEOUT_S) -> redis.Redis:
    """A Redis client whose every request gives up after ``timeout_s`` (connect: at most
    that, or 3 s), at its first failure: a frozen Redis then shows as an error within
    seconds, which the :class:`Waiter` turns into an outage, instead of a call blocked
    for ever. redis-py's own retries are off (its default since 6.0 is ten, each up to a
    socket timeout: a call on a frozen Redis then blocked for a minute before the waiter
    heard of it). The one way the farm's own code opens Redis (Celery's connections:
    ``celery_app``)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=timeout_s,
                                socket_connect_timeout=min(timeout_s, 3.0),
                                retry=Retry(NoBackoff(), 0))
