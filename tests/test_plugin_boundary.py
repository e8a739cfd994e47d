"""Hostile or buggy plugin code fails its kernel, not the build (issue 19 item 9).

One plugin module, each family a way plugin code goes wrong: a ``lower()`` that returns
a ``Lowered`` built without validation, parameter validators that raise what pydantic
does not turn into a validation error, ``sys.exit`` and ``BaseException`` subclasses,
code that never returns, and an 8 MiB multi-line message. A build of them with one good
kernel ends with its summary: the good kernel built, every hostile one failed with a
short one-line reason, no traceback, in bounded time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HOSTILE = '''
import sys
from typing import Literal

from pydantic import field_validator, model_validator

from farm.core.model import Lowered
from farm.families.base import KernelFamily, Params

GOOD = "__kernel void k(__global float *x) { x[get_global_id(0)] += 1.0f; }"


class HowParams(Params):
    how: str


class BadLowered(KernelFamily[HowParams]):
    """Returns a Lowered made with model_construct: no validation ran."""

    name = "hostile_lowered"
    params_model = HowParams

    def lower(self, params, launch, device):
        bad = {"int-source": dict(source=123, options=(), kernel_names=("k",)),
               "bytes-source": dict(source=GOOD.encode(), options=(), kernel_names=("k",)),
               "options-none": dict(source=GOOD, options=None, kernel_names=("k",)),
               "int-names": dict(source=GOOD, options=(), kernel_names=(1, 2))}
        return Lowered.model_construct(**bad[params.how])


class RaisingParams(Params):
    how: str

    @field_validator("how")
    @classmethod
    def _raise(cls, value):
        if value == "key":
            return {}["missing"]
        if value == "attribute":
            return None.nothing
        raise RuntimeError("a validator that gives up")


class BadValidator(KernelFamily[RaisingParams]):
    name = "hostile_validator"
    params_model = RaisingParams

    def lower(self, params, launch, device):
        return Lowered(source=GOOD, kernel_names=("k",))


class Fatal(BaseException):
    pass


class Exits(KernelFamily[HowParams]):
    name = "hostile_exits"
    params_model = HowParams

    def lower(self, params, launch, device):
        if params.how == "exit":
            sys.exit(3)
        raise Fatal("not an Exception")


class LoopingParams(Params):
    how: str

    @model_validator(mode="after")
    def _forever(self):
        while self.how == "validator":
            pass
        return self


class Loops(KernelFamily[LoopingParams]):
    name = "hostile_loops"
    params_model = LoopingParams
    time_limit_s = 2.0

    def lower(self, params, launch, device):
        while True:
            pass


class Shouts(KernelFamily[HowParams]):
    name = "hostile_shouts"
    params_model = HowParams

    def lower(self, params, launch, device):
        raise RuntimeError("a very long line\\n" * (8 * 1024 * 1024 // 17))


FAMILIES = [BadLowered, BadValidator, Exits, Loops, Shouts]
'''

CASES = [("hostile_lowered", how) for how in
         ("int-source", "bytes-source", "options-none", "int-names")] + \
    [("hostile_validator", how) for how in ("key", "attribute", "runtime")] + \
    [("hostile_exits", "exit"), ("hostile_exits", "base"),
     ("hostile_loops", "lower"), ("hostile_loops", "validator"),
     ("hostile_shouts", "long")]


def test_hostile_plugin_code_fails_its_kernels_and_the_build_ends_with_a_summary(
        tmp_path: Path) -> None:
    (tmp_path / "hostile.py").write_text(HOSTILE)
    lines = ['format = 1', 'name = "hostile"', '',
             '[[kernels]]', 'family = "elementwise_unary"', 'params = { op = "neg" }', '']
    for family, how in CASES:
        lines += ["[[kernels]]", f'family = "{family}"', f'params = {{ how = "{how}" }}', ""]
    manifest = tmp_path / "m.toml"
    manifest.write_text("\n".join(lines))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), FARM_FAMILY_MODULES='["hostile"]',
               PYTHONPATH=str(tmp_path), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "farm", "build", str(manifest), "--local",
                           "--workers", "0", "--json"], env=env, text=True,
                          capture_output=True, timeout=240, check=False)
    assert time.monotonic() - started < 120, "a hung plugin was not bounded"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    summary = report["summary"]
    assert (summary["compiled"], summary["failed"]) == (1, len(CASES)), summary
    assert len(proc.stdout) < 64 * 1024, "a plugin's message went out verbatim"
    for failure in report["failures"]:
        text = json.dumps(failure)
        assert len(text) < 2000 and "\\n" not in failure.get("message", ""), text[:300]
    messages = " ".join(f.get("message", "") for f in report["failures"])
    for needle in ("KeyError", "AttributeError", "RuntimeError", "SystemExit", "Fatal",
                   "did not return within", "does not validate"):
        assert needle in messages, (needle, messages[:3000])
