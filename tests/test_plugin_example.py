"""The plugin of docs/PLUGINS.md (``examples/clamp-plugin``), as its author would use it.

The package is pip-installed into a fresh virtual environment: no ``FARM_FAMILY_MODULES``,
no ``PYTHONPATH``, so the farm can only find the family through the distribution's entry
point. Then, with that environment's Python and a fresh ``FARM_HOME``: ``farm families
list`` names the entry point, ``farm families check`` runs the example against numpy,
``farm build`` compiles the example manifest, and the example's application script loads
a kernel through ``KernelLoader`` (refusing to compile) and compares it with numpy.

The environment reuses the farm and its dependencies installed for this test run (a
``.pth`` file adds their site-packages), and the package is built without build isolation
or an index: no network, a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sysconfig
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "clamp-plugin"


class PluginEnv:
    """A fresh virtual environment with the example plugin installed, and a runner."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.src = root / "clamp-plugin"  # a copy: building writes into the source tree
        shutil.copytree(EXAMPLE, self.src, ignore=shutil.ignore_patterns(
            "build", "*.egg-info", "__pycache__"))
        venv.EnvBuilder(with_pip=False).create(root / "venv")
        self.python = root / "venv" / "bin" / "python"
        purelib = Path(subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True).stdout.strip())
        parents = dict.fromkeys([sysconfig.get_paths()["purelib"],
                                 sysconfig.get_paths()["platlib"]])
        (purelib / "_kernel_farm_under_test.pth").write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
        self.purelib = purelib
        self.home = root / "farm-home"

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("FARM_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(FARM_HOME=str(self.home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
                   CUDA_CACHE_DISABLE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        return subprocess.run([str(self.python), *args], cwd=self.src, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginEnv]:
    env = PluginEnv(tmp_path_factory.mktemp("plugin"))
    proc = env.run("-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                   "--no-index", str(env.src))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield env


def test_the_plugin_is_installed_only_in_its_environment(plugin: PluginEnv) -> None:
    assert (plugin.purelib / "clamp_kernels" / "clamp.py").is_file()
    assert importlib.util.find_spec("clamp_kernels") is None  # not in the farm's own env


def test_the_family_is_found_through_its_entry_point(plugin: PluginEnv) -> None:
    proc = plugin.run("-m", "farm", "families", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["broken"] == {}
    rows = {row["name"]: row for row in data["families"]}
    assert rows["clamp"]["source"] == "entry point clamp (kernel-farm-clamp)"
    assert rows["clamp"]["module"] == "clamp_kernels.clamp"
    assert rows["clamp"]["example"] is True
    assert rows["softmax"]["source"] == "entry point builtin (kernel-farm)"


def test_families_check_runs_its_example_against_numpy(plugin: PluginEnv) -> None:
    proc = plugin.run("-m", "farm", "families", "check", "clamp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["ok", "clamp", "2", "examples", "match", "numpy"]


def test_build_the_manifest_then_load_and_run_a_kernel(plugin: PluginEnv) -> None:
    proc = plugin.run("-m", "farm", "build", "clamp.toml", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["failures"] == [] and report["unsupported"] == []
    assert report["summary"]["kernels"] == 3
    assert report["summary"]["compiled"] == 3
    # the application script loads from the store (on_miss="fail") and checks numpy
    proc = plugin.run("run_clamp.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "clamp matches numpy (1 kernel loaded from the store)"
    # built once: a second build finds every kernel stored
    again = json.loads(plugin.run("-m", "farm", "build", "clamp.toml", "--json").stdout)
    assert again["summary"]["loaded"] == 3 and again["summary"]["compiled"] == 0


def test_a_bad_parameter_names_the_field_and_line(plugin: PluginEnv) -> None:
    bad = plugin.src / "bad.toml"
    bad.write_text('format = 1\n\n[[kernels]]\nfamily = "clamp"\n'
                   'params = { lo = 2.0, hi = 1.0 }\n')
    proc = plugin.run("-m", "farm", "build", str(bad))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"error: {bad}:5: kernels[0].params.hi: clamp: "
                                   "parameter hi: must be above lo (2.0)")



def test_the_guide_shows_the_example_as_it_is() -> None:
    """docs/PLUGINS.md quotes the family module and the manifest's kernels: they must be
    the files this test installs, not an older copy."""
    guide = (EXAMPLE.parents[1] / "docs" / "PLUGINS.md").read_text()
    family = (EXAMPLE / "clamp_kernels" / "clamp.py").read_text()
    body = family[family.index("from __future__ import annotations"):]
    assert f"```python\n{body}```\n" in guide
    manifest = (EXAMPLE / "clamp.toml").read_text()
    for entry in manifest.split("[[kernels]]")[1:]:
        code = "\n".join(line.split("#")[0].rstrip() for line in entry.strip().splitlines())
        assert f"[[kernels]]\n{code}\n" in guide, code
