"""Imported by Python at start-up in every process ``farm run`` starts (this folder is
first on ``PYTHONPATH``; see farm/programs/autoinstall.py).

It imports nothing of the farm: it puts a finder on ``sys.meta_path`` that, when the
process imports ``pyopencl``, lets pyopencl load and then installs the farm's hook
(``farm.programs.autoinstall.install_from_env``). A process that never uses OpenCL pays
one finder; one whose Python cannot import the farm runs unserved, with one warning.
Then it runs the ``sitecustomize`` this one shadows, if there is one.
"""

import os
import sys


def _farm(name):
    """``farm.programs.autoinstall``'s function ``name``, or ``None`` (said once)."""
    try:
        from farm.programs import autoinstall
    except Exception as exc:  # never break the application: it runs unserved
        if not _SAID:
            _SAID.append(exc)
            print(f"kernel-farm: warning: the farm cannot be imported here ({exc}); "
                  "programs are built the plain way", file=sys.stderr)
        return None
    return getattr(autoinstall, name)


_SAID: list = []


def _install() -> None:
    install = _farm("install_from_env")
    if install is not None:
        install()


class _WatchPyopencl:
    """Finds nothing itself; wraps pyopencl's loader so the hook follows its import.

    A finder on ``sys.meta_path`` needs only ``find_spec``; not deriving from
    ``importlib.abc.MetaPathFinder`` spares every process ``farm run`` starts the import
    of ``importlib.abc`` (it pulls in importlib.resources, pathlib, tempfile: about 15 ms
    at each start-up)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "pyopencl":
            return None
        sys.meta_path.remove(self)  # one use; and the search below must not find us
        early = _farm("before_pyopencl")
        if early is not None:
            early()  # the prover ahead, while pyopencl imports
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _install()

        loader.exec_module = exec_module
        return spec


def _arm_and_chain() -> None:
    if os.environ.get("FARM_RUN_DIR"):
        if "pyopencl" in sys.modules:
            _install()
        else:
            sys.meta_path.insert(0, _WatchPyopencl())
    here = os.path.dirname(os.path.abspath(__file__))
    saved = list(sys.path)
    mine = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import sitecustomize  # noqa: F401  (the next one on the path, if any)
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if mine is not None:
            sys.modules["sitecustomize"] = mine


_arm_and_chain()
