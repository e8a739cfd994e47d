"""Tuning keys, results and their store, without a device: what a key is bound to, what a
reader refuses, and who wins a write.

The results here are made by hand (their figures are not measurements); what is under
test is the key and the store around them, which never look at the figures' meaning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from farm.core.errors import InputError, ParameterError
from farm.core.keys import Namespace
from farm.core.model import Artifact, LaunchSettings, Variant
from farm.families import Registry
from farm.families.builtin.matmul import SAMPLED_ABOVE
from farm.families.run import check_example
from farm.store.memory import MemoryStore
from farm.store.signing import Signer, SigningStore, Verifier, generate_keypair
from farm.store.sqlite import SQLiteStore
from farm.tuning import store as results
from farm.tuning.keys import TuningSpec, plan, spec_for
from farm.tuning.model import Figures, MeasurePolicy, TuningResult, now

NS = Namespace.for_fingerprint("pocl-test-device-0123")
OTHER_NS = Namespace.for_fingerprint("pocl-test-device-4567")
REGISTRY = Registry.load()
PROBLEM = {"m": 64, "n": 48, "k": 32}
TILES = [{"tile_m": 16, "tile_n": 16, "tile_k": 16},
         {"tile_m": 8, "tile_n": 8, "tile_k": 8}]


def spec(tiles: list[dict[str, int]] = TILES, **problem: int) -> TuningSpec:
    return spec_for(REGISTRY, "matmul", {**PROBLEM, **problem}, candidates=tiles)


def result(s: TuningSpec, times: list[float], ns: Namespace = NS) -> TuningResult:
    figures = [Figures(params=c, status="ok", ms=t, spread=0.01, min_ms=t, launches=10)
               for c, t in zip(s.candidates, times, strict=True)]
    best = min(range(len(times)), key=times.__getitem__)
    return TuningResult(spec=s, fingerprint=ns.fingerprint, candidates=tuple(figures),
                        winner=best, policy=MeasurePolicy(), isolated=True, wall_s=1.0,
                        measured_at=now(), host="h", worker="w")


def test_a_key_changes_with_the_candidates_the_problem_and_the_build() -> None:
    base = spec()
    assert base.problem == {**PROBLEM, "dtype": "float"}  # the family's defaults filled
    assert base.candidates[0] == {**TILES[0], "wpt_m": 1, "wpt_n": 1}
    assert spec().key() == base.key()  # stable
    assert spec(list(reversed(TILES))).key() != base.key()  # order: the first is special
    assert spec(TILES[:1]).key() != base.key()
    assert spec(m=65).key() != base.key()
    assert spec(list(reversed(TILES))).index_key() == base.index_key()  # one problem
    rebuilt = base.model_copy(update={"build_id": "0" * 24})  # a family change
    assert rebuilt.key().build_id != base.key().build_id
    options = spec_for(REGISTRY, "matmul", PROBLEM, candidates=TILES,
                       variant=Variant(options=("-cl-fast-relaxed-math",)))
    assert options.key() != base.key() and options.index_key() != base.index_key()


def test_plan_groups_a_manifests_candidates_by_problem_in_order() -> None:
    mm = REGISTRY.get("matmul")
    arts = [mm.artifact_id({**PROBLEM, **t}) for t in TILES]
    arts += [mm.artifact_id({"m": 8, "n": 8, "k": 8})]  # one candidate: nothing to tune
    arts += [REGISTRY.get("softmax").artifact_id({"cols": 64})]  # no tuning space
    arts += [mm.artifact_id({**PROBLEM, **TILES[0]})]  # a repeat is one candidate
    (only,) = plan(arts, REGISTRY)
    assert only == spec()
    assert only.artifacts() == arts[:2]


def test_a_hand_given_problem_is_checked_in_one_line() -> None:
    with pytest.raises(InputError, match="tuning choices, not part of the problem"):
        spec_for(REGISTRY, "matmul", {**PROBLEM, "tile_m": 8})
    with pytest.raises(InputError, match="no tuning space"):
        spec_for(REGISTRY, "softmax", {"cols": 64})
    with pytest.raises(ParameterError, match="m"):
        spec_for(REGISTRY, "matmul", {"m": 0, "n": 1, "k": 1})
    with pytest.raises(ParameterError, match="not tuning parameters"):
        spec_for(REGISTRY, "matmul", PROBLEM, candidates=[{"m": 4}])
    default = spec_for(REGISTRY, "matmul", PROBLEM)
    assert len(default.candidates) == len(REGISTRY.get("matmul").tuning_space)


def test_a_result_must_be_of_its_key_and_name_the_fastest_right_candidate() -> None:
    s = spec()
    good = result(s, [2.0, 1.0])
    assert good.winner == 1 and good.speedup == pytest.approx(2.0)
    data = good.model_dump(mode="json")
    with pytest.raises(ValueError, match="fastest ok"):
        TuningResult.model_validate({**data, "winner": 0})
    with pytest.raises(ValueError, match="key's candidates"):
        TuningResult.model_validate({**data, "candidates": data["candidates"][:1]})
    wrong = {**data["candidates"][1], "status": "wrong"}
    with pytest.raises(ValueError, match="has no time"):
        TuningResult.model_validate({**data, "candidates": [data["candidates"][0], wrong]})
    with pytest.raises(ValueError):
        MeasurePolicy(min_launches=10, max_launches=5)


def test_the_store_keeps_results_per_device_and_build(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "store.sqlite")
    s = spec()
    assert results.read(store, NS, s) is None
    kept = results.write(store, NS, result(s, [2.0, 1.0]))
    assert results.read(store, NS, s) == kept
    assert results.read_latest(store, NS, spec(list(reversed(TILES)))) == kept
    assert results.read(store, OTHER_NS, s) is None  # a new driver: a new fingerprint
    changed = s.model_copy(update={"build_id": "0" * 24})  # a family change
    assert results.read(store, NS, changed) is None
    assert results.read_latest(store, NS, changed) is None


def test_first_writer_wins_retune_replaces_and_the_index_takes_the_newest(
        tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "store.sqlite")
    s = spec()
    first = results.write(store, NS, result(s, [2.0, 1.0]))
    second = results.write(store, NS, result(s, [1.0, 2.0]))
    assert second == first and results.read(store, NS, s) == first
    redone = results.write(store, NS, result(s, [1.0, 3.0]), replace=True)
    assert redone.winner == 0 and results.read(store, NS, s) == redone
    other = spec(list(reversed(TILES)))
    newest = results.write(store, NS, result(other, [5.0, 4.0]))
    assert results.read_latest(store, NS, s) == newest
    assert results.read(store, NS, s) == redone  # each list keeps its own


def test_a_result_under_the_wrong_key_or_device_is_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    s, other = spec(), spec(m=65)
    foreign = results.encode(result(other, [1.0, 2.0]))  # another problem's result
    store.put(NS, Artifact.create(s.key(), "tune", foreign, "0" * 64))
    moved = results.encode(result(s, [1.0, 2.0], ns=OTHER_NS))  # another device's
    store.put(NS, Artifact.create(s.index_key(), "tune-index", moved, "0" * 64))
    with caplog.at_level(logging.WARNING):
        assert results.read(store, NS, s) is None
        assert results.read_latest(store, NS, s) is None
    assert "describes another key" in caplog.text and "not this device" in caplog.text
    for junk in (b"", b"{", b"null", b"\xff" * 64, b'{"format": 2}'):
        store.delete(NS, s.key())
        store.put(NS, Artifact.create(s.key(), "tune", junk, "0" * 64))
        assert results.read(store, NS, s) is None
    kept = results.write(store, NS, result(s, [3.0, 1.0]))  # a good one takes its place
    assert results.read(store, NS, s) == kept


def test_signed_results_and_unsigned_ones_refused(tmp_path: Path) -> None:
    private, public = generate_keypair()
    plain = SQLiteStore(tmp_path / "store.sqlite")
    signer = Signer(private)
    signed = SigningStore(plain, signer, signer.verifier())
    s = spec()
    results.write(plain, NS, result(s, [2.0, 1.0]))  # a writer without the key
    assert results.read(signed, NS, s) is None  # refused where signatures are verified
    kept = results.write(signed, NS, result(s, [1.0, 2.0]))  # replaced by a signed one
    assert results.read(signed, NS, s) == kept
    assert results.read(SigningStore(plain, None, Verifier(public)), NS, s) == kept
    art = plain.get(NS, s.key())
    assert art is not None and art.meta.signature.startswith("v2:")
    # the signature binds the namespace: the same bytes under another device are refused
    plain.put(OTHER_NS, art)
    assert results.read(signed, OTHER_NS, s) is None


def test_a_large_products_example_is_checked_at_samples() -> None:
    mm = REGISTRY.get("matmul")
    params = mm.validate({"m": 256, "n": 256, "k": 512})
    assert 256 * 256 * 512 > SAMPLED_ABOVE
    example = mm.example(params, LaunchSettings(), np.random.default_rng(0))
    a, b = example.args[0], example.args[1]
    assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
    assert example.sampled[2].size == example.expected[2].size > 1000
    right = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    assert check_example({2: right}, example) == []
    off = right.copy()
    off.reshape(-1)[example.sampled[2][7]] += 1.0
    assert check_example({2: off}, example)
    assert check_example({2: np.zeros_like(right)}, example)


def test_the_workers_message_check_knows_the_tuning_task() -> None:
    import json
    import uuid
    from dataclasses import dataclass, field
    from typing import Any

    from farm.tuning.payloads import TuneRequest
    from worker.poison import problem

    @dataclass
    class Message:
        body: str
        headers: dict[str, Any] = field(default_factory=dict)
        content_type: str = "application/json"

        def decode(self) -> Any:
            return json.loads(self.body)

    payload = TuneRequest(fingerprint=NS.fingerprint, spec=spec()).model_dump(mode="json")

    def message(body: Any, task: str = "farm.tune") -> Message:
        return Message(json.dumps([[body], {}, {}]), {"task": task, "id": str(uuid.uuid4())})

    assert problem(message(payload)) is None
    bad = {**payload, "spec": {**payload["spec"], "candidates": []}}
    assert "payload does not validate: spec.candidates" in str(problem(message(bad)))
    assert "payload does not validate" in str(problem(message(payload, "farm.compile")))
    assert "not 'farm.compile' or 'farm.tune'" in str(problem(message(payload, "farm.x")))


def test_a_hostile_problem_is_refused_where_it_enters() -> None:
    from pydantic import ValidationError

    from farm.tuning.payloads import TunePayloadError, parse_tune_request

    payload = {"fingerprint": NS.fingerprint,
               "spec": spec().model_dump(mode="json")}
    assert parse_tune_request(payload).spec == spec()
    for problem in ({"m": "x" * 70_000}, {"m": [[[[]]]] * 20_000}):
        with pytest.raises(TunePayloadError, match=r"spec\.problem"):
            parse_tune_request({**payload, "spec": {**payload["spec"], "problem": problem}})
    with pytest.raises(ValidationError):
        TuningSpec(family="matmul", problem={"m": float("nan")}, candidates=({},),
                   build_id="0" * 24)
    with pytest.raises(TunePayloadError, match="fingerprint"):
        parse_tune_request({**payload, "fingerprint": "../etc"})
