"""The worker's cross-cutting concerns are hooks (``worker.hooks``), registered in one
place: every event reaches every hook in order, and the task, the start-up and the
obtain never reach a concern but through them.

The hooks' effects run in the integration tests of what they do: crash loops and
returns (``test_faults.py``, ``test_cluster.py``), readiness
(``test_worker_readiness.py``), poison messages (``test_poison.py``), metrics
(``test_worker_metrics.py``).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from worker.hooks import HOOKS, worker_hooks
from worker.hooks.base import EVENTS, Hook, Hooks

ROOT = Path(__file__).resolve().parents[1]

#: the modules that hold a concern's machinery: reached only through its hook
CONCERNS = {"worker.crashes", "worker.readiness", "worker.poison", "farm.cluster.metrics",
            "farm.cluster.health"}
#: where the events are sent from, and the one seam they run around
WIRING = ("worker/app.py", "worker/startup.py", "worker/process.py", "worker/execute.py")


class Recorder(Hook):
    def __init__(self, name: str, heard: list[tuple[str, str, tuple[Any, ...]]]) -> None:
        self.name = name
        self.heard = heard

    def __getattribute__(self, attr: str) -> Any:
        if attr in EVENTS:
            return lambda *args: self.heard.append((self.name, attr, args))
        return super().__getattribute__(attr)


def test_every_event_reaches_every_hook_in_order() -> None:
    heard: list[tuple[str, str, tuple[Any, ...]]] = []
    hooks = Hooks([Recorder("first", heard), Recorder("second", heard)])
    expected = []
    for event in EVENTS:
        params = len(inspect.signature(getattr(Hook, event)).parameters) - 1  # not self
        args = tuple(f"{event}-{i}" for i in range(params))
        getattr(hooks, event)(*args)
        expected += [("first", event, args), ("second", event, args)]
    assert heard == expected
    assert len(EVENTS) == 15


def test_a_hook_overrides_only_events() -> None:
    """A typo in an event's name would be a method nobody calls."""
    for hook in HOOKS:
        own = {n for n, v in vars(hook).items() if callable(v) and not n.startswith("_")}
        assert own <= set(EVENTS), f"{hook.__name__}: {sorted(own - set(EVENTS))}"


def test_the_registry_holds_one_hook_per_file() -> None:
    files = {Path(inspect.getfile(hook)).name for hook in HOOKS}
    assert len(files) == len(HOOKS)
    assert {type(h) for h in worker_hooks().hooks} == set(HOOKS)
    assert HOOKS[0].__name__ == "MetricsHook"  # its boot precedes prometheus-client


@pytest.mark.parametrize("path", WIRING)
def test_the_task_start_up_and_obtain_reach_concerns_only_through_hooks(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    imported = {node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module} | \
        {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
         for alias in node.names}
    assert imported & CONCERNS == set()
