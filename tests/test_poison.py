"""The worker's check of task messages (``worker.poison.problem``), without a broker.

The integration test (tests/test_faults.py) sends real messages to a real worker; this
one throws many odd shapes at the check itself: it must never raise, must refuse each,
and must pass a well-formed compile task.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from worker.poison import problem

KERNEL = {"artifact": {"kernel": {"family": "reduce", "params": {"cols": 5}}},
          "build_id": "0123456789abcdef"}
PAYLOAD = {"fingerprint": "pocl-x-0123", "kernels": [KERNEL]}


@dataclass
class Message:
    body: Any
    headers: Any = field(default_factory=lambda: {"task": "farm.compile",
                                                  "id": str(uuid.uuid4())})
    content_type: str = "application/json"
    delivery_info: dict[str, Any] = field(default_factory=dict)

    def decode(self) -> Any:
        return json.loads(self.body)


def msg(body: Any, **headers: Any) -> Message:
    base = {"task": "farm.compile", "id": str(uuid.uuid4())}
    base.update(headers)
    return Message(body=json.dumps(body), headers={k: v for k, v in base.items()
                                                   if v is not None})


def test_a_well_formed_compile_task_passes() -> None:
    assert problem(msg([[PAYLOAD], {}, {"callbacks": None, "errbacks": None,
                                        "chain": None, "chord": None}],
                       timelimit=[20, 25.0], retries=0, eta=None)) is None


@pytest.mark.parametrize(("message", "reason"), [
    (msg({}), "body is not [args, kwargs, embed]"),
    (msg({"a": 1}), "body is not"),
    (msg(5), "body is not"),
    (msg(None), "body is not"),
    (msg([1, 2, 3, 4]), "body is not"),
    (msg([[PAYLOAD], {}, {}], timelimit=["a", "b"]), "timelimit"),
    (msg([[PAYLOAD], {}, {}], timelimit=[True, 1]), "timelimit"),
    (msg([[PAYLOAD], {}, {}], id=None), "header id"),
    (msg([[PAYLOAD], {}, {}], id=5), "header id"),
    (msg([[PAYLOAD], {}, {}], task="farm.other"), "farm.other"),
    (msg([[PAYLOAD], {}, {}], retries="x"), "retries"),
    (msg([[PAYLOAD], {}, {}], expires=[1]), "expires"),
    (msg([[PAYLOAD], {"x": 1}, {}]), "kwargs"),
    (msg([[PAYLOAD, PAYLOAD], {}, {}]), "args"),
    (msg([[PAYLOAD], {}, {"chain": [{"task": "x"}]}]), "embed chain"),
    (msg([[{"fingerprint": "x", "kernels": []}], {}, {}]), "payload does not validate"),
    (Message(body="{not json"), "does not decode"),
    (Message(body=b"\x80\x04K\x05.", content_type="application/x-python-serialize"),
     "content type"),
    (Message(body="[]", headers=None), "headers are not a mapping"),
    (Message(body="[]", headers=[1, 2]), "headers are not a mapping"),
])
def test_malformed_messages_are_refused_with_a_reason(message: Message, reason: str) -> None:
    found = problem(message)
    assert found is not None and reason in found, found


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(8 if depth < 3 else 5)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.randint(-(2**70), 2**70)
    if pick == 3:
        return rng.random() * 1e300
    if pick == 4:
        return "".join(rng.choice("ab\u00e9\U0001f600\x00\n") for _ in range(rng.randrange(6)))
    if pick == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    if pick == 6:
        return {str(_random_json(rng, 3)): _random_json(rng, depth + 1)
                for _ in range(rng.randrange(5))}
    return [[_random_json(rng, depth + 1)], _random_json(rng, depth + 1),
            _random_json(rng, depth + 1)]


def test_random_messages_never_break_the_check() -> None:
    rng = random.Random(8)
    for _ in range(3000):
        headers = _random_json(rng)
        if rng.random() < 0.7:
            headers = {"task": "farm.compile", "id": "x", **(
                {str(rng.choice(["timelimit", "retries", "expires", "eta", "group", "stamps"])):
                 _random_json(rng)} if rng.random() < 0.8 else {})}
        message = Message(body=json.dumps(_random_json(rng)), headers=headers)
        assert problem(message) is not None  # never a valid payload by chance
