#!/usr/bin/env bash
# Run HERE (a machine with the package registries and Go), never on the GPU host: fill the
# ignored folders that carry the cluster to a host with no network (Python 3.12, x86_64):
#   .whl/  every wheel the farm needs there (cp312, manylinux x86_64), pinned to the
#          versions installed in .venv, without numpy (the host has it);
#   .base/ the commit the control-plane benchmark compares with (--baseline), exported;
#   .kit/  redis.tar.xz (Debian's redis-server with the shared libraries it needs and a
#          wrapper that points the loader at them) and minio.xz (MinIO built stripped).
# bench/nvidia_host.sh unpacks both on the host and exports FARM_REDIS_BIN and
# FARM_MINIO_BIN, which farm/devservices uses instead of installing anything.
#   bench/host_kit.sh            # idempotent: what is there is kept
#   bench/host_kit.sh --clean    # start again
# The carry limit is 64 MiB in all (with the ~3 MB tree); the script prints the sizes.
set -euo pipefail
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT="$(pwd)"
say() { printf 'host_kit: %s\n' "$*"; }

if [ "${1:-}" = "--clean" ]; then
    rm -rf .whl .kit
fi
mkdir -p .whl .kit
PY=.venv/bin/python
[ -x "$PY" ] || { say "no .venv: run scripts/bootstrap first"; exit 1; }

# 1. Wheels: the dependency closure of kernel-farm[opencl,cluster] for CPython 3.12 on
# Linux, read from the installed metadata (so the host runs what the tests ran here),
# and the build backend (setuptools, wheel) the project's own install needs there.
# psycopg is left out (the host's records go to SQLite), so are numpy (the host has it)
# and PoCL's wheel (the host has Debian's PoCL 5 behind the ICD loader).
"$PY" - > .kit/requirements.txt <<'EOF'
import importlib.metadata as md
import re
from packaging.requirements import Requirement

ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}
SKIP = {"kernel-farm", "numpy"}
seen: dict[str, str] = {}

def walk(name: str, extras: tuple[str, ...] = ()) -> None:
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen and not extras:
        return
    seen[key] = md.distribution(name).version
    for text in md.distribution(name).requires or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({**ENV, "extra": e})
                                     for e in ("", *extras)):
            walk(req.name, tuple(req.extras))

walk("kernel-farm", ("opencl", "cluster"))
# The build backend too: nvidia_host.sh builds the project on the host without
# isolation, and pyproject.toml wants a newer setuptools than a host may have.
# Mako: pyopencl's reductions and scans (the pyopencl.array application of
# bench/bench_pyopencl_app.py and tests/test_programs_gpu.py) template their sources.
for name in ("setuptools", "wheel", "mako", "markupsafe"):
    seen[name] = md.distribution(name).version
for key, version in sorted(seen.items()):
    if key not in SKIP:
        print(f"{key}=={version}")
EOF
wanted=$(wc -l < .kit/requirements.txt)
have=$(find .whl -name '*.whl' | wc -l)
if [ "$have" -ge "$wanted" ]; then
    say "wheels: $have in .whl (wanted $wanted)"
else
    say "wheels: downloading $wanted for cp312 manylinux x86_64"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --dest .whl \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any \
        -r .kit/requirements.txt
fi

# 1b. The third-party applications of tests/test_programs_gpu.py (reikna's FFT and
# matrix product, loopy's generated kernels) at the versions installed here (the dev
# extra pins them): about 3.4 MB. Several are published as sources only, so the
# pure-Python ones go through `pip wheel` (py3-none-any, built here); islpy is compiled,
# so its cp312 wheel is fetched.
# The islpy wheel is checked by version: a .whl left from before the dev extra kept islpy
# below 2026 would carry the islpy that loopy 2025.2 fails with.
islpy=$("$PY" -c 'import importlib.metadata as m; print(m.version("islpy"))')
if ! ls .whl/reikna-*.whl ".whl/islpy-$islpy-"*.whl >/dev/null 2>&1; then
    say "wheels: the applications' (reikna, loopy and their closure)"
    apps=$("$PY" -c 'import importlib.metadata as m
for n in ("reikna", "funcsigs", "loopy", "pymbolic", "genpy", "cgen", "codepy",
          "constantdict", "colorama"):
    print(f"{n}=={m.version(n)}")')
    rm -f .whl/islpy-*.whl
    # shellcheck disable=SC2086
    "$PY" -m pip wheel -q --no-deps --wheel-dir .whl $apps
    "$PY" -m pip download -q --no-deps --only-binary=:all: --dest .whl \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 "islpy==$islpy"
fi

# 2. redis-server: Debian's binary with every shared library it loads except the C
# library's own (libc, libm, the dynamic loader), which the host's newer glibc provides.
if [ ! -s .kit/redis.tar.xz ]; then
    bin=$(command -v redis-server || true)
    [ -n "$bin" ] || { say "redis-server is not installed here (scripts/bootstrap)"; exit 1; }
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/redis/lib"
    cp "$(readlink -f "$bin")" "$stage/redis/redis-server.bin"
    ldd "$bin" | awk '/=> \//{print $3}' | while read -r lib; do
        case "$(basename "$lib")" in
            libc.so.*|libm.so.*|ld-linux*|libpthread.so.*|libdl.so.*|librt.so.*) ;;
            *) cp -L "$lib" "$stage/redis/lib/" ;;
        esac
    done
    cat > "$stage/redis/redis-server" <<'EOF'
#!/bin/sh
# Debian's redis-server with the libraries it was linked against, beside it.
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server.bin" "$@"
EOF
    chmod +x "$stage/redis/redis-server"
    tar -C "$stage" -cJf .kit/redis.tar.xz redis
    say "redis: $("$bin" --version | cut -d' ' -f3) with $(ls "$stage/redis/lib" | wc -l) libraries"
fi

# 3. MinIO, stripped (-s -w) and xz-compressed: 150 MB plain, ~112 MB stripped, ~29 MB xz.
# Built into a folder of its own: the machine's GOBIN/minio stays as it is. The version
# is the one already built here (go's module cache has it), else the latest.
if [ ! -s .kit/minio.xz ]; then
    command -v go >/dev/null || { say "Go is needed to build MinIO"; exit 1; }
    version="${MINIO_VERSION:-}"
    if [ -z "$version" ]; then
        gobin="$(go env GOBIN)"; gobin="${gobin:-$(go env GOPATH | cut -d: -f1)/bin}"
        version=$(go version -m "$gobin/minio" 2>/dev/null \
                  | awk '$1=="mod" && $2=="github.com/minio/minio"{print $3}')
        version="${version:-latest}"
    fi
    out=$(mktemp -d)
    say "minio: go install -trimpath -ldflags '-s -w' github.com/minio/minio@$version"
    GOBIN="$out" GOFLAGS=-buildvcs=false go install -trimpath -ldflags "-s -w" \
        "github.com/minio/minio@$version"
    say "minio: compressing $(du -m "$out/minio" | cut -f1) MB with xz -9e (a minute or two)"
    xz -9 -e -T0 -c "$out/minio" > .kit/minio.xz.part
    mv .kit/minio.xz.part .kit/minio.xz
    rm -rf "$out"
fi

# 4. The commit before issue 31's round (624c62d), for bench_control_plane.py --baseline:
# its farm, worker, loader and bench (1.6 MB), as the host has no git history.
BASE_REF="${BASE_REF:-624c62d}"
if [ ! -d ".base/$BASE_REF/farm" ]; then
    mkdir -p ".base/$BASE_REF"
    git archive "$BASE_REF" farm worker loader bench | tar -x -C ".base/$BASE_REF"
    say "baseline: .base/$BASE_REF ($(du -sh ".base/$BASE_REF" | cut -f1))"
fi

tree_mb=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "%.1f", $1/1048576}')
total=$(du -cb .whl .kit .base | tail -1 | awk '{print $1}')
say "sizes: .whl $(du -sh .whl | cut -f1), .kit $(du -sh .kit | cut -f1) (redis $(du -h .kit/redis.tar.xz | cut -f1), minio $(du -h .kit/minio.xz | cut -f1)), tree ${tree_mb} MB"
say "carry: $(awk -v t="$total" -v r="$tree_mb" 'BEGIN{printf "%.1f", t/1048576 + r}') MiB of 64 with the tree"
if [ "$total" -gt $((60 * 1048576)) ]; then
    say "WARNING: .whl + .kit leave under 4 MiB for the tree"
    exit 1
fi
say "done in $ROOT: carry=[\".whl\", \".kit\", \".base\"], then bench/nvidia_host.sh <command>"
