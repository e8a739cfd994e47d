"""Timing the candidates of one key on one device, honestly.

In order (docs/TUNING.md says why each step is there):

1. **Buffers, once.** The family's example for the problem gives the inputs and the
   reference; every array becomes a device buffer, and a pristine copy of it (an array
   of zeros is restored by a fill instead), shared by every candidate.
2. **Reference first.** Each candidate runs once on freshly restored buffers and its
   outputs are compared with the reference (:func:`farm.families.run.check_example`).
   A candidate whose values differ is ``wrong`` and never timed, so never a winner;
   one that cannot launch is ``failed``. Restoring before each check matters: a
   candidate that writes nothing would otherwise read back the previous one's answer.
   This launch is not timed (on PoCL it makes the kernel's machine code).
3. **Isolation.** From here on the device is the measurement's alone
   (:meth:`farm.core.isolation.HostLock.measuring`: no compile on this host's cores
   for a CPU device, no other measurement of the device).
4. **Warm-ups**, then **rounds**: each round launches every candidate still timed once,
   the order rotating from round to round, so that drift (clocks, caches, the
   neighbours) hits all alike. Many rounds are queued between two waits (about
   ``batch_ms`` of kernel time), so a short kernel is not timed against the host's
   round trip. Times are the device's own profiling events (end - start): the kernel,
   not the queueing.
5. **Stopping**: :class:`~farm.tuning.model.MeasurePolicy` (launches and kernel time per
   candidate, hopeless candidates dropped early, a budget per key).
6. **Figures**: median, interquartile range over the median (the spread), fastest launch.

Everything runs in the calling process on one queue made with profiling enabled.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from farm.core.outcomes import Fate
from farm.families.base import Example, LocalMem
from farm.families.run import check_example
from farm.tuning.keys import Params
from farm.tuning.model import Figures, MeasurePolicy, Status

if TYPE_CHECKING:
    import pyopencl as cl

#: most rounds queued between two waits
MAX_BATCH_ROUNDS = 64
_ZERO = np.zeros(1, dtype=np.uint8)


@dataclass
class Contender:
    """One candidate as the measurement gets it: a kernel and its launch, or already a
    status saying why it has none (``unsupported``, ``failed``)."""

    params: Params
    kernel: cl.Kernel | None = None
    global_size: tuple[int, ...] = ()
    local_size: tuple[int, ...] | None = None
    status: Status = "ok"
    note: str = ""


@dataclass
class _Run:
    """A contender being timed."""

    contender: Contender
    times: list[float] = field(default_factory=list)
    total: float = 0.0
    estimate: float = 0.0
    note: str = ""

    def add(self, ms: float) -> None:
        self.times.append(ms)
        self.total += ms
        self.estimate = ms

    def enough(self, policy: MeasurePolicy) -> bool:
        n = len(self.times)
        return n >= policy.max_launches or (n >= policy.min_launches
                                            and self.total >= policy.min_ms)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


class _Buffers:
    """The example's arguments on the device: working buffers the kernels use, and a
    pristine copy of each array to restore them from."""

    def __init__(self, queue: cl.CommandQueue, example: Example) -> None:
        import pyopencl as cl

        ctx = queue.context
        mf = cl.mem_flags
        self.example = example
        self.args: list[Any] = []
        self.work: dict[int, cl.Buffer] = {}
        self.pristine: dict[int, cl.Buffer | None] = {}
        for i, arg in enumerate(example.args):
            if isinstance(arg, LocalMem):
                self.args.append(cl.LocalMemory(arg.nbytes))
            elif isinstance(arg, np.ndarray):
                host = np.ascontiguousarray(arg)
                self.work[i] = cl.Buffer(ctx, mf.READ_WRITE, size=max(1, host.nbytes))
                self.pristine[i] = None if not host.any() else \
                    cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=host)
                self.args.append(self.work[i])
            else:
                self.args.append(arg)

    def restore(self, queue: cl.CommandQueue) -> None:
        """Every array as the example made it (on the device: no host copy)."""
        import pyopencl as cl

        for i, work in self.work.items():
            source = self.pristine[i]
            if source is None:
                cl.enqueue_fill_buffer(queue, work, _ZERO, 0, work.size)
            else:
                cl.enqueue_copy(queue, work, source)

    def outputs(self, queue: cl.CommandQueue) -> dict[int, np.ndarray]:
        import pyopencl as cl

        got: dict[int, np.ndarray] = {}
        for i in self.example.expected:
            like = self.example.args[i]
            assert isinstance(like, np.ndarray)
            got[i] = np.empty_like(like)
            cl.enqueue_copy(queue, got[i], self.work[i])
        queue.finish()
        return got


def measure(queue: cl.CommandQueue, example: Example, contenders: list[Contender],
            policy: MeasurePolicy, isolation: AbstractContextManager[bool],
            clock: Callable[[], float] = time.monotonic) -> tuple[list[Figures], bool]:
    """Every contender's figures, in order, and whether isolation held while timing.
    ``queue`` must have profiling enabled."""
    buffers = _Buffers(queue, example)
    for c in contenders:
        if c.status == "ok":
            _check(queue, buffers, c)
    runs = [_Run(c) for c in contenders if c.status == "ok"]
    if not runs:  # nothing to time: the device is not taken from anybody
        return [_figures(c, None) for c in contenders], True
    for run in runs:
        run.contender.kernel.set_args(*buffers.args)  # type: ignore[union-attr]
    with isolation as isolated:
        start = clock()
        _warm_up(queue, runs, policy)
        _time_rounds(queue, runs, policy, clock, start)
    by_id = {id(r.contender): r for r in runs}
    return [_figures(c, by_id.get(id(c))) for c in contenders], isolated


def _launch(queue: cl.CommandQueue, c: Contender) -> cl.Event:
    import pyopencl as cl

    assert c.kernel is not None
    return cl.enqueue_nd_range_kernel(queue, c.kernel, c.global_size, c.local_size)


def _ms(event: cl.Event) -> float:
    return (event.profile.end - event.profile.start) * 1e-6


def _check(queue: cl.CommandQueue, buffers: _Buffers, c: Contender) -> None:
    """Run ``c`` once on restored buffers against the reference; ``wrong`` or ``failed``
    when it does not match or does not run."""
    import pyopencl as cl

    try:
        buffers.restore(queue)
        assert c.kernel is not None
        c.kernel.set_args(*buffers.args)
        _launch(queue, c)
        problems = check_example(buffers.outputs(queue), buffers.example)
    except (cl.Error, RuntimeError, ValueError, TypeError) as exc:
        c.status, c.note = Fate.FAILED, f"the launch failed: {' '.join(str(exc).split())}"[:500]
        return
    if problems:
        c.status, c.note = "wrong", f"values differ from the reference: {problems[0]}"[:500]


def _warm_up(queue: cl.CommandQueue, runs: list[_Run], policy: MeasurePolicy) -> None:
    last: dict[int, cl.Event] = {}
    for _ in range(policy.warmups):
        for run in runs:
            last[id(run)] = _launch(queue, run.contender)
    queue.finish()
    for run in runs:
        if id(run) in last:
            run.estimate = _ms(last[id(run)])


def _time_rounds(queue: cl.CommandQueue, runs: list[_Run], policy: MeasurePolicy,
                 clock: Callable[[], float], start: float) -> None:
    live = list(runs)
    turn = 0
    while live:
        per_round = sum(r.estimate for r in live)
        room = min(policy.max_launches - len(r.times) for r in live)
        rounds = 1 if per_round <= 0 else int(policy.batch_ms / per_round)
        rounds = max(1, min(MAX_BATCH_ROUNDS, rounds, room))
        events: list[tuple[_Run, cl.Event]] = []
        for _ in range(rounds):
            k = turn % len(live)
            turn += 1
            for run in live[k:] + live[:k]:
                events.append((run, _launch(queue, run.contender)))
        queue.finish()
        for run, event in events:
            run.add(_ms(event))
        live = [r for r in live if not r.enough(policy)]
        live = _prune(runs, live, policy)
        if live and clock() - start > policy.max_s:
            for run in live:
                run.note = (f"timed {len(run.times)} times: the key's budget of "
                            f"{policy.max_s:g} s ran out")
            return


def _prune(runs: list[_Run], live: list[_Run], policy: MeasurePolicy) -> list[_Run]:
    """``live`` without the candidates that cannot win: timed ``prune_after`` times at
    least, and even their fastest launch over ``prune_factor`` times the best median."""
    if not policy.prune_factor:
        return live
    timed = [r.median for r in runs if len(r.times) >= policy.prune_after]
    if not timed:
        return live
    bar = policy.prune_factor * min(timed)
    kept = []
    for run in live:
        if len(run.times) >= policy.prune_after and min(run.times) > bar:
            run.note = (f"timed {len(run.times)} times: even its fastest launch is over "
                        f"{policy.prune_factor:g}x the fastest median")
        else:
            kept.append(run)
    return kept


def _figures(c: Contender, run: _Run | None) -> Figures:
    if c.status != "ok" or run is None or not run.times:
        status: Status = c.status if c.status != "ok" else Fate.FAILED
        return Figures(params=c.params, status=status,
                       note=c.note or "no launch was timed")
    times = np.asarray(run.times)
    median = float(np.median(times))
    q1, q3 = np.percentile(times, [25, 75])
    return Figures(params=c.params, status="ok", ms=median,
                   spread=float((q3 - q1) / median) if median > 0 else 0.0,
                   min_ms=float(times.min()), launches=len(run.times), note=run.note)
