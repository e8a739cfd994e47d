"""Installing the hook in every Python process of ``farm run``, without touching the code.

``farm run`` starts the command with ``farm/programs/shim`` first on ``PYTHONPATH`` and
``FARM_RUN_DIR`` naming a private folder. Python imports the shim's ``sitecustomize``
at start-up, which puts a finder on ``sys.meta_path`` and imports nothing of the farm:
the hook is installed (:func:`install_from_env`) the moment the process imports
``pyopencl``, so a process that never uses OpenCL (a shell, a build tool, ``pip``) pays
one finder and nothing else. Why ``sitecustomize`` rather than wrapping the command in
``python -m``: the command may be a shell script, ``mpirun`` or a launcher that starts
many interpreters, and every one of them must be served. Child processes inherit the
environment, so every rank of an MPI job or worker of a multiprocessing pool is served
too.

Each process writes its counts (and, with ``FARM_RUN_CAPTURE=1``, its capture) into
``FARM_RUN_DIR`` at exit; ``farm run`` sums them into the run's one line.

The moment the process *starts* importing ``pyopencl`` (before the import itself, 0.2 to
0.5 s), :func:`before_pyopencl` starts the prover ahead of the application on a node that
has not proven its programs yet (:mod:`farm.programs.ahead`), so that the proofs overlap
the application's own start.
"""

from __future__ import annotations

import os
import sys

from farm.core.runenv import RUN_CAPTURE, RUN_DIR

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from farm.programs.ahead import Ahead


def shim_folder() -> str:
    """The folder ``farm run`` puts first on ``PYTHONPATH`` (holds ``sitecustomize``)."""
    return os.path.join(os.path.dirname(os.path.realpath(__file__)), "shim")


#: the prover ahead :func:`before_pyopencl` started (or found), for the hook
_AHEAD: list[Ahead | None] = []


def before_pyopencl() -> None:
    """Start the prover ahead of this application (see the module docstring), where the
    quick path will serve it: no capture asked, settings it reads."""
    try:
        if os.environ.get(RUN_CAPTURE) == "1":
            return
        from farm.programs.ahead import start
        from farm.programs.plan import application_digest
        from farm.programs.rows import Config

        config = Config(dict(os.environ))
        if not config.declined:
            _AHEAD[:] = [start(config.home, application_digest())]
    except Exception as exc:  # never break the application: it is proven later
        print(f"kernel-farm: warning: the prover ahead is not started ({exc})",
              file=sys.stderr)


def install_from_env() -> None:
    """Install the hook as ``farm run`` asked (``FARM_RUN_DIR``, ``FARM_RUN_CAPTURE``):
    :func:`farm.programs.hook.arm`, which imports nothing of the program server."""
    from pathlib import Path

    from farm.programs.hook import arm

    try:
        arm(Path(os.environ[RUN_DIR]), capture=os.environ.get(RUN_CAPTURE) == "1",
            ahead=_AHEAD[0] if _AHEAD else None)
    except Exception as exc:  # never break the application: it runs unserved
        print(f"kernel-farm: warning: the farm's hook is not installed ({exc}); "
              "programs are built the plain way", file=sys.stderr)
