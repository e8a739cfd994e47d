"""``farm run``'s environment: the variables it sets for the processes it serves, and
the environment of a process the farm starts itself inside such a run.

Standard library only, and no more than ``os``: ``farm run``'s own process reads these
names (:mod:`farm.programs.runner`), and it imports as little as it can.
"""

from __future__ import annotations

import os

#: ``farm run``'s folder for its processes' counts (:mod:`farm.programs.autoinstall`)
RUN_DIR = "FARM_RUN_DIR"
#: "1" when ``farm run`` captures what its processes build
RUN_CAPTURE = "FARM_RUN_CAPTURE"
#: FARM_HOME unless set: this folder under ``XDG_CACHE_HOME`` (or ``~/.cache``)
HOME_FOLDER = "kernel-farm"


def default_home(env: dict[str, str] | os._Environ[str]) -> str:
    """FARM_HOME's default: :data:`HOME_FOLDER` under ``XDG_CACHE_HOME`` (or
    ``~/.cache``)."""
    return os.path.join(env.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"),
                                                               ".cache")), HOME_FOLDER)


def home_of(env: dict[str, str] | os._Environ[str]) -> str:
    """The farm home ``env`` names: ``FARM_HOME``, else :func:`default_home`, as
    :class:`farm.core.settings.Settings` reads it."""
    return env.get("FARM_HOME") or default_home(env)


def unserved_environment() -> dict[str, str]:
    """This process's environment for a child the farm starts itself (a proof's child,
    the prover ahead): never served nor counted by ``farm run`` (killed when the
    application ends, or ending after it, it would read as a process that died before
    its end)."""
    return {k: v for k, v in os.environ.items() if k not in (RUN_DIR, RUN_CAPTURE)}


def script_digest(path: str) -> str:
    """The SHA-256 of the file at ``path`` (an application's main script: the
    application, to its plan and its generated code), "" when it cannot be read."""
    import hashlib

    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return ""
