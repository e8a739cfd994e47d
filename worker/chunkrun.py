"""One chunk through a worker in few round trips: the fast path of ``worker.execute``.

The rules are :mod:`farm.compilation.obtain`'s (Loaded, else Rekeyed, else Compiled,
under the source's compile lease, records before stores); what this module changes is
how many times the chunk talks to Redis and MinIO, which is what a kernel cost the farm
(docs/BENCHMARKS.md, "Where a kernel's control-plane cost goes"). For a chunk of new
kernels:

1. **one Redis round trip** takes the compile leases of all its sources at once
   (:class:`~farm.cluster.lease.LeaseSet`), notes them for the crash ledger, and reads
   the build's heartbeat key when this process has not seen it for a second
   (``worker.chunks.BuildWatch``: a client gone means the chunk is dropped); it goes
   from one of the state's threads while the first kernel compiles, so its round trip
   costs the chunk nothing: only for a build this process saw alive within the last
   ``ALIVE_FRESH_S`` (a dead client's chunks still compile nothing) and not in a build
   whose claims were refused (below); that compile is thrown away when the lease is
   another worker's (one compile, and only then);
2. **the looks, sent at once** as the leases come back: one request a kernel from the
   state's threads, for the sources leased only (``Obtainer.claim``: on MinIO the
   source-index entry written where there is none; an entry found means the kernel is
   looked up as before, Loaded or Rekeyed);
3. **the compiles while the looks are out**, one after the other, each noted on the
   worker's host for the crash ledger (``worker.crashes.InHand``: no round trip): a
   kernel whose look is not back yet is compiled meanwhile, so the look's round trip
   costs the chunk nothing; a look that then finds the source indexed discards that
   compile when the kernel is Loaded or Rekeyed (the rules' outcome, as if it had
   waited), and the build's later chunks on this process wait for their looks (a
   rekey's build, whose sources are all indexed, compiles nothing it throws away);
4. **one Redis round trip**, when the last kernel's turn comes, sends the records of
   the kernels before it (one pack), *before* any of their store writes, so no
   artifact is ever stored without its record; then **their writes, at once**; both
   from the state's threads while the last kernel compiles (a chunk's writes waited
   for after its compiles were 5.4 of its 19 ms at p50 on the H200 host; the pack's
   round trip was on the chunk's way too);
5. **one Redis round trip** sends the last kernel's record (once the pack before it is
   out), then its write; the earlier writes are waited for (a chunk given back leaves
   none under way);
6. **one Redis round trip** ends the chunk (``end``): its reply appended to the build's
   reply stream, the leases, the crash ledger's note and the holder note deleted (one
   ``DEL``).

What does not fit this path goes the old way, kernel by kernel, after it (the chunk's
leases released first): a kernel whose lease another worker holds (waited for, then
looked up) and a second kernel of a source already in the chunk (Rekeyed from the
first, once that is stored).

What a killed worker loses: the compiles of the chunk in hand that were not stored yet
(at most ``FARM_CHUNK_SIZE``; they were one before), which the re-sent chunk redoes;
never anything stored, never a record of something stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from farm.cluster.lease import LeaseSet
from farm.cluster.payloads import CompileReply, KernelReply, KernelRequest
from farm.compilation.obtain import Found, store_key
from farm.core.errors import (
    FarmError,
    InfrastructureError,
    KernelError,
)
from farm.core.keys import (
    BUILD_AVOIDS,
    TASK_STATE_TTL_S,
    build_alive_key,
    build_replies_key,
    task_holder_key,
    task_kernel_key,
)
from farm.core.model import Artifact, KernelFailure, Key, Lowered
from farm.core.outcomes import Outcome
from farm.records.model import Trip
from worker.chunks import Avoided, Delivery
from worker.kernel import obtain_kernel

if TYPE_CHECKING:
    from farm.programs.request import ChunkRequest
    from worker.crashes import TaskLedger
    from worker.state import WorkerState

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Kernel:
    """A kernel of the chunk on its way: where its reply goes, its key and source, and
    what its look and compile found."""

    index: int
    req: KernelRequest
    key: Key
    lowered: Lowered
    #: ``lowered.source_hash``, computed once (a hash of its canonical JSON each time)
    source: str = ""
    claim: tuple[Key | None, bool] | None = None
    found: Found | None = None
    outcome: Outcome | None = None
    artifact: Artifact | None = None
    own_s: float = 0.0


@dataclass
class _Early:
    """A compile made before its lease or claim was answered: the artifact, or the
    failure that counts only if nothing is reused; its time."""

    artifact: Artifact | None
    failed: FarmError | None
    own_s: float


class ChunkRun:
    """One delivery of one chunk on this pool process (see the module docstring)."""

    def __init__(self, request: ChunkRequest, state: WorkerState,
                 ledger: TaskLedger | None, delivery: Delivery | None) -> None:
        self.request = request
        self.state = state
        self.ledger = ledger
        self.delivery = delivery
        self.build = delivery.build if delivery is not None else None
        self.leases = LeaseSet(state.leases, state.ns)
        self.replies: list[KernelReply | None] = [None] * len(request.kernels)
        self.noted = False  # the crash ledger's note of the leases is in Redis
        self.start = time.perf_counter()

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> CompileReply:
        """Obtain every kernel of the chunk; the reply (``dropped`` when its client is
        gone). Raises ``Avoided``, or an ``InfrastructureError`` (the chunk goes back)."""
        lowered = self._lower()
        fast, later = self._split(lowered)
        claims: list[Future[tuple[Key | None, bool]]] | None = None
        first: _Early | None = None
        if fast and self._ahead_of_leases():
            begun = self.state.io.submit(self._begin_and_claim, fast)
            try:
                self._in_hand(fast[0].key.id_hash)
                first = self._early(fast[0])  # while the leases are asked
            except BaseException:  # the chunk goes back: nothing of it left under way
                wait([begun])
                if begun.exception() is None:
                    wait(begun.result()[1])
                raise
            why, claims = begun.result()
        else:
            why = self._begin(fast)
        if why is not None:
            return self.dropped(why)
        held = [k for k in fast if k.source in self.leases.names]
        later += [k for k in fast if k.source not in self.leases.names]
        if held:
            self._fast(held, claims, first if held[0] is fast[0] else None)
        if later:
            self.leases.release()  # the old path takes each lease again, kernel by kernel
            self._later(later)
        return CompileReply(results=[r for r in self.replies if r is not None])

    def dropped(self, why: str) -> CompileReply:
        log.info("chunk %s: dropped %d kernel(s) without compiling: %s",
                 self.delivery.task_id if self.delivery else "?",
                 len(self.request.kernels), why)
        return CompileReply(results=[], dropped=why)

    def _lower(self) -> list[_Kernel]:
        """Key and lower every kernel; a kernel's own failure (or the crash limit) is its
        reply now, nothing of it taken or stored."""
        state, total = self.state, len(self.request.kernels) + len(self.request.programs)
        out = []
        for i, req in enumerate(self.request.kernels):
            crashed = self.ledger.crashed(req.artifact.id_hash, total) \
                if self.ledger is not None and self.ledger.redelivered else None
            if crashed is not None:
                log.error("kernel %s: %s", req.artifact.kernel.label(), crashed)
                self.replies[i] = self._failed(req, None, "crashed", crashed)
                continue
            key: Key | None = None
            try:
                key = store_key(state.registry, req.artifact, req.build_id)
                family = state.registry.get(req.artifact.kernel.family)
                lowered = family.lower_id(req.artifact, state.device)
                out.append(_Kernel(i, req, key, lowered, lowered.source_hash))
            except KernelError as exc:
                self.replies[i] = self._failed(req, key, exc.kind, str(exc), exc.build_log)
            except InfrastructureError:
                raise
            except FarmError as exc:
                self.replies[i] = self._failed(req, key, "validation", str(exc))
        return out

    @staticmethod
    def _split(kernels: list[_Kernel]) -> tuple[list[_Kernel], list[_Kernel]]:
        """(the first kernel of each source, the others: they wait for it to be stored)."""
        seen: set[str] = set()
        fast: list[_Kernel] = []
        later: list[_Kernel] = []
        for k in kernels:
            (later if k.source in seen else fast).append(k)
            seen.add(k.source)
        return fast, later

    def _begin(self, fast: list[_Kernel]) -> str | None:
        """The first round trip: the leases of ``fast``'s sources, their note, and the
        build's heartbeat where not fresh. Why the chunk is dropped, else ``None``."""
        state, delivery = self.state, self.delivery
        build = delivery.build if delivery is not None else None
        alive = state.builds.fresh(build) if build else None
        ask_alive = build is not None and alive is None
        if not fast and not ask_alive:
            return None

        def once() -> list[Any]:
            pipe = state.client.pipeline(transaction=False)
            if ask_alive:
                pipe.get(build_alive_key(build or ""))
            self.leases.ask(pipe, [k.source for k in fast])
            if fast and self.ledger is not None:
                pipe.set(task_kernel_key(self.ledger.task_id), self.leases.asked_note(),
                         ex=TASK_STATE_TTL_S)
            return list(pipe.execute())

        replies = self._call_leases(once)
        if ask_alive:
            alive = state.builds.saw(build or "", replies.pop(0))
        self.leases.got(replies[:len(fast)])
        self.noted = bool(fast) and self.ledger is not None
        if build is None:
            return None
        if alive is None:
            return f"the client of build {build} is gone"
        if alive == BUILD_AVOIDS and delivery is not None and delivery.worker and \
                state.builds.avoided(state.client, build, delivery.worker):
            raise Avoided(f"its client sends this worker no more of build {build}")
        return None

    def _ahead_of_leases(self) -> bool:
        """Whether the first compile goes ahead of the leases: not in a build whose
        claims were refused (a rekey's), and only for a build this process saw alive,
        and not shutting it out, less than ``ALIVE_FRESH_S`` ago (a dead client's queued
        chunks are dropped without a compile, as before)."""
        builds = self.state.builds
        if builds.claims_refused(self.build):
            return False
        if self.build is None:
            return True
        alive = builds.fresh(self.build)
        return alive is not None and alive != BUILD_AVOIDS

    def _begin_and_claim(self, fast: list[_Kernel]
                         ) -> tuple[str | None, list[Future[tuple[Key | None, bool]]]]:
        """:meth:`_begin` on a store thread, then the claims of the sources it leased
        sent at once (a claim is only ever made under its source's lease)."""
        why = self._begin(fast)
        if why is not None:
            return why, []
        state = self.state
        return None, [state.io.submit(state.rules.claim, k.key, k.lowered)
                      for k in fast if k.source in self.leases.names]

    def _early(self, k: _Kernel) -> _Early:
        """A compile made before the kernel's claim (and, the chunk's first, its lease)
        was answered: kept when the lease is this worker's and the claim finds the
        source unindexed, else thrown away (:meth:`_obtain`)."""
        t = time.perf_counter()
        try:
            return _Early(self._compile(k), None, time.perf_counter() - t)
        except InfrastructureError:
            raise
        except FarmError as exc:  # its failure counts only if nothing is reused
            return _Early(None, exc, time.perf_counter() - t)

    def _call_leases(self, once: Callable[[], T]) -> T:
        """``once()`` through the outage waiter; a Redis before 7.0, which refuses
        ``SET ... NX GET``, is asked again with the lease script (learnt once)."""
        import redis

        state = self.state
        call = state.redis_waiter.call if state.redis_waiter is not None else state.leases.call
        try:
            return call(once)
        except redis.ResponseError as exc:
            if not state.leases.set_get or "syntax" not in str(exc).lower():
                raise
            state.leases.set_get = False
            return call(once)

    # -- the fast path ----------------------------------------------------------------------
    def _fast(self, kernels: list[_Kernel],
              sent: list[Future[tuple[Key | None, bool]]] | None = None,
              first: _Early | None = None) -> None:
        """``kernels`` under this worker's leases; ``sent``: their claims, already out
        (else sent here); ``first``: the first kernel's compile, made ahead."""
        state = self.state
        ahead = not state.builds.claims_refused(self.build)
        claims = sent if sent is not None else [
            state.io.submit(state.rules.claim, k.key, k.lowered) for k in kernels]
        #: the records of all but the last kernel sent, then their writes started
        pack: Future[list[Future[None]]] | None = None
        writes: list[Future[None]] = []
        since = self.start
        try:
            for n, (k, claim) in enumerate(zip(kernels, claims, strict=True)):
                if n and n == len(kernels) - 1:  # the others' records, and their writes
                    done = [j for j in kernels[:n] if j.outcome is not None]
                    since = self._record(done, since, send=False)
                    pack = state.io.submit(self._send_and_keep, done)  # while the last
                early = first if n == 0 else None
                if early is None:
                    self._in_hand(k.key.id_hash)
                t = time.perf_counter() - (early.own_s if early is not None else 0.0)
                try:
                    self._obtain(k, claim, ahead=ahead, early=early)
                except KernelError as exc:
                    self._unclaim(k)
                    self.replies[k.index] = self._failed(k.req, k.key, exc.kind, str(exc),
                                                         exc.build_log)
                except InfrastructureError:
                    raise
                except FarmError as exc:
                    self._unclaim(k)
                    self.replies[k.index] = self._failed(k.req, k.key, "validation", str(exc))
                k.own_s = time.perf_counter() - t
            if pack is not None:  # the earlier records are out before the last one's
                writes = pack.result()
            for k in kernels[-1:]:  # the last (or the only) one: its record, then its write
                if k.outcome is not None:
                    self._record([k], since)
                    if k.outcome is not Outcome.LOADED:
                        self._keep(k)
        finally:  # a chunk given back leaves no claim or write of its still under way
            wait(claims)
            if pack is not None and pack.exception() is None:  # exception() waits for it
                writes = pack.result()
            wait(writes)
        for error in [f.exception() for f in writes]:
            if error is not None:
                raise error
        done = [k for k in kernels if k.outcome is not None]
        for k in done:
            self.replies[k.index] = KernelReply(
                id_hash=k.key.id_hash, key=str(k.key), outcome=k.outcome,
                work_s=k.own_s, worker=state.name, host=state.host)

    def _obtain(self, k: _Kernel, claim: Future[tuple[Key | None, bool]], *,
                ahead: bool, early: _Early | None = None) -> None:
        """The rules for one kernel, its look (its claim) sent: Compiled when the claim
        found the source unindexed, else Loaded, Rekeyed or Compiled. ``ahead``: compile
        while the claim is still out (its round trip hidden behind the compile); a claim
        then refused discards the compile when the kernel is Loaded or Rekeyed, as if it
        had waited, and one that found the source indexed makes the build's later
        chunks on this process wait for their claims (a rekey's build: its sources are
        all indexed)."""
        rules = self.state.rules
        family = k.req.artifact.kernel.family
        if early is None and ahead and not claim.done():
            early = self._early(k)
        made = early.artifact if early is not None else None
        failed = early.failed if early is not None else None
        k.claim = claim.result()
        if not k.claim[1]:  # the index held something (or the store only looked)
            if k.claim[0] is not None:  # the source is indexed: a rekey's build
                self.state.builds.refused(self.build)
            if rules.stored(k.key, k.lowered.kernel_names) is not None:
                k.outcome = Outcome.LOADED
                return
            k.found = rules.reusable(k.key, family, k.lowered, claimed=k.claim)
            if k.found is not None:
                k.outcome = Outcome.REKEYED
                return
        if failed is not None:
            raise failed
        k.artifact = made if made is not None else self._compile(k)
        k.outcome = Outcome.COMPILED

    def _compile(self, k: _Kernel) -> Artifact:
        """Finalize and validate by a load on this device (``WorkerState.compile``)."""
        return self.state.compile(k.key, k.req.artifact.kernel.family, k.lowered, k.source)

    def _send_and_keep(self, done: list[_Kernel]) -> list[Future[None]]:
        """On a store thread, while the last kernel compiles: the records made for
        ``done`` sent (one pack), then their writes started; the writes."""
        state = self.state
        if any(k.outcome is not Outcome.LOADED for k in done):
            state.send_records()
        return [state.io.submit(self._keep, k) for k in done
                if k.outcome is not Outcome.LOADED]

    def _record(self, done: list[_Kernel], since: float, *, send: bool = True) -> float:
        """Every kernel's record; the changing ones sent now (``send``; else by the
        caller), in one pack, before any of their store writes (a Loaded record goes
        with the chunk's end). Each kernel's time is its own plus its share of the
        chunk's time since ``since`` that no kernel's own accounts for; returns now (the
        next pack's ``since``)."""
        state = self.state
        now = time.perf_counter()
        overhead = (now - since - sum(k.own_s for k in done)) / max(1, len(done))
        requested_by = self.request.requested_by
        for k in done:
            assert k.outcome is not None
            k.own_s += max(0.0, overhead)
            state.recorder.compilation(
                Trip(family=k.req.artifact.kernel.family, key=k.key, outcome=k.outcome,
                     work_s=k.own_s, worker=state.name, host=state.host,
                     requested_by=requested_by, kernel=k.req.artifact.kernel.label()),
                None if k.outcome is Outcome.LOADED else k.lowered)
        if send and any(k.outcome is not Outcome.LOADED for k in done):
            state.send_records()
        return now

    def _keep(self, k: _Kernel) -> None:
        rules, family = self.state.rules, k.req.artifact.kernel.family
        if k.outcome is Outcome.REKEYED and k.found is not None:
            rules.keep_reused(k.found, k.key, family, k.lowered)
        elif k.artifact is not None:
            rules.keep(k.key, family, k.artifact, k.lowered)

    def _unclaim(self, k: _Kernel) -> None:
        """A kernel that failed leaves no index entry it claimed (nothing of it stored)."""
        if k.claim is not None and k.claim[1]:
            self.state.store.unclaim_source(self.state.ns, k.source, k.key)

    # -- what does not fit ------------------------------------------------------------------
    def _later(self, kernels: list[_Kernel]) -> None:
        """The old way, kernel by kernel (``worker.kernel.obtain_kernel``): each takes
        its lease (waiting for another worker's), then looks."""
        for k in kernels:
            self._in_hand(k.key.id_hash)
            self.replies[k.index] = obtain_kernel(k.req, self.state,
                                                  self.request.requested_by)

    def _in_hand(self, id_hash: str) -> None:
        if self.state.in_hand is not None and self.ledger is not None:
            self.state.in_hand.note(self.ledger.task_id, id_hash)

    # -- the end ------------------------------------------------------------------------------
    def end(self, reply: CompileReply | None) -> None:
        """The last round trip: the reply onto the build's stream (``reply``, when the
        chunk was built: not when it goes back), then one ``DEL`` of the leases, the
        note and the holder note. The reply reached its stream or not: ``delivery.pushed``
        (a build whose stream is gone, or an older client, gets it as the task's result)."""
        state, delivery = self.state, self.delivery
        push = reply is not None and delivery is not None and delivery.build is not None
        keys: list[str] = []

        def once() -> list[Any]:
            pipe = state.client.pipeline(transaction=False)
            if push and delivery is not None and reply is not None:
                pipe.xadd(build_replies_key(delivery.build or ""),
                          {"task": delivery.task_id, "holder": delivery.worker,
                           "reply": reply.model_dump_json()}, nomkstream=True)
            names = self.leases.drop(pipe)
            keys[:] = names + ([task_kernel_key(self.ledger.task_id)] if self.noted
                               and self.ledger is not None else [])
            if reply is not None and delivery is not None:
                keys.append(task_holder_key(delivery.task_id))
            if keys:
                pipe.delete(*keys)
            return list(pipe.execute()) if len(pipe) else []

        if reply is None:  # going back: best effort, the leases expire on their own
            try:
                once()
            except Exception as exc:
                log.warning("chunk's leases not released (%s); they expire by themselves",
                            exc)
            return
        replies = state.redis_waiter.call(once) if state.redis_waiter is not None \
            else once()
        if push and delivery is not None:
            delivery.pushed = bool(replies and replies[0])

    # -- replies ------------------------------------------------------------------------------
    def _failed(self, req: KernelRequest, key: Key | None, kind: str, message: str,
                build_log: str = "") -> KernelReply:
        return KernelReply(id_hash=req.artifact.id_hash, key=str(key) if key else None,
                           failure=KernelFailure(kind=kind, message=message,
                                                 build_log=build_log),
                           work_s=time.perf_counter() - self.start, host=self.state.host)
