"""What a family author meets: ``farm families list``/``check``, families from
``FARM_FAMILY_MODULES`` in every command, an optional ``example()``, and bad input in a
manifest (a launch shape the parameters rule out, a failed validator) reported as
parameter errors with their line and exit status 2.

The CLI runs as a subprocess with a user module of three families on ``PYTHONPATH``:
``good`` (its example matches numpy), ``wrong`` (its kernel adds 1, its reference 2)
and ``bare`` (no example at all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from farm.core.device import discover_devices, select_device
from farm.core.errors import ParameterError
from farm.core.model import LaunchSettings
from farm.families import KernelFamily, Params, Registry
from farm.manifest import expand, load_manifest

FARM = Path(sys.executable).with_name("farm")

USER_MODULE = '''
import numpy as np
from farm import Example, KernelFamily, Lowered, Params


class AddParams(Params):
    amount: float = 1.0


def _lower(name):
    return Lowered(source=(
        f"__kernel void {name}(__global float *x, const uint n) {{\\n"
        "    const size_t i = get_global_id(0);\\n"
        "    if (i < n) x[i] = x[i] + 1.0f;\\n}\\n"), kernel_names=(name,))


class Good(KernelFamily[AddParams]):
    name = "good"
    params_model = AddParams

    def lower(self, params, launch, device):
        return _lower("good")

    def example(self, params, launch, rng):
        x = rng.uniform(size=37).astype(np.float32)
        return Example("good", [x, np.uint32(37)], (37,), None, {0: x + 1.0})


class Wrong(Good):
    name = "wrong"

    def lower(self, params, launch, device):
        return _lower("wrong")

    def example(self, params, launch, rng):
        x = rng.uniform(size=37).astype(np.float32)
        return Example("wrong", [x, np.uint32(37)], (37,), None, {0: x + 2.0})


class Bare(KernelFamily[AddParams]):
    name = "bare"
    params_model = AddParams

    def lower(self, params, launch, device):
        return _lower("bare")


class Broken(Good):
    name = "broken"

    def lower(self, params, launch, device):
        return Lowered(source="__kernel void broken(__global float *x) { x[0] = ; }",
                       kernel_names=("broken",))


FAMILIES = [Good, Wrong, Bare, Broken]
'''

MANIFEST = """format = 1

[[kernels]]
family = "good"

[[kernels]]
family = "bare"
params = { amount = 2.0 }
"""


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("userfams")
    (root / "userfams.py").write_text(USER_MODULE)
    (root / "m.toml").write_text(MANIFEST)
    return root


@pytest.fixture(scope="module")
def fingerprint() -> str:
    """The device the commands pick by default (no FARM_DEVICE)."""
    return select_device(discover_devices()).fingerprint


def farm(user_dir: Path, home: Path, *args: str, modules: bool = True
         ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYTHONPATH=str(user_dir), PYOPENCL_NO_CACHE="1",
               POCL_KERNEL_CACHE="0", CUDA_CACHE_DISABLE="1")
    if modules:
        env["FARM_FAMILY_MODULES"] = '["userfams"]'
    return subprocess.run([str(FARM), *args], env=env, cwd=user_dir, capture_output=True,
                          text=True, timeout=300, check=False)


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def one_error(proc: subprocess.CompletedProcess[str], rc: int = 2) -> str:
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# -- farm families --------------------------------------------------------------------------
def test_check_reports_one_line_per_family_and_fails_on_a_difference(
        user_dir: Path, tmp_path: Path) -> None:
    proc = farm(user_dir, tmp_path, "families", "check", "good", "wrong", "bare", "broken",
                "softmax")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    log = [line for line in proc.stdout.splitlines() if line.startswith("    | ")]
    lines = [line.split(None, 2) for line in proc.stdout.splitlines()
             if not line.startswith("    | ")]
    assert lines[:3] == [
        ["ok", "good", "its example matches numpy"],
        ["differs", "wrong", "wrong(): argument 0: max abs error 1"],
        ["no-example", "bare", "no example()"],
    ]
    assert lines[3][:2] == ["failed", "broken"]
    # the compiler's own diagnostic, as farm build shows it: its first error on the line,
    # then the whole build log, not "clBuildProgram failed" and nothing else
    assert lines[3][2].startswith("broken(): the platform compiler refused the source: ")
    assert "expected expression" in lines[3][2]
    assert any("expected expression" in line for line in log), proc.stdout
    assert "clBuildProgram failed" not in proc.stdout
    assert lines[4] == ["ok", "softmax", "its example matches numpy"]
    assert len(lines) == 5 and "Traceback" not in proc.stderr


def test_check_of_good_families_exits_0(user_dir: Path, tmp_path: Path,
                                        fingerprint: str) -> None:
    proc = farm(user_dir, tmp_path, "families", "check", "good", "bare", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert [(f["name"], f["status"], f["examples"]) for f in data["families"]] == [
        ("good", "ok", 1), ("bare", "no-example", 0)]
    assert data["device"] == fingerprint


def test_check_of_an_unknown_family_is_bad_input(user_dir: Path, tmp_path: Path) -> None:
    line = one_error(farm(user_dir, tmp_path, "families", "check", "good", "nosuch"))
    assert line == "error: unknown kernel family 'nosuch'"


def test_list_names_where_each_family_comes_from(user_dir: Path, tmp_path: Path) -> None:
    proc = farm(user_dir, tmp_path, "families", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["families"]}
    assert rows["good"]["source"] == "module userfams (FARM_FAMILY_MODULES)"
    assert (rows["good"]["example"], rows["bare"]["example"]) == (True, False)
    assert rows["matmul"]["source"] == "entry point builtin (kernel-farm)"
    assert rows["matmul"]["build_id"] == Registry.load().get("matmul").build_id


def test_list_names_an_entry_point_that_cannot_be_loaded(user_dir: Path,
                                                         tmp_path: Path) -> None:
    """A plugin whose import fails is shown with the reason, and the rest still works."""
    site = tmp_path / "site"
    dist = site / "brokenplugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplugin\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[kernel_farm.families]\nbroken_plugin = no_such_module_here:FAMILIES\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path), PYTHONPATH=str(site))
    proc = subprocess.run([str(FARM), "families", "list"], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("not loaded: entry point broken_plugin: "
                                "ModuleNotFoundError"), proc.stdout
    assert any(line.startswith("softmax ") for line in lines)
    assert "Traceback" not in proc.stderr


def test_a_family_without_example_is_a_complete_family() -> None:
    class P(Params):
        pass

    class NoExample(KernelFamily[P]):
        name = "no_example"
        params_model = P

        def lower(self, params, launch, device):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    family = NoExample()  # not abstract
    assert family.example(P(), LaunchSettings(), None) is None  # type: ignore[arg-type]


# -- FARM_FAMILY_MODULES in every command ---------------------------------------------------
def test_manifest_show_uses_family_modules(user_dir: Path, tmp_path: Path) -> None:
    proc = farm(user_dir, tmp_path, "manifest", "show", "m.toml", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["families"] == {"bare": 1, "good": 1}
    proc = farm(user_dir, tmp_path, "manifest", "show", "m.toml", modules=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    first, second = proc.stderr.strip().splitlines()  # every error of the manifest
    assert "m.toml:4: kernels[0].family: unknown kernel family 'good'" in first
    assert "m.toml:7: kernels[1].family: unknown kernel family 'bare'" in second


def test_build_of_an_unnamed_manifest_with_a_family_without_example(
        user_dir: Path, tmp_path: Path, fingerprint: str) -> None:
    """A manifest without ``name`` is called by its file's name, not "None"; a family
    with no example builds like any other."""
    proc = farm(user_dir, tmp_path, "build", "m.toml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"farm build m on {fingerprint}" in " ".join(proc.stdout.split())
    assert "None" not in proc.stdout
    again = farm(user_dir, tmp_path, "build", "m.toml", "--json")
    assert json.loads(again.stdout)["summary"]["loaded"] == 2


# -- parameter errors -----------------------------------------------------------------------
LAUNCH_MISMATCH = """\
    format = 1
    name = "launch"

    [[kernels]]
    family = "softmax"
    params = { cols = 128 }
    local_size = [32]
"""


@pytest.mark.parametrize("command", [["build"], ["build", "--json"], ["manifest", "show"]])
def test_a_launch_shape_the_parameters_rule_out_is_a_parameter_error(
        command: list[str], user_dir: Path, tmp_path: Path) -> None:
    path = write(tmp_path / "launch.toml", LAUNCH_MISMATCH)
    line = one_error(farm(user_dir, tmp_path / "home", *command, str(path)))
    assert line.endswith(f"{path}:7: kernels[0].local_size: softmax: launch local_size (32,) "
                         "differs from the work-group (64,) that its parameters fix")


def test_a_matching_launch_shape_expands(tmp_path: Path) -> None:
    path = write(tmp_path / "ok.toml", LAUNCH_MISMATCH.replace("[32]", "[64]"))
    (entry,) = expand(load_manifest(path), Registry.load())
    assert entry.artifact.kernel.launch.local_size == (64,)


def test_check_launch_is_device_independent() -> None:
    matmul = Registry.load().get("matmul")
    params = {"m": 8, "n": 8, "k": 8, "wpt_m": 2}  # work-group (8, 16)
    matmul.check_launch(params, LaunchSettings(local_size=(8, 16)))
    matmul.check_launch(params, LaunchSettings())
    with pytest.raises(ParameterError, match=r"local_size \(16, 16\) differs"):
        matmul.check_launch(params, LaunchSettings(local_size=(16, 16)))


def test_validator_messages_carry_no_pydantic_prefix(user_dir: Path, tmp_path: Path) -> None:
    softmax = Registry.load().get("softmax")
    with pytest.raises(ParameterError) as info:
        softmax.kernel_id({"cols": 128, "group_size": 48})
    assert str(info.value) == "softmax: parameter group_size: 48 is not a power of two"
    path = write(tmp_path / "bad.toml", LAUNCH_MISMATCH.replace(
        "local_size = [32]", "").replace("cols = 128", "cols = 128, group_size = 48"))
    line = one_error(farm(user_dir, tmp_path, "build", str(path)))
    assert line == (f"error: {path}:6: kernels[0].params.group_size: softmax: parameter "
                    "group_size: 48 is not a power of two")


def test_every_builtin_family_can_be_checked() -> None:
    """``farm families check`` needs parameters for each built-in family (they all have
    required ones): every built-in names some, and they validate."""
    for family in Registry.load():
        assert family.example_params, family.name
        for params in family.example_params:
            family.validate(params)
