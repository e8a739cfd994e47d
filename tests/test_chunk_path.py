"""A chunk's few round trips (issue 31), piece by piece, against real Redis and MinIO:
the look that is one conditional write, the leases of a chunk taken and let go at once,
the crash ledger that writes nothing on a first delivery, the kernel in hand noted on
the worker's host, the builds a pool process remembers.

The whole path (``worker.chunkrun``, the reply stream) runs in ``test_inprocess.py``,
``test_cluster.py`` and the fault tests; ``bench/bench_control_plane.py`` counts what it
costs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_store_minio import CountingPool, art, key, lowered, make_store, new_bucket

from farm.cluster.lease import Leases, LeaseSet, kernel_note, read_kernel_note, release_lease
from farm.core.keys import Namespace, lease_key, source_object, task_deliveries_key
from farm.core.outage import redis_waiter
from farm.devservices import MinioServer
from farm.store.minio import MinioStore
from worker.chunks import ALIVE_FRESH_S, BuildWatch
from worker.crashes import InHand, TaskLedger

pytestmark = pytest.mark.integration

NS = Namespace.for_fingerprint("pocl-chunk-path-0123456789ab")


@pytest.fixture
def counted(minio_server: MinioServer) -> Iterator[tuple[MinioStore, CountingPool]]:
    pool = CountingPool()
    store = make_store(minio_server, new_bucket(), http_client=pool)
    pool.reset()  # the bucket's own requests
    yield store, pool
    store.close()


def test_a_claimed_kernel_costs_its_two_writes_and_no_read(
        counted: tuple[MinioStore, CountingPool], minio_server: MinioServer) -> None:
    store, pool = counted
    low = lowered("__kernel void claimed() {}")
    mine = key(1)
    assert store.claim_source(NS, low.source_hash, mine) == (None, True)
    assert store.put(NS, art(mine, b"bin", low.source_hash), source=low).value == "stored"
    assert [method for method, _ in pool.requests] == ["PUT", "PUT"]  # index, artifact
    assert source_object(NS, low.source_hash) in pool.requests[0][1]
    # another process's claim of the same source finds the entry: it looks, as before
    other = make_store(minio_server, store.bucket)
    assert other.claim_source(NS, low.source_hash, key(2)) == (mine, False)
    assert other.find_source(NS, low.source_hash) == mine
    other.close()


def test_a_claim_taken_back_leaves_no_entry_and_a_later_put_indexes_again(
        counted: tuple[MinioStore, CountingPool]) -> None:
    store, _ = counted
    low = lowered("__kernel void failed() {}")
    assert store.claim_source(NS, low.source_hash, key(3)) == (None, True)
    store.unclaim_source(NS, low.source_hash, key(3))  # its compile failed
    assert store.find_source(NS, low.source_hash) is None
    store.put(NS, art(key(3), b"bin", low.source_hash), source=low)  # no claim remembered
    assert store.find_source(NS, low.source_hash) == key(3)


def test_a_chunks_leases_are_taken_at_once_and_let_go_in_one_delete(client: Any) -> None:
    leases = Leases(client, ttl_s=30)
    mine, theirs = LeaseSet(leases, NS), LeaseSet(leases, NS)
    pipe = client.pipeline(transaction=False)
    theirs.ask(pipe, ["b" * 64])
    theirs.got(pipe.execute())
    pipe = client.pipeline(transaction=False)
    mine.ask(pipe, ["a" * 64, "b" * 64])
    assert mine.got(pipe.execute()) == {"a" * 64}  # b is another chunk's
    pipe = client.pipeline(transaction=False)
    mine.ask(pipe, ["a" * 64])  # a retried round trip finds its own token: held
    assert mine.got(pipe.execute()) == {"a" * 64}
    _, names, token = read_kernel_note(mine.note)
    assert names.split() == [lease_key(NS, "a" * 64)] and token == mine.token
    pipe = client.pipeline(transaction=False)
    dropped = mine.drop(pipe)
    assert dropped == [lease_key(NS, "a" * 64)] and len(pipe) == 0  # fresh: a plain DEL
    client.delete(*dropped)
    assert client.exists(lease_key(NS, "b" * 64)) == 1  # the other chunk's stays
    theirs.release()
    assert client.exists(lease_key(NS, "b" * 64)) == 0


def test_leases_that_may_have_expired_are_let_go_by_token(client: Any) -> None:
    leases = Leases(client, ttl_s=3)
    mine = LeaseSet(leases, NS)
    pipe = client.pipeline(transaction=False)
    mine.ask(pipe, ["c" * 64])
    mine.got(pipe.execute())
    name = lease_key(NS, "c" * 64)
    client.set(name, "someone else")  # expired meanwhile, and taken by another
    mine.confirmed -= 2  # last confirmed longer ago than a third of the time-to-live
    pipe = client.pipeline(transaction=False)
    assert mine.drop(pipe) == []  # not a plain DEL: the check-and-delete script
    pipe.execute()
    assert client.get(name) == b"someone else"


def test_a_dead_holders_chunk_note_releases_every_lease_it_names(client: Any) -> None:
    names = [lease_key(NS, h * 64) for h in "de"]
    for name in names:
        client.set(name, "tok")
    _, noted, token = read_kernel_note(kernel_note("", " ".join(names), "tok"))
    assert release_lease(client, noted, token)
    assert client.exists(*names) == 0


def test_a_first_delivery_writes_nothing_and_the_count_matches_the_old_one(
        client: Any, redis_url: str) -> None:
    waiter = redis_waiter(redis_url, 5)
    task = str(uuid.uuid4())
    first = TaskLedger(client, task, waiter, 2, redelivered=False)
    first.start()
    assert first.deliveries == 1 and client.get(task_deliveries_key(task)) is None
    second = TaskLedger(client, task, waiter, 2, redelivered=True)  # the first crashed
    second.start()
    assert second.deliveries == 2 and client.get(task_deliveries_key(task)) == b"2"
    given = str(uuid.uuid4())  # a first delivery that gave its chunk back counts none
    TaskLedger(client, given, waiter, 2, redelivered=False).given_back()
    again = TaskLedger(client, given, waiter, 2, redelivered=True)
    again.start()
    assert again.deliveries == 1


def test_the_kernel_in_hand_is_read_for_its_own_task_only(tmp_path: Path) -> None:
    hand = InHand(tmp_path, 4242)
    hand.note("task-1", "a" * 32)
    hand.note("task-2", "b" * 32)
    assert InHand.read(tmp_path, 4242, "task-2") == "b" * 32
    assert InHand.read(tmp_path, 4242, "task-1") == ""  # another task's kernel
    assert InHand.read(tmp_path, 1, "task-2") == "" and InHand.read(None, 4242, "t") == ""
    hand.close()
    assert not (tmp_path / "hand-4242").exists()


def test_a_build_is_remembered_alive_for_a_second_and_gone_never(client: Any) -> None:
    now = [100.0]
    watch = BuildWatch(clock=lambda: now[0])
    assert watch.saw("b1", b"1") == "1" and watch.fresh("b1") == "1"
    now[0] += ALIVE_FRESH_S + 0.1
    assert watch.fresh("b1") is None  # read again
    assert watch.saw("b1", None) is None and watch.fresh("b1") is None
    client.sadd("farm:build:b2:avoid", "host:1")
    assert watch.avoided(client, "b2", "host:1") and not watch.avoided(client, "b2", "host:2")
    client.delete("farm:build:b2:avoid")
    assert watch.avoided(client, "b2", "host:1")  # once shut out, always


@pytest.mark.parametrize("cause", ["pool process died", "redis away", "neither"])
def test_a_chunk_a_live_worker_no_longer_holds_is_resent_with_its_real_cause(
        client: Any, redis_url: str, cause: str) -> None:
    """Issue 33 item 5: every such chunk was said lost "while Redis was away". The
    holder's crash note (its pool process died on the task) comes first; an outage this
    client lived through next; otherwise the line says Redis was not away."""
    from farm.cluster.holders import HolderWatch
    from farm.cluster.workers import WorkerInfo
    from farm.core.keys import CRASHES_STATUS, task_crashes_key, task_holder_key, workers_key

    fp, task = "pocl-holders-0123456789ab", str(uuid.uuid4())
    waiter = redis_waiter(redis_url, 60, say=lambda line: None)
    now = [100.0]
    watch = HolderWatch(client, waiter, fingerprint=fp, grace_s=3, settle_s=1,
                        clock=lambda: now[0])
    worker = WorkerInfo(host="h", pid=7, fingerprint=fp, device_name="d", processes=1,
                        version="v", queues=[], tasks=[])
    client.set(task_holder_key(task), worker.field)
    if cause == "pool process died":
        client.hset(task_crashes_key(task), CRASHES_STATUS, "signal 9 (SIGKILL)")
    elif cause == "redis away":  # an outage this client waited out, now over
        waiter.check(ConnectionError("refused"))
        waiter.mark_up()
    lost = []
    for beat in range(6):  # the worker beats every second and never lists the task
        client.hset(workers_key(fp), worker.field,
                    worker.model_copy(update={"heartbeat": float(beat)}).model_dump_json())
        lost = watch.look([task]).lost
        if lost:
            break
        now[0] += 1.0
    [(task_id, holder, why)] = lost
    assert task_id == task and holder == "h:7"
    if cause == "pool process died":
        assert "pool process of worker h:7 died on it (signal 9 (SIGKILL))" in why, why
        assert "Redis" not in why
    elif cause == "redis away":
        assert "while Redis was away" in why, why
    else:
        assert "Redis was not away" in why and "while Redis was away" not in why, why
