"""What a person reads, in an 80-column terminal or a CI log: the real ``farm`` command,
piped, with ``COLUMNS=80``.

One real local build (a few fresh kernels compiled on PoCL) feeds the checks: its
progress lines on stderr carry count, rate and ETA although nothing is a terminal; its
summary, ``records sessions``, ``records summary`` and ``records show`` fit 80 columns
with no header or value cut (no ``…``), ids and fingerprints whole, kernels named by
family and parameters. ``farm devices``, ``farm families list``, every command's help
and ``farm --version`` are checked the same way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

FARM = Path(sys.executable).with_name("farm")
WIDTH = 80
PROGRESS = re.compile(r"^building: (\d+)/(\d+) kernels \(\d+%\), ([\d.]+)/s, "
                      r"ETA (\d+:\d\d), elapsed \d+:\d\d")


def run_farm(home: Path, *args: str, columns: int = WIDTH,
             **env: str) -> subprocess.CompletedProcess[str]:
    """``farm ARGS`` with stdout and stderr piped (not a terminal), as in a CI log."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    full.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
                CUDA_CACHE_DISABLE="1", COLUMNS=str(columns), **env)
    proc = subprocess.run([str(FARM), *args], env=full, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def assert_fits(text: str, width: int = WIDTH) -> None:
    """Nothing cut (rich's ellipsis) and no line wider than the terminal."""
    assert "…" not in text, text
    for line in text.splitlines():
        assert len(line.rstrip()) <= width, f"{len(line.rstrip())} > {width}: {line!r}"


@dataclass
class Built:
    home: Path
    build: subprocess.CompletedProcess[str]
    fingerprint: str


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """Six fresh kernels built on two local processes (about 5 s on PoCL)."""
    home = tmp_path_factory.mktemp("home")
    manifest = home / "six.toml"
    lines = ["format = 1", 'name = "six"', ""]
    for cols in range(4101, 4107):
        lines += ["[[kernels]]", 'family = "reduce"',
                  f'params = {{ op = "sum", cols = {cols} }}', ""]
    manifest.write_text("\n".join(lines))
    build = run_farm(home, "build", str(manifest), "--workers", "2")
    devices = json.loads(run_farm(home, "devices", "--json").stdout)
    (used,) = [d for d in devices if d["default"]]
    yield Built(home=home, build=build, fingerprint=used["fingerprint"])


def test_a_piped_build_prints_progress_lines_with_count_rate_and_eta(built: Built) -> None:
    lines = [m for m in map(PROGRESS.match, built.build.stderr.splitlines()) if m]
    assert lines, built.build.stderr
    done, total, rate, _eta = lines[0].groups()
    assert 1 <= int(done) <= int(total) == 6 and float(rate) > 0
    assert "last: Compiled reduce(cols=41" in built.build.stderr
    final = built.build.stderr.splitlines()
    assert any(re.match(r"^building: 6/6 kernels in \d+:\d\d \([\d.]+/s\)$", line)
               for line in final), built.build.stderr


def test_the_build_summary_fits_80_columns_whole(built: Built) -> None:
    out = built.build.stdout
    assert_fits(out)
    assert f"farm build six on {built.fingerprint}" in out.splitlines()
    for header in ("kernels", "loaded", "rekeyed", "compiled", "unsupported", "failed",
                   "work", "wall", "work/wall"):
        assert re.search(rf"(^|\s){re.escape(header)}\s", out), header
    assert re.search(r"compiled\s+6\b", out), out
    recorded = re.search(r"recorded as session (\d+): farm records show \1",
                         built.build.stderr)
    assert recorded, built.build.stderr


def test_a_build_that_only_loads_says_it_was_not_recorded(built: Built) -> None:
    again = run_farm(built.home, "build", str(built.home / "six.toml"), "--workers", "0")
    assert "not recorded: this build changed nothing" in again.stderr
    assert re.search(r"loaded\s+6\b", again.stdout), again.stdout
    sessions = json.loads(run_farm(built.home, "records", "sessions", "--json").stdout)
    assert len(sessions) == 1  # the first build only


def test_records_sessions_fits_80_columns_with_the_id_whole(built: Built) -> None:
    session = re.search(r"recorded as session (\d+)", built.build.stderr)
    assert session is not None
    out = run_farm(built.home, "records", "sessions").stdout
    assert_fits(out)
    row = next(line for line in out.splitlines() if line.startswith(session.group(1)))
    assert "build six" in row and re.search(r"\b6\s+0\s+0\s*$", row), row
    assert "(host, pid, batches, records: --wide, or --json)" in out
    wide = run_farm(built.home, "records", "sessions", "--wide").stdout
    assert "…" not in wide and all(h in wide for h in ("host", "pid", "batches", "records"))


def test_records_summary_fits_80_columns_and_names_kernels(built: Built) -> None:
    out = run_farm(built.home, "records", "summary", "--build", "latest").stdout
    assert_fits(out)
    for header in ("kernels", "loaded", "rekeyed", "compiled", "unsupported", "failed",
                   "store hits", "reused", "work", "wall", "work/wall"):
        assert header in out, header
    assert "reduce(cols=410" in out  # the slowest kernels by family and parameters
    assert not re.search(r"[0-9a-f]{32}\.[0-9a-f]{8}", out)  # keys only on demand
    wide = run_farm(built.home, "records", "summary", "--wide").stdout
    assert "…" not in wide and re.search(r"[0-9a-f]{32}\.[0-9a-f]{24}", wide)


def test_records_show_latest_names_kernels_by_parameters(built: Built) -> None:
    out = run_farm(built.home, "records", "show", "latest").stdout
    assert_fits(out)
    words = " ".join(out.split())
    assert len(re.findall(r"Compiled reduce\(cols=410\d, dtype=float, group_size=\d+, "
                          r"op=sum\) on \S+:\d+", words)) == 6, out
    wide = run_farm(built.home, "records", "show", "latest", "--wide").stdout
    assert re.search(r"[0-9a-f]{32}\.[0-9a-f]{24}", wide)


def test_devices_shows_the_fingerprint_whole_at_80_columns(built: Built) -> None:
    out = run_farm(built.home, "devices").stdout
    assert_fits(out)
    assert re.search(rf"^\d+  {re.escape(built.fingerprint)}$", out, re.M), out
    for label in ("device", "platform", "driver", "OpenCL C", "limits"):
        assert re.search(rf"^   {re.escape(label)}\s", out, re.M), label


def test_families_list_has_a_header_and_explains_the_build_id(built: Built) -> None:
    out = run_farm(built.home, "families", "list").stdout
    assert_fits(out)
    assert re.match(r"family\s+build id\s+from", out.splitlines()[0]), out
    assert "build id: a hash of the family's code" in out.replace("\n", " ")
    ids = re.findall(r"^[a-z_]+\s+([0-9a-f]{24})\s", out, re.M)
    assert len(ids) == len(set(ids)) >= 10  # one build id per family, not one for all
    assert "the other families keep theirs" in " ".join(out.split())


def test_every_command_has_help_with_an_example_at_80_columns() -> None:
    """Plain help: an example in every command and group, no ``<bool>`` on flags, no
    line over 80 columns, no option name and no command summary cut."""
    from typer.main import get_command

    from farm.cli.main import app

    root = get_command(app)
    seen = []

    def walk(command: object, path: list[str], parent: object = None) -> None:
        ctx = type(root.make_context("farm", [], resilient_parsing=True))(
            command, info_name=path[-1], parent=parent, terminal_width=WIDTH,
            max_content_width=WIDTH)
        text = command.get_help(ctx)  # type: ignore[attr-defined]
        seen.append(" ".join(path))
        example = re.search(r"Examples:\n\s+(farm\b.*)", text)
        assert example and example.group(1).startswith(" ".join(path)), text
        assert "<bool>" not in text, text
        assert_fits(text)
        if "Commands:" in text:  # each command's summary whole, not cut with "..."
            listing = text.split("Commands:")[1].split("Examples:")[0]
            assert not re.search(r"\.\.\.$", listing, re.M), listing
        for name in getattr(command, "commands", {}):
            walk(command.commands[name], [*path, name], ctx)  # type: ignore[attr-defined]

    walk(root, ["farm"])
    assert {"farm build", "farm records timeline", "farm families check"} <= set(seen)
    assert len(seen) >= 27


def test_farm_version_prints_the_version(tmp_path: Path) -> None:
    from farm.version import __version__

    assert run_farm(tmp_path, "--version").stdout.strip() == f"kernel-farm {__version__}"


def test_farm_workers_without_a_cluster_says_how_to_start_one(tmp_path: Path) -> None:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    full.update(FARM_HOME=str(tmp_path))
    proc = subprocess.run([str(FARM), "workers"], env=full, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: setting FARM_REDIS_URL") and \
        "`farm cluster up`" in proc.stderr


def test_piped_progress_lines_fit_80_columns(built: Built) -> None:
    """The count keeps its line; the last kernel goes on its own when both do not fit."""
    assert_width(built.build.stderr)
    assert re.search(r"^  last: Compiled reduce\(cols=410\d", built.build.stderr, re.M), \
        built.build.stderr


def assert_width(text: str, width: int = WIDTH) -> None:
    for line in text.splitlines():
        assert len(line) <= width, f"{len(line)} > {width}: {line!r}"


def run_on_terminal(home: Path, *args: str) -> str:
    """``farm ARGS`` with stderr on a pseudo-terminal 80 columns wide: what a person in a
    terminal reads of an error (stdout piped)."""
    import pty

    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), COLUMNS=str(WIDTH))
    proc = subprocess.run([str(FARM), *args], env=env, stdout=subprocess.PIPE,
                          stderr=follower, timeout=120, check=False)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal is closed: everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.returncode == 2
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_an_error_on_a_terminal_wraps_at_words_and_suggests_the_close_match(
        tmp_path: Path) -> None:
    long_name = "tinny-" + "x" * 30 + " and a few more words to go past the edge"
    shown = run_on_terminal(tmp_path, "build", long_name)
    lines = shown.rstrip("\n").split("\n")
    assert len(lines) >= 2 and lines[0].startswith("error: ")
    assert all(line.startswith("  ") for line in lines[1:])  # the rest indented
    assert_width(shown)
    words = " ".join(shown.split())
    piped = subprocess.run([str(FARM), "build", long_name], capture_output=True, text=True,
                           env={**os.environ, "FARM_HOME": str(tmp_path)}, timeout=120,
                           check=False).stderr
    assert piped.count("\n") == 1  # piped (a log): one line, for grep
    assert words == " ".join(piped.split())  # the same words: no word was cut in two
    tinny = run_on_terminal(tmp_path, "build", "tinny")
    assert "did you mean tiny?" in " ".join(tinny.split())


def test_a_mistyped_family_is_one_line_with_the_close_match(tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text('format = 1\nname = "m"\n\n[[kernels]]\nfamily = "matmull"\n'
                        "params = { m = 8, n = 8, k = 8 }\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    for args in (("build", str(manifest)), ("families", "check", "matmull")):
        proc = subprocess.run([str(FARM), *args], env={**env, "FARM_HOME": str(tmp_path)},
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "did you mean 'matmul'?" in proc.stderr


def test_a_cluster_of_no_workers_is_refused_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    for option in ("--workers", "--concurrency"):
        proc = subprocess.run([str(FARM), "cluster", "up", option, "0"],
                              env={**env, "FARM_HOME": str(tmp_path)}, capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("error: ") and option in proc.stderr
        assert proc.stdout == ""  # nothing was started


def test_farm_help_lists_the_commands_under_headings_in_the_order_they_are_met() -> None:
    text = run_farm(Path("/nonexistent-farm-home"), "--help").stdout
    assert_fits(text)
    headings = re.findall(r"^(\S[^:\n]*):$", text, re.M)
    assert headings[:6] == ["Options", "Start here", "Build and share kernels", "Look back",
                            "Run a cluster", "Keep the store"], headings
    commands = re.findall(r"^  ([a-z]+)\s{2,}\S", text.split("Start here:")[1]
                          .split("Examples:")[0], re.M)
    assert commands[:5] == ["demo", "devices", "families", "manifest", "build"]
    assert len(commands) == len(set(commands)) >= 16
    listing = text.split("Start here:")[1].split("Examples:")[0]
    assert not re.search(r"\.\.\.$", listing, re.M)  # each summary whole
