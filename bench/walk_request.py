"""The walk of a request through a worker: which modules ``execute_job`` crosses, how
often it climbs back up into a module above the one it is in, and how often it enters
each module.

Not a timing: the structure of one request, traced (``sys.setprofile``) in this process
on a real worker state (this machine's OpenCL device, a memory store, leases and the
crash ledger in a real Redis of its own, records to a list), for four chunks:

* ``compiled``: one new kernel (the chunk's fast path: its lease, its look, the
  compile, the records, the write, the end);
* ``loaded``: the same kernel again;
* ``kernel by kernel``: a new kernel whose compile lease another worker holds for a
  moment (the old path: ``worker.kernel``, through ``farm.compilation.obtain.obtain``);
* ``program``: an application's program (``worker.programs``).

A *crossing* is a call from a function of one module of ``farm/``, ``worker/`` or
``loader/`` into a function of another; a *stop* is a module the walk enters; a *climb*
is a crossing into a module that imports (directly or not) the module it comes from:
a call back up the layers (a callback handed down, or, before issue 32, an import
inside a function). The walk's figures are recorded in docs/DESIGN.md ("The walk of a
request"). Caches off (``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``).

    .venv/bin/python bench/walk_request.py [--verbose]

Prints each chunk's crossings in first-seen order (``--verbose``), its figures, then one
JSON line (``{"bench": "walk_request", ...}``).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOTS = ("farm", "worker", "loader")


@dataclass
class Walk:
    """What the profiler saw of one chunk."""

    crossings: dict[tuple[str, str], int] = field(default_factory=dict)
    entries: dict[str, set[str]] = field(default_factory=dict)

    def see(self, caller: str, callee: str, function: str, site: str) -> None:
        self.crossings[(caller, callee)] = self.crossings.get((caller, callee), 0) + 1
        self.entries.setdefault(callee, set()).add(f"{site} -> {function}")


def _ours(name: str) -> bool:
    return name.split(".")[0] in ROOTS


def trace(run: Callable[[], object]) -> Walk:
    walk = Walk()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller_frame = frame.f_back
        caller = caller_frame.f_globals.get("__name__", "")
        if callee != caller and _ours(callee) and _ours(caller):
            walk.see(caller, callee, frame.f_code.co_name,
                     f"{caller}.{caller_frame.f_code.co_name}")

    threading.setprofile(profile)  # the chunk's store requests run on the state's threads
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return walk


def above(graph: Any) -> Callable[[str, str], bool]:
    """``above(a, b)``: module ``a`` imports ``b``, directly or not (``a`` is above)."""
    cache: dict[str, set[str]] = {}

    def imports(a: str) -> set[str]:
        if a not in cache:
            cache[a] = set(graph.find_upstream_modules(a, as_package=False))
        return cache[a]

    return lambda a, b: b in imports(a)


def figures(walk: Walk, is_above: Callable[[str, str], bool], start: str) -> dict[str, Any]:
    stops = {start} | {callee for _, callee in walk.crossings}
    climbs = sorted(f"{a} -> {b}" for a, b in walk.crossings if is_above(b, a))
    return {"stops": len(stops), "crossings": len(walk.crossings), "climbs": len(climbs),
            "climbs_are": climbs,
            "entries": {m: len(sites) for m, sites in sorted(walk.entries.items())
                        if len(sites) > 2}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)

    import grimp
    import redis

    from farm.cluster.lease import Leases
    from farm.cluster.payloads import KernelRequest
    from farm.compilation.backend import OpenCLBackend
    from farm.core.device import open_device, probe_devices, select_device
    from farm.core.hashing import sha256_hex
    from farm.core.outage import redis_waiter
    from farm.core.settings import Settings
    from farm.devservices import RedisServer
    from farm.families import Registry
    from farm.programs.request import ChunkRequest, ProgramRequest
    from farm.programs.spec import ProgramSpec
    from farm.records import Recorder
    from farm.store import MemoryStore
    from worker.chunks import Delivery
    from worker.crashes import TaskLedger
    from worker.execute import execute_job
    from worker.state import WorkerState

    class ListSink:
        def write_session(self, session: object, *, keep_sessions: int | None = None) -> None:
            pass

        def write_records(self, records: Sequence[object]) -> None:
            pass

        def close(self) -> None:
            pass

    is_above = above(grimp.build_graph(*ROOTS, cache_dir=None))
    device = select_device(probe_devices())
    ctx, cl_device = open_device(device)
    registry = Registry.load([])
    family = registry.get("elementwise_binary")
    salt = f"{time.time_ns()}"
    results: dict[str, Any] = {}
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        settings = Settings(redis_url=server.url, native_binaries=False,
                            home=Path(server.directory) / "home")
        state = WorkerState(settings=settings, registry=registry, device=device,
                            backend=OpenCLBackend.on(device, ctx, cl_device),
                            store=MemoryStore(), leases=Leases(client, ttl_s=5),
                            recorder=Recorder(ListSink(), label="walk"), name="walk:1",
                            redis=client, redis_waiter=redis_waiter(server.url, 5))

        def kernel(op: str) -> KernelRequest:
            artifact = family.artifact_id({"op": op})
            return KernelRequest(artifact=artifact, build_id=family.build_id)

        def chunk(kernels: list[KernelRequest], programs: list[ProgramRequest] = ()
                  ) -> Callable[[], object]:
            request = ChunkRequest(fingerprint=device.fingerprint, kernels=kernels,
                                     programs=list(programs))
            task = f"walk-{salt}-{len(results)}"
            delivery = Delivery(task_id=task, redelivered=False)
            if hasattr(delivery, "ledger"):  # the crash hook's part (before issue 32,
                # execute_job made the ledger itself: a tree before it is walked as is)
                delivery.ledger = TaskLedger(client, task, state.redis_waiter,
                                             settings.crash_limit, redelivered=False)
            return lambda: execute_job(request, state, delivery=delivery)

        source = f"__kernel void walk(__global float *x) {{ x[0] = {len(salt)}; }}\n"
        digest = state.store.put_blob(source.encode())
        program = ProgramRequest(spec=ProgramSpec(source=digest, source_size=len(source)))
        assert digest == sha256_hex(source.encode())

        def held_elsewhere(req: KernelRequest) -> Callable[[], object]:
            lowered = family.lower_id(req.artifact, device)
            other = state.leases.try_acquire(state.ns, lowered.source_hash)
            assert other is not None
            threading.Timer(0.2, other.release).start()
            return chunk([req])

        walks = {"compiled": chunk([kernel("add")]), "loaded": chunk([kernel("add")]),
                 "kernel by kernel": held_elsewhere(kernel("mul")),
                 "program": chunk([], [program])}
        for name, run in walks.items():
            walk = trace(run)
            results[name] = figures(walk, is_above, "worker.execute")
            print(f"{name}: {results[name]['stops']} stops, {results[name]['crossings']} "
                  f"crossings, {results[name]['climbs']} climbs back up")
            for climb in results[name]["climbs_are"]:
                print(f"    climb: {climb}")
            for module, n in results[name]["entries"].items():
                print(f"    {module} entered from {n} places")
            if args.verbose:
                for (a, b), n in walk.crossings.items():
                    print(f"    {a} -> {b} ({n})")
        client.close()
    print(json.dumps({"bench": "walk_request", "device": device.fingerprint, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
