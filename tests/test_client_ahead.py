"""The Celery app made ahead (farm.cluster.client.AppAhead, ``ClusterClient(ahead=True)``).

A CLI build makes its Celery app on a thread while it asks Redis and the store, so that
its first chunk's send does not import Celery; what must hold: the app sent with is the
one made on that thread, a client that never sends closes without waiting for it (the
thread then closes it), and an app whose broker did not answer at the start is still
handed over, without waiting for the broker (its send meets the outage as every send
does).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

from farm.cluster.client import AppAhead, ClusterClient
from farm.cluster.gather import TASK_NAME
from farm.core.settings import Settings


class _App:
    """Stands in for a Celery app: records where it was made and whether it was closed;
    its broker never answers (so warming it fails, as a frozen Redis would)."""

    def __init__(self) -> None:
        self.made_on = threading.current_thread().name
        self.closed = threading.Event()

    @property
    def backend(self) -> Any:
        raise ConnectionError("no broker")

    def close(self) -> None:
        self.closed.set()


@pytest.fixture
def made_on(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread each client's Celery app is made on, in order."""
    made: list[str] = []
    real = ClusterClient._make_app

    def recording(self: ClusterClient) -> Any:
        made.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(ClusterClient, "_make_app", recording)
    return made


def test_a_client_sends_with_the_app_made_on_its_thread(redis_url: str, client: redis.Redis,
                                                        made_on: list[str]) -> None:
    with ClusterClient(Settings(redis_url=redis_url), ahead=True) as cc:
        app = cc.app
        assert cc.app is app
        app.send_task(TASK_NAME, args=[{"probe": 1}], queue="ahead-probe",
                      ignore_result=True)
    assert made_on == ["farm-celery-ahead"]
    assert client.llen("ahead-probe") == 1


def test_without_ahead_the_app_is_made_at_first_use(redis_url: str,
                                                    made_on: list[str]) -> None:
    with ClusterClient(Settings(redis_url=redis_url)) as cc:
        assert made_on == []
        assert cc.app is not None
    assert made_on == [threading.current_thread().name]


def test_abandoning_does_not_wait_and_the_thread_closes_the_app() -> None:
    release = threading.Event()
    made: list[_App] = []

    def slow() -> Any:
        release.wait(10)
        made.append(_App())
        return made[-1]

    ahead = AppAhead(slow)
    ahead.abandon()  # returns at once: the app is still being made
    assert made == []
    release.set()
    for _ in range(100):
        if made:
            break
        threading.Event().wait(0.05)
    assert made and made[0].closed.wait(5), "the abandoned app was never closed"
    assert ahead.take() is None


def test_an_app_whose_broker_did_not_answer_is_still_handed_over() -> None:
    ahead = AppAhead(_App)
    app = ahead.take()
    assert isinstance(app, _App)
    assert app.made_on == "farm-celery-ahead"
    assert not app.closed.is_set()


def test_taking_the_app_does_not_wait_for_its_broker() -> None:
    """A Redis that does not answer holds the thread's connection, not the send: the app
    is handed over while the connection still waits (here until the test lets it go)."""
    release = threading.Event()
    order: list[str] = []

    class _Connection:
        def ensure_connection(self, max_retries: int) -> None:
            assert max_retries == 0  # one attempt: the thread never sleeps between tries
            release.wait(10)
            order.append("connected")

    class _Producer:
        connection = _Connection()

        def __enter__(self) -> _Producer:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    class _SlowBroker(_App):
        backend = None

        def producer_or_acquire(self) -> _Producer:
            return _Producer()

    app = AppAhead(_SlowBroker).take()
    order.append("taken")
    release.set()
    for _ in range(200):
        if "connected" in order:
            break
        threading.Event().wait(0.05)
    assert isinstance(app, _SlowBroker)
    assert order == ["taken", "connected"]


def test_an_app_that_could_not_be_made_is_none_for_the_caller_to_make() -> None:
    def broken() -> Any:
        raise RuntimeError("no Celery today")

    assert AppAhead(broken).take() is None
