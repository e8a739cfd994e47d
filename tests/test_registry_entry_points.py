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
