"""A user's package of kernels is picked up through the entry-point group."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from farm.families import ENTRY_POINT_GROUP


def test_an_installed_distribution_registers_its_families(tmp_path: Path) -> None:
    pkg = tmp_path / "userkernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        import numpy as np
        from farm.families.base import Example, KernelFamily, Params
        from farm.core.model import Lowered


        class NegParams(Params):
            pass


        class Neg(KernelFamily[NegParams]):
            name = "user_neg"
            params_model = NegParams

            def lower(self, params, launch, device):
                return Lowered(source="__kernel void neg(__global float *x)"
                               " { x[get_global_id(0)] = -x[get_global_id(0)]; }",
                               kernel_names=("neg",))

            def example(self, params, launch, rng):
                x = rng.uniform(size=4).astype(np.float32)
                return Example("neg", [x], (4,), None, {0: -x})
    '''))
    dist = tmp_path / "userkernels-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: userkernels\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nuser = userkernels:Neg\n")
    code = ("from farm.families import Registry; r = Registry.load(); "
            "print('user_neg' in r, 'matmul' in r)")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]


CLASHING = '''
import numpy as np
from farm.families.base import Example, KernelFamily, Params
from farm.core.model import Lowered


class P(Params):
    pass


class MyMatmul(KernelFamily[P]):
    name = "matmul"  # a built-in family's name
    params_model = P

    def lower(self, params, launch, device):
        return Lowered(source="__kernel void mm(__global float *x) { }", kernel_names=("mm",))


class Fine(MyMatmul):
    name = "user_fine"


FAMILIES = [Fine, MyMatmul]
'''


def _install(site: Path, name: str, module: str, code: str) -> None:
    (site / f"{module}.py").write_text(code)
    dist = site / f"{name}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nclash = {module}:FAMILIES\n")


def test_a_plugin_named_like_a_builtin_is_skipped_with_one_warning(tmp_path: Path) -> None:
    """The built-in family stays, the clash is named, and every command still works."""
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "clashkernels", "clashkernels", CLASHING)
    env = {"PYTHONPATH": str(site), "FARM_HOME": str(tmp_path / "home"),
           "PATH": "/usr/bin:/bin"}
    code = ("from farm.families import Registry; r = Registry.load(); "
            "print(type(r.get('matmul')).__module__, 'user_fine' in r, r.broken['clash'])")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)
    module, fine, why = proc.stdout.strip().split(" ", 2)
    assert module == "farm.families.builtin.matmul"  # the built-in kept
    assert fine == "False"  # the plugin skipped whole, not half-registered
    assert "family 'matmul' of clashkernels clashes with a built-in family" in why
    [warning] = proc.stderr.strip().splitlines()  # one warning line, no traceback
    assert "family plugin clash" in warning and "skipped" in warning

    farm = Path(sys.executable).with_name("farm")
    listing = subprocess.run([str(farm), "families", "list"], env=env, capture_output=True,
                             text=True, check=False)
    assert listing.returncode == 0, listing.stderr
    assert any(line.startswith("matmul ") for line in listing.stdout.splitlines())
    assert "not loaded: entry point clash: SettingsError: family 'matmul'" in listing.stdout
    assert "Traceback" not in listing.stderr

