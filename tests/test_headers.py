"""The served quick path reads program bodies and work-group records with the standard
library (``farm.programs.headers``); the program server reads them with their pydantic
models (``farm.programs.body.read_body``, ``farm.programs.supplements.decode``). Both
must give the same answer for every input: the same fields when both accept, a refusal
when either refuses. Where the small reader leaves a header to the model (types the farm
never writes), the model's answer is the answer, so only what it decides alone is
compared here, on hostile headers, random ones and damaged bytes; and it must decide
alone every header the farm itself writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
from typing import Any

import pytest

from farm.core.model import Key, ReadyLaunch
from farm.programs import body, exactly, headers, supplements

KEY = Key(id_hash="ab" * 32, build_id="cd" * 12)
DEVICE = "pocl-test-0123456789ab"
BASE = "kf" + "1" * 38
KERNELS = frozenset({"scale", "shift"})
SOURCE = ("__kernel void scale(__global float *a, float k) "
          "{ int i = get_global_id(0); a[i] *= k; }\n"
          "__kernel void shift(__global float *a, float k) "
          "{ int i = get_global_id(0); a[i] += k; }\n")

#: values of every JSON type and the shapes the models' constraints sit on
ODD: list[Any] = [None, True, False, 0, 1, 2, -1, 1.0, 16.0, 1.5, "1", "16", "", "x",
                  "true", "yes", [], [1], ["x"], {}, {"a": 1}, "a" * 64, "A" * 64,
                  "ab" * 32 + "\n", "\ud800", "é", 4096, 4097, 10 ** 30,
                  float("nan"), str(KEY), str(KEY) + "\n", DEVICE.upper(), BASE, BASE + "\n"]


def _framed(magic: bytes, header: Any, tail: bytes) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return magic + struct.pack(">I", len(raw)) + raw + tail


# -- bodies ------------------------------------------------------------------------------------
GOOD_BODY = {"format": 1, "program": str(KEY), "device": DEVICE,
             "kernels": ["scale", "shift"], "log": "warning: \x1b[2J a log"}


def _model_body(data: bytes) -> tuple[Any, ...]:
    try:
        got = body.read_body(data, KEY, DEVICE)
    except body.BodyError:
        return ("refused",)
    return ("read", got.header.program, got.header.device, got.kernels, got.log, got.binary)


def _quick_body(data: bytes) -> tuple[Any, ...] | None:
    try:
        got = headers.read_body(data, str(KEY), DEVICE)
    except headers.BodyError:
        return ("refused",)
    except headers.Undecided:
        return None
    return ("read", *got)


def _body_cases() -> list[bytes]:
    rng = random.Random(30)
    cases = [_framed(body.MAGIC, GOOD_BODY, b"binary")]
    for field in [*GOOD_BODY, "extra"]:
        cases += [_framed(body.MAGIC, {**GOOD_BODY, field: value}, b"binary") for value in ODD]
        cases.append(_framed(body.MAGIC, {k: v for k, v in GOOD_BODY.items() if k != field},
                             b"binary"))
    for kernels in (["k", "k"], ["1k"], ["k\n"], ["a" * 1024], ["a" * 1025], ["_"] * 4097,
                    [f"k{i}" for i in range(4097)], ["__cuda_sm20_div_u64", "scale"]):
        cases.append(_framed(body.MAGIC, {**GOOD_BODY, "kernels": kernels}, b"b"))
    for log in ("x" * (4 * 1024 * 1024), "x" * (4 * 1024 * 1024 + 1), "a\ud800b", "é\n\t"):
        cases.append(_framed(body.MAGIC, {**GOOD_BODY, "log": log}, b"b"))
    for header in ([], "s", 1, None, b"{", b"[" * 5000, b'{"format": NaN}',
                   b'{"program": "' + str(KEY).encode() + b'", "device": "' + DEVICE.encode()
                   + b'", "device": "other"}'):
        cases.append(_framed(body.MAGIC, header, b"b"))
    cases += [_framed(body.MAGIC, GOOD_BODY, b""), b"KFPROG0", body.MAGIC + b"\xff" * 4]
    for _ in range(400):  # random values in random fields, nested one level
        header: dict[str, Any] = dict(GOOD_BODY)
        for _ in range(rng.randint(1, 3)):
            value = rng.choice(ODD)
            header[rng.choice([*GOOD_BODY, "kernels"])] = (
                [value, "scale"] if rng.random() < 0.3 else value)
        cases.append(_framed(body.MAGIC, header, b"binary"))
    good = cases[0]
    for _ in range(300):  # damaged bytes
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cases.append(bytes(data))
    return cases


def test_the_small_body_reader_answers_as_the_model_does() -> None:
    decided = 0
    cases = _body_cases()
    for data in cases:
        quick = _quick_body(data)
        if quick is not None:
            decided += 1
            assert quick == _model_body(data), data[:300]
    assert _quick_body(cases[0]) == _model_body(cases[0]) != ("refused",)
    assert decided > len(cases) // 3, (decided, len(cases))  # most odd types: the model
    # what the farm writes, it decides alone
    written = body.encode_body(KEY, DEVICE, ("scale", "shift"), "a log\n\x1b", b"bin")
    assert _quick_body(written) == _model_body(written) == (
        "read", str(KEY), DEVICE, ("scale", "shift"), "a log\n\x1b", b"bin")


def test_a_body_the_model_must_decide_is_decided_by_it() -> None:
    data = _framed(body.MAGIC, {**GOOD_BODY, "format": 1.0}, b"binary")
    with pytest.raises(headers.Undecided):
        headers.read_body(data, str(KEY), DEVICE)
    assert exactly.body_exactly(data, str(KEY), DEVICE).kernels == ("scale", "shift")
    refused = _framed(body.MAGIC, {**GOOD_BODY, "format": "1"}, b"binary")
    with pytest.raises(headers.BodyError):
        exactly.body_exactly(refused, str(KEY), DEVICE)


# -- records ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def function(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A work-group function PoCL made for ``scale`` (a launch in a child process)."""
    cache = tmp_path_factory.mktemp("wg")
    script = (
        "import numpy as np, pyopencl as cl\n"
        "ctx = cl.Context([next(d for p in cl.get_platforms() if 'Portable' in p.name "
        "for d in p.get_devices())]); q = cl.CommandQueue(ctx)\n"
        f"p = cl.Program(ctx, {SOURCE!r}).build()\n"
        "a = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4096)\n"
        "p.scale(q, (1024,), (16,), a, np.float32(2)); q.finish()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POCL_")}
    proc = subprocess.run([sys.executable, "-c", script],
                          env={**env, "POCL_CACHE_DIR": str(cache), "PYOPENCL_NO_CACHE": "1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    [found] = cache.rglob("scale/16-1-1-goffs0-smallgrid/scale.so")
    return found.read_bytes()


def _model_record(data: bytes) -> tuple[Any, ...]:
    try:
        got = supplements.decode(data, KEY, BASE, DEVICE, KERNELS)
    except supplements.StaleRecord:
        return ("stale",)
    except supplements.SupplementError:
        return ("refused",)
    return ("read", got.functions)


def _quick_record(data: bytes) -> tuple[Any, ...] | None:
    try:
        got = headers.read_record(data, str(KEY), BASE, DEVICE, KERNELS)
    except headers.StaleRecord:
        return ("stale",)
    except headers.SupplementError:
        return ("refused",)
    except headers.Undecided:
        return None
    return ("read", got)


def _function_header(function: bytes, **changed: Any) -> dict[str, Any]:
    return {"kernel": "scale", "local_size": [16, 1, 1], "zero_offset": True,
            "small_grid": True, "size": len(function),
            "sha256": hashlib.sha256(function).hexdigest(), **changed}


def _record_cases(function: bytes) -> list[bytes]:
    rng = random.Random(29)
    fn = _function_header(function)
    good = {"format": 2, "program": str(KEY), "base": BASE, "device": DEVICE,
            "functions": [fn]}

    def framed(header: Any, tail: bytes = function) -> bytes:
        return _framed(supplements.MAGIC, header, tail)

    cases = [framed(good)]
    for field in [*good, "extra"]:
        cases += [framed({**good, field: value}) for value in ODD]
        cases.append(framed({k: v for k, v in good.items() if k != field}))
    for field in [*fn, "launch", "extra"]:
        cases += [framed({**good, "functions": [{**fn, field: value}]}) for value in ODD]
        cases.append(framed({**good, "functions": [
            {k: v for k, v in fn.items() if k != field}]}))
    launch = ReadyLaunch(kernel_name="scale", global_size=(1024,), local_size=(16,))
    for local in ([0, 1, 1], [4096, 1, 1], [4097, 1, 1], [16, 1], [16, 1, 1, 1],
                  [True, 1, 1], ["16", 1, 1]):
        cases.append(framed({**good, "functions": [{**fn, "local_size": local}]}))
    for kernel in ("shift", "nosuch", "../x", "a" * 200, "a" * 201, "scale\n"):
        cases.append(framed({**good, "functions": [{**fn, "kernel": kernel}]}))
    cases += [
        framed({**good, "functions": [{**fn, "launch": launch.model_dump(mode="json")}]}),
        framed({**good, "functions": [fn, fn]}, function * 2),
        framed({**good, "functions": [fn] * 257}, function * 257),
        framed({**good, "base": "kf" + "2" * 38}),
        framed({**good, "device": "pocl-other-0123456789ab"}),
        framed({**good, "program": "ab" * 4 + ".cd" + "cd" * 4}),
        framed(good, function[:-1]), framed(good, function + b"!"),
        framed(good, b"x" * len(function)), framed(b"{"), framed(b"[" * 5000),
        b"KFWGSUP1" + framed(good)[8:], supplements.MAGIC + struct.pack(">I", 1 << 30)]
    for _ in range(400):
        header: dict[str, Any] = dict(good)
        changed: dict[str, Any] = dict(fn)
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.5:
                header[rng.choice(list(good))] = rng.choice(ODD)
            else:
                changed[rng.choice([*fn, "launch"])] = rng.choice(ODD)
        if header.get("functions") is fn or "functions" not in header or header[
                "functions"] == [fn]:
            header["functions"] = [changed]
        cases.append(framed(header))
    for _ in range(300):
        data = bytearray(cases[0])
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cases.append(bytes(data))
    return cases


def test_the_small_record_reader_answers_as_the_model_does(function: bytes) -> None:
    cases = _record_cases(function)
    decided = 0
    for data in cases:
        quick = _quick_record(data)
        if quick is not None:
            decided += 1
            assert quick == _model_record(data), data[:400]
    assert _quick_record(cases[0]) == _model_record(cases[0]) == (
        "read", {("scale", "16-1-1-goffs0-smallgrid"): function})
    assert decided > len(cases) // 3, (decided, len(cases))  # most odd types: the model
    written = supplements.encode(KEY, BASE, DEVICE,
                                 {("scale", "16-1-1-goffs0-smallgrid"): function,
                                  ("shift", "8-1-1"): function.replace(b"scale", b"shift")})
    assert _quick_record(written) == _model_record(written)
    assert _quick_record(written) is not None


def test_a_record_with_a_launch_is_the_models_to_read(function: bytes) -> None:
    pair = ("scale", "16-1-1-goffs0-smallgrid")
    launch = ReadyLaunch(kernel_name="scale", global_size=(1024,), local_size=(16,))
    data = supplements.encode(KEY, BASE, DEVICE, {pair: function}, {pair: launch})
    with pytest.raises(headers.Undecided):
        headers.read_record(data, str(KEY), BASE, DEVICE, KERNELS)
    assert exactly.record_exactly(data, str(KEY), BASE, DEVICE, KERNELS) == {pair: function}


def test_the_formats_are_spelled_once() -> None:
    """The models read the constants and patterns of farm.programs.headers."""
    assert body.MAGIC is headers.BODY_MAGIC and supplements.MAGIC is headers.RECORD_MAGIC
    assert body.BodyError is headers.BodyError
    assert supplements.SupplementError is headers.SupplementError
    assert body.BodyHeader.model_fields["program"].metadata[0].pattern == \
        headers.PROGRAM_PATTERN
