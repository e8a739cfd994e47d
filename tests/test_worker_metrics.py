"""What the workers' metrics say about a chunk (issue 32): a chunk with a failed kernel
is not a success, and a fingerprint's series exist from 0 before their first count."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from farm.cluster.metrics import TASK_STATUSES, WorkerMetrics
from farm.cluster.payloads import CompileReply, KernelReply
from farm.core.model import KernelFailure
from farm.core.outcomes import Outcome
from worker.hooks.metrics import chunk_status


def reply(*results: tuple[Outcome | None, str | None]) -> CompileReply:
    return CompileReply(results=[
        KernelReply(id_hash=f"{i:032x}", outcome=outcome,
                    failure=KernelFailure(kind=kind, message="x") if kind else None)
        for i, (outcome, kind) in enumerate(results)])


def test_a_chunk_with_a_failed_kernel_is_not_a_success() -> None:
    assert chunk_status(reply((Outcome.COMPILED, None), (Outcome.LOADED, None))) == "success"
    # a kernel the device cannot run is the device's limit, not a failure of the chunk
    assert chunk_status(reply((Outcome.COMPILED, None), (None, "unsupported"))) == "success"
    assert chunk_status(reply((Outcome.COMPILED, None), (None, "compile"))) == "kernel_failed"
    assert "kernel_failed" in TASK_STATUSES


def metrics() -> tuple[WorkerMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    made = WorkerMetrics(
        tasks=Counter("farm_tasks", "t", ["fingerprint", "status"], registry=registry),
        kernels=Counter("farm_kernels", "k", ["fingerprint", "outcome", "kind"],
                        registry=registry),
        compile_seconds=Histogram("farm_compile_seconds", "c", ["fingerprint"],
                                  registry=registry),
        load_seconds=Histogram("farm_load_seconds", "l", ["fingerprint"], registry=registry),
        store_requests=Counter("farm_store_requests", "s", ["tier", "result"],
                               registry=registry),
        store_bytes=Counter("farm_store_bytes", "b", ["tier", "direction"],
                            registry=registry),
        lease_wait_seconds=Histogram("farm_lease_wait_seconds", "w", ["fingerprint"],
                                     registry=registry))
    return made, registry


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[Any, ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_series_of_a_fingerprint_starts_at_zero_with_its_first_chunk() -> None:
    made, registry = metrics()
    made.task("fp", "success")
    found = samples(registry)
    for status in TASK_STATUSES:
        want = 1.0 if status == "success" else 0.0
        assert found[("farm_tasks_total", (("fingerprint", "fp"), ("status", status)))] \
            == want
    assert found[("farm_kernels_total",
                  (("fingerprint", "fp"), ("kind", ""), ("outcome", "loaded")))] == 0.0
    assert found[("farm_load_seconds_count", (("fingerprint", "fp"),))] == 0.0
    made.reply("fp", reply((None, "compile")))
    made.task("fp", "kernel_failed")
    found = samples(registry)
    assert found[("farm_tasks_total", (("fingerprint", "fp"), ("status", "kernel_failed")))] \
        == 1.0
