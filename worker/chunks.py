"""A chunk a worker must not build: given back to its queue, or dropped.

* **Given back** (an ``InfrastructureError``: the store, Redis, this worker's own state):
  the task rejects its message with requeue, which puts it at the back of its queue for
  any worker of the pool. Each return is noted per task (``farm:task:<id>:returns``:
  worker -> times, ``why`` -> the last reason) so that the client can tell a worker
  whose chunks all go back (its circuit breaker) and so that a chunk that nobody can
  build is not passed around for ever: after ``MAX_RETURNS`` returns its kernels fail as
  ``infrastructure``, naming the last reason, a failure the client reports as the
  farm's, not the kernels'.
* **Avoided**: a chunk of a build whose client shut this worker out (its circuit
  breaker: every chunk this worker took went back) goes back at once, unbuilt and
  uncounted.
* **Dropped**: a chunk whose client is gone (its build's heartbeat key,
  ``farm:build:<token>:alive``, expired) is acknowledged without compiling anything, one
  log line, counted in the worker's metrics. Its reply says so (``dropped``), so that a
  client that is in fact alive (a Redis that lost the key) sends it again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from farm.cluster.payloads import CompileReply, CompileRequest, KernelReply
from farm.core.keys import (
    RETURNS_WHY,
    TASK_STATE_TTL_S,
    build_alive_key,
    build_avoid_key,
    build_returns_key,
    task_holder_key,
    task_returns_key,
)
from farm.core.model import KernelFailure

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

#: returns of one chunk (by any worker) before its kernels fail as ``infrastructure``
MAX_RETURNS = 10


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def note_return(client: redis.Redis, task_id: str, request: CompileRequest, worker: str,
                reason: str | None) -> None:
    """Note that ``worker`` gives the chunk back (``reason`` ``None``: uncounted), per
    task and per build (what the client's circuit breaker reads), and that it holds it
    no more: the chunk is queued again, and a client must not take it for one its holder
    dropped. Before the message goes back, so before another worker can note itself as
    the holder. Best effort (Redis may be what failed)."""
    key = task_returns_key(task_id)
    pipe = client.pipeline(transaction=False)
    pipe.delete(task_holder_key(task_id))
    if reason is not None:
        pipe.hincrby(key, worker, 1)
        pipe.hset(key, RETURNS_WHY, reason[:300])
        pipe.expire(key, TASK_STATE_TTL_S)
        if request.build is not None:
            per_build = build_returns_key(request.build)
            pipe.hincrby(per_build, worker, 1)
            pipe.hset(per_build, f"{RETURNS_WHY}:{worker}", reason[:300])
            pipe.expire(per_build, TASK_STATE_TTL_S)
    try:
        pipe.execute()
    except Exception as exc:
        log.debug("task %s: return not noted: %s", task_id, exc)


def returns(client: redis.Redis, task_id: str) -> tuple[dict[str, int], str]:
    """(worker -> times it gave the chunk back, the last reason)."""
    raw = client.hgetall(task_returns_key(task_id))
    why = ""
    counts: dict[str, int] = {}
    for name, value in raw.items():
        field, text = _text(name), _text(value)
        if field == RETURNS_WHY:
            why = text
        elif text.isdigit():
            counts[field] = int(text)
    return counts, why


def given_up(client: redis.Redis, task_id: str, request: CompileRequest) -> CompileReply | None:
    """The reply that ends a chunk given back ``MAX_RETURNS`` times, else ``None``."""
    try:
        counts, why = returns(client, task_id)
    except Exception:  # Redis away: build it (or give it back) as usual
        return None
    total = sum(counts.values())
    if total < MAX_RETURNS:
        return None
    message = (f"given back {total} time(s) by {len(counts)} worker(s) for infrastructure "
               f"reasons, not tried again; the last: {why}")
    log.error("chunk %s: %s", task_id, message)
    ids = [k.artifact.id_hash for k in request.kernels] + [
        p.spec.key.id_hash for p in request.programs]
    return CompileReply(results=[
        KernelReply(id_hash=id_hash,
                    failure=KernelFailure(kind="infrastructure", message=message))
        for id_hash in ids])


def client_gone(client: redis.Redis, request: CompileRequest) -> bool:
    """Whether the chunk's build has a heartbeat key no longer (its client died).
    ``False`` when it cannot tell (no token, Redis away)."""
    if request.build is None:
        return False
    try:
        return not client.exists(build_alive_key(request.build))
    except Exception:
        return False


def avoided(client: redis.Redis, request: CompileRequest, worker: str) -> bool:
    """Whether the chunk's client stopped sending its build to ``worker`` (its circuit
    breaker, ``farm.cluster.breaker``). ``False`` when it cannot tell."""
    if request.build is None or not worker:
        return False
    try:
        return bool(client.sismember(build_avoid_key(request.build), worker))
    except Exception:
        return False


def dropped(task_id: str, request: CompileRequest) -> CompileReply:
    why = f"the client of build {request.build} is gone"
    log.info("chunk %s: dropped %d kernel(s) without compiling: %s", task_id,
             len(request.kernels) + len(request.programs), why)
    return CompileReply(results=[], dropped=why)
