"""Which device the farm uses: never one whose compiler fails a trivial build.

* the rule (``farm.core.device.select_device``): a device whose probe build failed is
  skipped, the others in the documented order (newer of two platforms of one name first,
  else OpenCL's); ``FARM_DEVICE`` matching several fingerprints takes the first that
  compiles and says which; matching none exits 2; matching only devices that cannot
  compile fails in one line naming each and its compiler's reason;
* the probe (``farm.core.device_probe``): once per fingerprint, kept in
  ``FARM_DEVICE_PROBES``; a failing device is faked at its seam (the runner that probes),
  and a kept file that is malformed, truncated, hostile or another fingerprint's is
  probed again; what is not the compiler's word (a crash, a hang) is never kept;
* a worker serves only a device that compiles;
* for real, with PoCL's own ``POCL_BUILDING=1`` (it then looks for its headers in its
  build tree, so pyopencl's wheel PoCL refuses every source, as on an AMD Zen 5 CPU, and
  Debian's PoCL lists no device) and only the wheel's PoCL visible (``OCL_ICD_VENDORS``
  at an empty folder): ``farm devices`` says which device cannot compile and why,
  ``farm build tiny`` exits non-zero with one line naming the device and the reason, and
  bootstrap says so in one line, with what to install.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from farm.core.device import DeviceInfo, ProbeResult, preference, select_device
from farm.core.device_probe import Probed, choose_device, probe_builds, probe_in_children
from farm.core.errors import DeviceChoiceError, DeviceError
from farm.core.settings import Settings
from worker.startup import pick_devices

ROOT = Path(__file__).resolve().parents[1]
FARM = Path(sys.executable).with_name("farm")


def _dev(platform_index: int, version: str, name: str = "pthread-cpu",
         platform: str = "Portable Computing Language", device_index: int = 0) -> DeviceInfo:
    return DeviceInfo(
        platform_index=platform_index, device_index=device_index, platform_name=platform,
        platform_version=f"OpenCL 3.0 {version}  Linux, Release", device_name=name,
        vendor="v", device_version="OpenCL 3.0", driver_version=version.split()[-1],
        opencl_c_version="OpenCL C 1.2", max_work_group_size=1024, max_work_item_sizes=(1024,),
        local_mem_size=65536, global_mem_size=2**30, max_compute_units=2, extensions=())


WHEEL = _dev(0, "PoCL 3.0-rc2")          # listed first, as the wheel's ICD may be
DEBIAN = _dev(1, "PoCL 3.1+debian", name="pthread-skylake-avx512-cpu")
GPU = _dev(2, "CUDA 12.8.90", name="NVIDIA H200", platform="NVIDIA CUDA")
BROKEN = "error: unknown target CPU 'generic'"


def _probes(**usable: bool) -> dict[str, ProbeResult]:
    devices = {"wheel": WHEEL, "debian": DEBIAN, "gpu": GPU}
    return {devices[k].fingerprint: ProbeResult(usable=v, reason="" if v else BROKEN)
            for k, v in usable.items()}


# -- the rule ------------------------------------------------------------------------------
def test_the_order_puts_the_newer_of_two_platforms_of_one_name_first() -> None:
    assert preference([WHEEL, DEBIAN, GPU]) == [DEBIAN, WHEEL, GPU]
    assert preference([GPU, WHEEL, DEBIAN]) == [GPU, DEBIAN, WHEEL]  # else OpenCL's order
    assert select_device([WHEEL, DEBIAN]) == DEBIAN


def test_a_device_whose_probe_build_failed_is_never_the_default() -> None:
    assert select_device([DEBIAN, WHEEL], None, _probes(debian=False, wheel=True)) == WHEEL
    assert select_device([GPU, DEBIAN], None, _probes(gpu=False, debian=True)) == DEBIAN
    assert preference([GPU, DEBIAN], _probes(gpu=False, debian=True)) == [DEBIAN, GPU]


def test_no_device_that_compiles_is_one_line_naming_each_and_its_reason() -> None:
    with pytest.raises(DeviceError) as caught:
        select_device([WHEEL, GPU], None, _probes(wheel=False, gpu=False))
    text = str(caught.value)
    assert "\n" not in text and not isinstance(caught.value, DeviceChoiceError)
    assert text.startswith("no OpenCL device here can compile: ")
    for dev, label in ((WHEEL, "PoCL 3.0-rc2"), (GPU, "CUDA 12.8.90")):
        assert f"{dev.fingerprint} ({label}): {BROKEN}" in text
    assert "pocl-opencl-icd" in text  # what to install
    with pytest.raises(DeviceError, match=r"no OpenCL device found.*pocl-opencl-icd"):
        select_device([])


def test_a_selector_matching_several_fingerprints_takes_the_first_that_compiles_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="farm.core.device"):
        assert select_device([WHEEL, DEBIAN, GPU], "pocl") == DEBIAN
        assert select_device([WHEEL, DEBIAN], "pocl", _probes(debian=False)) == WHEEL
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert f"using {DEBIAN.fingerprint}" in said[0] and WHEEL.fingerprint in said[0]
    assert f"using {WHEEL.fingerprint}" in said[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="farm.core.device"):
        assert select_device([WHEEL, DEBIAN], WHEEL.fingerprint[:-3]) == WHEEL  # one match
        assert select_device([WHEEL, DEBIAN, GPU], "h200") == GPU  # a name's part
    assert caplog.records == []


def test_a_selector_matching_none_is_bad_input_and_exits_2() -> None:
    with pytest.raises(DeviceChoiceError) as caught:
        select_device([WHEEL, DEBIAN], "nvidia")
    assert caught.value.exit_code == 2 and isinstance(caught.value, DeviceError)
    assert "'nvidia'" in str(caught.value) and WHEEL.fingerprint in str(caught.value)


def test_a_selector_matching_only_devices_that_cannot_compile_says_why() -> None:
    with pytest.raises(DeviceError) as caught:
        select_device([WHEEL, DEBIAN], WHEEL.fingerprint, _probes(wheel=False))
    assert not isinstance(caught.value, DeviceChoiceError)
    assert f"no device matching '{WHEEL.fingerprint}' can compile" in str(caught.value)
    assert BROKEN in str(caught.value)


def test_a_worker_serves_only_a_device_that_compiles() -> None:
    probes = _probes(debian=False, wheel=True)
    assert pick_devices([DEBIAN, WHEEL], None, probes) == [WHEEL]
    with pytest.raises(DeviceError, match=f"{DEBIAN.fingerprint}.*{BROKEN}"):
        pick_devices([DEBIAN, WHEEL], DEBIAN.fingerprint, probes)
    with pytest.raises(DeviceChoiceError):
        pick_devices([DEBIAN, WHEEL], "nosuch", probes)
    assert pick_devices([DEBIAN, WHEEL], None, None) == [DEBIAN]  # simulated: not probed


# -- the probe and what it keeps ---------------------------------------------------------
class _Runner:
    """The seam: probes devices as told (a fingerprint in ``fail`` fails to build, one in
    ``crash`` crashes its process), counting what it was asked."""

    def __init__(self, fail: Sequence[str] = (), crash: Sequence[str] = ()) -> None:
        self.fail, self.crash = set(fail), set(crash)
        self.asked: list[str] = []

    def __call__(self, devices: Sequence[DeviceInfo]) -> dict[str, Probed]:
        out = {}
        for dev in devices:
            self.asked.append(dev.fingerprint)
            if dev.fingerprint in self.crash:
                out[dev.fingerprint] = Probed(ProbeResult(
                    usable=False, reason="the probe build crashed its process (SIGSEGV)"),
                    keep=False)
            else:
                bad = dev.fingerprint in self.fail
                out[dev.fingerprint] = Probed(ProbeResult(usable=not bad,
                                                          reason=BROKEN if bad else ""),
                                              keep=True)
        return out


def test_a_device_is_probed_once_and_its_outcome_kept(tmp_path: Path) -> None:
    runner = _Runner(fail=[WHEEL.fingerprint])
    first = probe_builds([WHEEL, DEBIAN, WHEEL], tmp_path, run=runner)
    assert runner.asked == [WHEEL.fingerprint, DEBIAN.fingerprint]  # each fingerprint once
    assert first[WHEEL.fingerprint].fresh and not first[WHEEL.fingerprint].usable
    again = probe_builds([WHEEL, DEBIAN], tmp_path, run=_Runner())  # a later start
    assert again == {WHEEL.fingerprint: ProbeResult(usable=False, reason=BROKEN),
                     DEBIAN.fingerprint: ProbeResult(usable=True)}
    fixed = _Runner()
    assert probe_builds([WHEEL], tmp_path, again=True, run=fixed)[WHEEL.fingerprint].usable
    assert fixed.asked == [WHEEL.fingerprint]  # --probe: whatever was kept


def test_a_crash_is_said_but_not_kept(tmp_path: Path) -> None:
    found = probe_builds([WHEEL], tmp_path, run=_Runner(crash=[WHEEL.fingerprint]))
    assert "crashed" in found[WHEEL.fingerprint].reason
    assert list(tmp_path.iterdir()) == []
    later = _Runner()
    assert probe_builds([WHEEL], tmp_path, run=later)[WHEEL.fingerprint].usable
    assert later.asked == [WHEEL.fingerprint]


@pytest.mark.parametrize("content", [
    b"", b"{", b'{"probe": 1, "fingerprint": "FP", "usable": false', b"\xff\xfe\x00junk",
    b'{"probe": 1, "fingerprint": "another-device-0000", "usable": true, "reason": ""}',
    b'{"probe": 999, "fingerprint": "FP", "usable": true, "reason": ""}',
    b'{"probe": 1, "fingerprint": "FP", "usable": "yes please", "reason": ""}',
    b'{"probe": 1, "fingerprint": "FP", "usable": true, "reason": "", "exec": "rm -rf /"}',
    b'{"probe": 1, "fingerprint": "FP", "usable": true, "reason": "' + b"x" * 70_000 + b'"}',
], ids=["empty", "truncated", "cut", "binary", "other-device", "other-version", "wrong-type",
        "extra-field", "huge"])
def test_a_damaged_kept_file_is_probed_again_and_replaced(tmp_path: Path,
                                                          content: bytes) -> None:
    fp = WHEEL.fingerprint
    (tmp_path / f"{fp}.json").write_bytes(content.replace(b"FP", fp.encode()))
    runner = _Runner(fail=[fp])
    assert probe_builds([WHEEL], tmp_path, run=runner)[fp].reason == BROKEN
    assert runner.asked == [fp]
    assert json.loads((tmp_path / f"{fp}.json").read_text())["reason"] == BROKEN


def test_a_folder_that_cannot_be_written_costs_a_probe_not_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for _ in range(2):
        runner = _Runner()
        assert probe_builds([WHEEL], blocker / "probes", run=runner)[WHEEL.fingerprint].usable
        assert runner.asked == [WHEEL.fingerprint]


def test_the_default_skips_a_failing_device_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr("farm.core.device_probe.probe_in_children",
                        _Runner(fail=[DEBIAN.fingerprint]))
    settings = Settings(home=tmp_path / "home", device_probes=tmp_path / "probes")
    with caplog.at_level(logging.WARNING):
        assert choose_device(settings, [DEBIAN, WHEEL]) == WHEEL
        assert choose_device(settings, [DEBIAN, WHEEL]) == WHEEL  # kept: said no more
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and DEBIAN.fingerprint in said[0] and BROKEN in said[0], said


def test_the_real_probe_builds_on_every_device_here_in_child_processes() -> None:
    from farm.core.device import discover_devices

    found = discover_devices()
    probed = probe_in_children(found)
    assert set(probed) == {d.fingerprint for d in found}
    assert all(p.keep for p in probed.values()), probed
    assert any(p.result.usable for p in probed.values()), probed  # this machine compiles
    gone = found[0].model_copy(update={"driver_version": "not-this-driver"})
    (lost,) = probe_in_children([gone]).values()  # a device that is not here (any more)
    assert not lost.keep and not lost.result.usable
    assert "the probe could not run: device changed" in lost.result.reason


# -- for real: PoCL made to fail as on a CPU its LLVM does not know -------------------------
def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "POCL_"))}
    empty = tmp_path / "no-vendors"
    empty.mkdir(exist_ok=True)
    env.update(FARM_HOME=str(tmp_path / "home"), FARM_DEVICE_PROBES=str(tmp_path / "probes"),
               PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0", OCL_ICD_VENDORS=str(empty),
               POCL_BUILDING="1")
    env.update(extra)
    return env


def _farm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FARM), *args], env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def test_with_only_a_pocl_that_cannot_compile_farm_build_fails_in_one_line(
        tmp_path: Path) -> None:
    env = _env(tmp_path)
    listed = _farm(env, "devices", "--json")
    assert listed.returncode == 1, listed.stderr
    (dev,) = json.loads(listed.stdout)
    assert not dev["usable"] and not dev["default"]
    assert "pocl_types.h' file not found" in dev["reason"]
    shown = _farm(env, "devices")
    assert shown.returncode == 1 and "cannot compile: error:" in shown.stdout, shown.stdout
    built = _farm(env, "build", "tiny")
    assert built.returncode == 1
    assert built.stderr.count("\n") == 1, built.stderr  # one line, not one per kernel
    assert built.stderr.startswith(f"error: no OpenCL device here can compile: "
                                   f"{dev['fingerprint']} (PoCL ")
    assert "pocl_types.h' file not found" in built.stderr
    assert "pocl-opencl-icd" in built.stderr  # what to install
    assert "FAILED" not in built.stdout + built.stderr
    # kept: the same device, its compiler mended, is still refused until probed again
    mended = _env(tmp_path)
    del mended["POCL_BUILDING"]
    assert _farm(mended, "devices", "--check").returncode == 1
    again = _farm(mended, "devices", "--check", "--probe")
    assert again.returncode == 0 and dev["fingerprint"] in again.stdout, again.stderr


def test_bootstrap_says_in_one_line_that_no_device_compiles_and_what_to_install(
        tmp_path: Path) -> None:
    proc = subprocess.run([str(ROOT / "scripts" / "bootstrap"), "--no-services"],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("bootstrap: opencl: no OpenCL device here can compile: pocl-"), \
        proc.stdout
    assert "apt-get install pocl-opencl-icd" in last
    assert "helm" not in proc.stdout + proc.stderr  # an application user needs no helm


def test_farm_device_matching_nothing_exits_2_in_one_line(tmp_path: Path) -> None:
    env = _env(tmp_path, FARM_DEVICE="no-such-device-here")
    del env["POCL_BUILDING"], env["OCL_ICD_VENDORS"]
    proc = _farm(env, "build", "tiny")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: device 'no-such-device-here' (FARM_DEVICE or "
                                  "--device) matches no device here; devices here: ")


def test_farm_devices_marks_the_one_the_farm_uses(tmp_path: Path) -> None:
    env = _env(tmp_path)
    del env["POCL_BUILDING"], env["OCL_ICD_VENDORS"]
    listed = json.loads(_farm(env, "devices", "--json").stdout)
    (default,) = [d for d in listed if d["default"]]
    assert default["usable"] and default["reason"] == ""
    assert default["fingerprint"] == select_device(
        [DeviceInfo.model_validate(d) for d in listed]).fingerprint
    text = _farm(env, "devices").stdout
    assert text.count("the farm uses it") == 1
    check = _farm(env, "devices", "--check")
    assert check.stdout.startswith(f"the farm uses {default['fingerprint']} ")


def test_bootstrap_and_the_readme_name_the_same_command_for_the_cluster() -> None:
    bootstrap = (ROOT / "scripts" / "bootstrap").read_text()
    (done,) = [line for line in bootstrap.splitlines() if line.startswith('say "done in')]
    assert "farm cluster up" in done and "farm cluster up" in (ROOT / "README.md").read_text()
    assert "devservices" not in done
