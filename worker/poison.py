"""Poison messages: no task message, whatever its headers or body, takes a worker down.

Celery trusts the shape of a protocol-2 message: a body of ``{}`` or ``5``, a
``timelimit`` header of ``["a", "b"]`` or a message without an ``id`` raise inside the
consumer's message handler, the worker dies with ``Unrecoverable error``, the message is
restored to the queue, and every worker of that fingerprint that starts dies on it again.

So the worker's consumer (:class:`GuardedConsumer`, ``worker_consumer``) checks every
message before Celery sees it (:func:`problem`): the headers Celery reads, the body's
``[args, kwargs, embed]`` shape and the payload itself (a chunk's
:class:`~farm.programs.request.ChunkRequest`, or
a :class:`~farm.tuning.payloads.TuneRequest` for the tuning task). A
message that fails is dead-lettered (``farm:dead``, see :mod:`farm.core.keys`: the reason,
headers and a cut body, for a person to read), acknowledged so it never comes back, and
its task id, when it has one, gets a failed result so that a waiting client learns why.
Anything Celery itself still raises on a message that passed is handled the same way.
The worker then serves the next message.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery.worker.consumer import Consumer
from pydantic import ValidationError

from farm.core.errors import first_error
from farm.core.keys import DEAD_LETTERS, TASK_NAME, TUNE_TASK_NAME
from farm.programs.request import ChunkRequest
from farm.tuning.payloads import TuneRequest

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

#: dead letters kept (the oldest go first)
DEAD_LETTERS_KEPT = 1000
_BODY_CUT = 2000

#: the tasks a worker runs, and the payload each takes
_PAYLOADS: dict[str, type[ChunkRequest] | type[TuneRequest]] = {
    TASK_NAME: ChunkRequest, TUNE_TASK_NAME: TuneRequest}

_OPTIONAL_TEXT = ("root_id", "parent_id", "group", "shadow", "eta", "origin", "lang",
                  "argsrepr", "kwargsrepr")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _header_problem(headers: Any) -> str | None:
    if not isinstance(headers, Mapping):
        return "headers are not a mapping"
    task = headers.get("task")
    if task not in _PAYLOADS:
        return f"header task is {task!r}, not {TASK_NAME!r} or {TUNE_TASK_NAME!r}"
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not 0 < len(task_id) <= 255:
        return "header id is missing or not a short string"
    for name in _OPTIONAL_TEXT:
        if headers.get(name) is not None and not isinstance(headers[name], str):
            return f"header {name} is not a string"
    limits = headers.get("timelimit")
    if limits is not None and not (isinstance(limits, list | tuple) and len(limits) == 2
                                   and all(v is None or _number(v) for v in limits)):
        return "header timelimit is not [soft, hard] seconds"
    expires = headers.get("expires")
    if expires is not None and not (isinstance(expires, str) or _number(expires)):
        return "header expires is not a time"
    retries = headers.get("retries")
    if retries is not None and not (isinstance(retries, int) and not isinstance(retries, bool)
                                    and 0 <= retries < 1000):
        return "header retries is not a small count"
    for name in ("stamped_headers", "stamps", "ignore_result", "replaced_task_nesting",
                 "group_index"):
        value = headers.get(name)
        if value is None:
            continue
        ok = {"stamped_headers": isinstance(value, list),
              "stamps": isinstance(value, Mapping),
              "ignore_result": isinstance(value, bool),
              "replaced_task_nesting": isinstance(value, int) and not isinstance(value, bool),
              "group_index": isinstance(value, int) and not isinstance(value, bool)}[name]
        if not ok:
            return f"header {name} has the wrong type"
    return None


def _body_problem(body: Any, task: str = TASK_NAME) -> str | None:
    if not isinstance(body, list | tuple) or len(body) != 3:
        return "body is not [args, kwargs, embed]"
    args, kwargs, embed = body
    if not isinstance(args, list | tuple) or len(args) != 1:
        return "args are not [payload]"
    if kwargs not in ({}, None):
        return "kwargs are not empty"
    if not isinstance(embed, Mapping):
        return "embed is not a mapping"
    for name in ("callbacks", "errbacks", "chain", "chord"):
        if embed.get(name):  # a compile task is never part of a canvas
            return f"embed {name} is not empty"
    try:
        _PAYLOADS.get(task, ChunkRequest).model_validate(args[0])
    except ValidationError as exc:
        where, why = first_error(exc, "payload")
        return f"payload does not validate: {where}: {why}"
    return None


def problem(message: Any) -> str | None:
    """Why ``message`` cannot be a task this worker runs; ``None`` when it can."""
    if message.content_type != "application/json":
        return f"content type {message.content_type!r} is not application/json"
    reason = _header_problem(message.headers)
    if reason is not None:
        return reason
    try:
        body = message.decode()
    except Exception as exc:  # any decoding failure is the message's fault
        return f"body does not decode: {type(exc).__name__}"
    return _body_problem(body, message.headers["task"])


def _cut(value: Any) -> Any:
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text[:_BODY_CUT]


def dead_letter(client: redis.Redis, message: Any, reason: str) -> None:
    """Keep the refused message where an operator can see it (``farm:dead``)."""
    headers = message.headers if isinstance(message.headers, Mapping) else {}
    body = message.body
    if isinstance(body, bytes):
        body = body[:_BODY_CUT].decode("utf-8", errors="replace")
    entry = {"at": time.time(), "reason": reason,
             "queue": (message.delivery_info or {}).get("routing_key", ""),
             "headers": _cut(dict(headers)), "body": _cut(body)}
    pipe = client.pipeline(transaction=False)
    pipe.lpush(DEAD_LETTERS, json.dumps(entry))
    pipe.ltrim(DEAD_LETTERS, 0, DEAD_LETTERS_KEPT - 1)
    pipe.execute()


class GuardedConsumer(Consumer):
    """Celery's consumer, with every task message checked before Celery reads it."""

    _farm_redis: redis.Redis | None = None

    def _redis(self) -> redis.Redis:
        if self._farm_redis is None:
            import redis

            self._farm_redis = redis.Redis.from_url(self.app.conf.broker_url,
                                                    socket_timeout=5,
                                                    socket_connect_timeout=5)
        return self._farm_redis

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        celery_handler = super().create_task_handler(*args, **kwargs)

        def on_task_received(message: Any) -> None:
            try:
                reason = problem(message)
            except Exception as exc:  # a message odd enough to break the checks
                reason = f"message cannot be read: {type(exc).__name__}"
            if reason is not None:
                self._refuse(message, reason)
                return
            try:
                celery_handler(message)
            except Exception as exc:
                self._refuse(message, f"refused by the task handler: {type(exc).__name__}: "
                                      f"{str(exc)[:200]}")

        return on_task_received

    def _refuse(self, message: Any, reason: str) -> None:
        log.error("refused a task message (dead-lettered to %s): %s", DEAD_LETTERS, reason)
        try:
            dead_letter(self._redis(), message, reason)
        except Exception as exc:  # Redis away: the log line above is all that is left
            log.error("could not dead-letter the message: %s", exc)
        headers = message.headers if isinstance(message.headers, Mapping) else {}
        task_id = headers.get("id")
        if isinstance(task_id, str) and 0 < len(task_id) <= 255:
            try:
                self.app.backend.mark_as_failure(
                    task_id, ValueError(f"task message refused: {reason}"))
            except Exception as exc:  # best effort: nobody may be waiting for it
                log.debug("no failed result for refused task %s: %s", task_id, exc)
        try:
            message.ack()
        except Exception as exc:
            log.error("could not acknowledge the refused message: %s", exc)
