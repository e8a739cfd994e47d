"""Check the images without a Docker engine (none runs on the development machines).

What a `docker build` would find out late, found here in seconds:

* **hadolint** on every ``docker/*.Dockerfile`` (settings and the one explained ignore
  in ``docker/.hadolint.yaml``);
* **COPY sources**: every file or folder a ``COPY`` (from the build context) names
  exists, and the Dockerfile's own ``.dockerignore`` does not leave it out of the
  context;
* **locks agree with pyproject.toml**: each lock pins every requirement of the extras
  its image installs, at a version the requirement accepts, with hashes; the ingester's
  lock has no device library (pyopencl, PoCL), the NVIDIA worker's no PoCL;
* **the locks install** (``--lock-install``): each into a fresh virtualenv with
  ``pip install --require-hashes``, then the project with ``--no-build-isolation`` (no
  network: the build backend is in the lock), then ``pip check``, the imports the
  image needs, and for the CPU worker's lock an OpenCL platform (PoCL). Slow the first
  time (downloads), so a pass is remembered under ``~/.cache/kernel-farm/lock-check``
  by the hash of the lock and pyproject.toml.

Usage: ``python scripts/check_images.py [--lock-install]``. Prints one line per problem
and exits 1 when there is any.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"

#: lock -> (extras its images install, modules the image imports, modules it must lack)
LOCKS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "worker-cpu.lock": (("opencl", "pocl", "cluster", "postgres"),
                        ("farm.cli.main", "worker.app", "loader", "pyopencl", "celery",
                         "minio", "psycopg", "prometheus_client"), ()),
    "worker-nvidia.lock": (("opencl", "cluster", "postgres"),
                           ("farm.cli.main", "worker.app", "loader", "pyopencl", "celery",
                            "minio", "psycopg", "prometheus_client"),
                           ("pocl_binary_distribution",)),
    "ingester.lock": (("cluster", "postgres"),
                      ("farm.cli.main", "farm.records.ingest", "redis", "psycopg",
                       "sqlalchemy", "prometheus_client"),
                      ("pyopencl", "pocl_binary_distribution")),
}
#: snippets a lock's virtualenv must run: the CPU image must find its PoCL device
RUNS: dict[str, str] = {
    "worker-cpu.lock": "import pyopencl as cl; assert cl.get_platforms(), 'no OpenCL "
                       "platform'; print([d.name for p in cl.get_platforms() "
                       "for d in p.get_devices()])",
}


@dataclass
class Instruction:
    line: int
    word: str
    args: str


def instructions(dockerfile: Path) -> list[Instruction]:
    """A Dockerfile's instructions, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(dockerfile.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        text = " ".join(p for p in pending if p)
        pending = []
        word, _, rest = text.partition(" ")
        out.append(Instruction(start, word.upper(), rest.strip()))
    return out


def copy_sources(dockerfile: Path) -> list[tuple[int, str]]:
    """(line, source) of every COPY/ADD that reads the build context."""
    found = []
    for ins in instructions(dockerfile):
        if ins.word not in ("COPY", "ADD"):
            continue
        args = ins.args
        parts = json.loads(args) if args.startswith("[") else args.split()
        flags = [p for p in parts if p.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        paths = [p for p in parts if not p.startswith("--")]
        found += [(ins.line, src) for src in paths[:-1]]
    return found


class DockerIgnore:
    """A .dockerignore's patterns, with Docker's rules: the last matching pattern wins,
    ``!`` includes again, and a pattern that matches a folder covers what is inside."""

    def __init__(self, path: Path | None) -> None:
        self.patterns: list[tuple[bool, str]] = []
        if path is not None and path.exists():
            for raw in path.read_text().splitlines():
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                negate = line.startswith("!")
                pattern = line[1:] if negate else line
                self.patterns.append((negate, pattern.strip("/").removeprefix("./")))

    @staticmethod
    def _matches(pattern: str, rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            tail = pattern[3:]
            return any(fnmatch.fnmatchcase(p, tail) for p in parts) or \
                any(fnmatch.fnmatchcase(p, tail) for p in prefixes)
        return any(fnmatch.fnmatchcase(p, pattern) and p.count("/") == pattern.count("/")
                   for p in prefixes)

    def excluded(self, rel: str) -> bool:
        verdict = False
        for negate, pattern in self.patterns:
            if self._matches(pattern, rel):
                verdict = not negate
        return verdict


def check_copy_sources(dockerfile: Path, root: Path = ROOT) -> list[str]:
    """Problems with the context files a Dockerfile copies."""
    ignore = DockerIgnore(dockerfile.with_name(dockerfile.name + ".dockerignore"))
    problems = []
    for line, src in copy_sources(dockerfile):
        where = f"{dockerfile.relative_to(root)}:{line}"
        target = root / src
        if not target.exists():
            problems.append(f"{where}: COPY source {src} does not exist")
            continue
        files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file()]
        sent = [f for f in files if not ignore.excluded(f.relative_to(root).as_posix())]
        if not sent:
            problems.append(f"{where}: COPY source {src} is left out of the build context "
                            f"by {dockerfile.name}.dockerignore")
    return problems


# -- locks -------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(lock: Path) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) of a pip-compile --generate-hashes lock."""
    out: dict[str, tuple[str, int]] = {}
    current = None
    for line in lock.read_text().splitlines():
        found = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if found:
            current = _canonical(found.group(1))
            out[current] = (found.group(2), 0)
        elif line and not line[0].isspace():
            current = None  # another requirement (a direct reference) or a comment
        elif current and "--hash=sha256:" in line:
            version, hashes = out[current]
            out[current] = (version, hashes + 1)
    return out


def requirements(extras: tuple[str, ...], pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The requirement strings of the core dependencies and ``extras`` (self-references
    such as ``kernel-farm[opencl]`` expanded)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name = _canonical(project["name"])
    optional = project.get("optional-dependencies", {})
    out = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            head = re.match(r"^([A-Za-z0-9._-]+)\[([^\]]+)\]", req)
            if head and _canonical(head.group(1)) == name:
                todo += [e.strip() for e in head.group(2).split(",")]
            else:
                out.append(req)
    return out


def check_lock(lock: Path, extras: tuple[str, ...], forbidden: tuple[str, ...],
               pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Problems of a lock against the requirements of ``extras`` in pyproject.toml."""
    from packaging.requirements import Requirement

    where = lock.relative_to(ROOT) if lock.is_relative_to(ROOT) else lock
    if not lock.exists():
        return [f"{where}: missing (scripts/lock-images writes it)"]
    pins = pinned(lock)
    problems = []
    for text in requirements(extras, pyproject):
        req = Requirement(text)
        name = _canonical(req.name)
        if name not in pins:
            problems.append(f"{where}: {req.name} (pyproject.toml) is not pinned: run "
                            "scripts/lock-images")
            continue
        version, _ = pins[name]
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{where}: {req.name}=={version} does not satisfy "
                            f"{req.specifier} (pyproject.toml): run scripts/lock-images")
    for line in lock.read_text().splitlines():
        if re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])? @ ", line):
            problems.append(f"{where}: pins a direct reference ({line.split(' (')[0]}): a "
                            "self-referencing extra? The images install the project apart")
    for name, (version, hashes) in sorted(pins.items()):
        if hashes == 0:
            problems.append(f"{where}: {name}=={version} has no --hash")
    for name in forbidden:  # import names; their distributions spell - for _
        if _canonical(name) in pins:
            problems.append(f"{where}: pins {name}, which this image must not carry")
    return problems


def lock_install(lock: Path, imports: tuple[str, ...], absent: tuple[str, ...],
                 python: str = sys.executable) -> list[str]:
    """Install ``lock`` and the project into a fresh virtualenv, as the images do."""
    digest = hashlib.sha256(lock.read_bytes() + (ROOT / "pyproject.toml").read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kernel-farm" / \
        "lock-check"
    stamp = cache / f"{lock.stem}-{digest.hexdigest()[:20]}.ok"
    if stamp.exists():
        print(f"check-images: {lock.name}: installs (cached pass, {stamp.name})")
        return []
    where = lock.relative_to(ROOT)
    with tempfile.TemporaryDirectory(prefix="farm-lock-") as tmp:
        venv = Path(tmp) / "venv"
        src = Path(tmp) / "src"
        # A copy of what the image copies: the build must not see .venv or build/.
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        for package in ("farm", "worker", "loader"):
            shutil.copytree(ROOT / package, src / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        bin_ = venv / "bin"
        steps: list[tuple[str, list[str]]] = [
            ("venv", [python, "-m", "venv", str(venv)]),
            ("pip install --require-hashes", [str(bin_ / "python"), "-m", "pip", "install",
                                              "-q", "--no-deps", "--require-hashes", "-r",
                                              str(lock)]),
            ("the project", [str(bin_ / "python"), "-m", "pip", "install", "-q", "--no-deps",
                             "--no-build-isolation", "--no-index", str(src)]),
            ("pip check", [str(bin_ / "python"), "-m", "pip", "check"]),
            ("imports", [str(bin_ / "python"), "-c", "import " + ", ".join(imports)]),
        ]
        if lock.name in RUNS:
            steps.append(("an OpenCL device", [str(bin_ / "python"), "-c", RUNS[lock.name]]))
        for module in absent:
            steps.append((f"no {module}", [
                str(bin_ / "python"), "-c",
                f"import importlib.util as u, sys; sys.exit(u.find_spec({module!r}) is not None)"]))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        for what, cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp,
                                  timeout=1800, check=False)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
                return [f"{where}: {what} failed in a fresh virtualenv: {tail[0]}"]
    cache.mkdir(parents=True, exist_ok=True)
    stamp.touch()
    print(f"check-images: {lock.name}: installs in a fresh virtualenv")
    return []


def hadolint() -> list[str]:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or \
        shutil.which("hadolint")
    if exe is None:
        return ["hadolint is not installed: scripts/bootstrap installs it (dev extra)"]
    files = sorted(str(p) for p in DOCKER.glob("*.Dockerfile"))
    proc = subprocess.run([exe, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"),
                           *files], capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        return [f"hadolint: {line}" for line in lines] or ["hadolint failed"]
    print(f"check-images: hadolint: {len(files)} Dockerfiles clean")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lock-install", action="store_true",
                        help="also install each lock into a fresh virtualenv (cached)")
    args = parser.parse_args(argv)
    problems = hadolint()
    for dockerfile in sorted(DOCKER.glob("*.Dockerfile")):
        problems += check_copy_sources(dockerfile)
    print("check-images: COPY sources checked")
    for name, (extras, imports, absent) in LOCKS.items():
        lock = DOCKER / "requirements" / name
        found = check_lock(lock, extras, absent)
        problems += found
        if args.lock_install and not found:
            problems += lock_install(lock, imports, absent)
    for problem in problems:
        print(f"check-images: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
