"""What ``farm records`` and its timeline show a person (issue 32), on a storage filled
here: a cluster build whose client found most kernels in the store itself and whose
workers have long names, and a build that is mostly one family.

* ``records summary --build latest`` fits 80 columns: the client's kernels are the lane
  ``client`` (not ``session <19 digits>``), and a long worker name wraps in its column;
* ``records show`` takes ``--family``, ``--outcome`` and ``--limit`` and says how many
  records it left out;
* ``records sessions --wide`` at 80 columns: one block per session, every value whole;
* the timeline does not count the client as a worker, shows a millisecond load as a mark,
  colours by outcome when one family dominates, and its family colours are far apart.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_records_cli import _recorder
from typer.testing import CliRunner

from farm.cli.records import SHOW_LIMIT, app
from farm.core.outcomes import Outcome
from farm.records import RequestedBy, SessionStorage
from farm.records.model import BatchCounts, Trip
from farm.records.timeline import MIN_BAR, PALETTE

WIDTH = 80
LONG_WORKER = "compile-pool-pocl-0.farm-workers.ml-platform.svc.cluster.local:123456"
NS = {"s": "http://www.w3.org/2000/svg"}


def fill(url: str, *, loads: int = 60, matmuls: int = 8) -> int:
    """A cluster build: the client loads ``loads`` stored matmuls itself (Loaded records
    of its own session, no worker), two workers compile ``matmuls`` matmuls and a reduce.
    Returns the client's session id."""
    with SessionStorage(url) as storage:
        client, clock = _recorder(storage, "build big", 0.0)
        asked = RequestedBy(session=client.session.id, batch=client.reserve_seq())
        for i in range(loads):
            clock.at(0.01 + i * 0.001)
            client.compilation(Trip(family="matmul", key=f"l{i}", outcome=Outcome.LOADED,
                                    work_s=0.001, kernel=f"matmul(m={i + 1},n=8,k=8)",
                                    requested_by=asked))
        for name, start in ((LONG_WORKER, 0.1), ("vm:2", 0.2)):
            worker, wclock = _recorder(storage, f"worker {name}", start,
                                       client.session.id - 1)
            for j in range(matmuls // 2):
                wclock.at(0.5 * (j + 1))
                worker.compilation(Trip(family="matmul", key=f"{name[-1]}{j}",
                                        outcome=Outcome.COMPILED, work_s=0.45,
                                        worker=name, host="vm", requested_by=asked,
                                        kernel=f"matmul(m=64,n={j + 1},k=64)"))
            wclock.at(0.5 * (matmuls // 2 + 1))
            worker.compilation(Trip(family="reduce", key=f"r{name[-1]}",
                                    outcome=Outcome.REKEYED, work_s=0.05, worker=name,
                                    host="vm", requested_by=asked, kernel="reduce(cols=9)"))
            worker.close()
        clock.at(3.0)
        client.batch(BatchCounts(kernels=loads + matmuls + 2, loaded=loads, rekeyed=2,
                                 compiled=matmuls, wall_s=3.0), label="build big",
                     seq=asked.batch)
        client.close()
        return client.session.id


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'records.sqlite'}"


def text(url: str, *args: str) -> str:
    """``farm records ARGS`` in process at 80 columns; its stdout, checked to fit."""
    result = CliRunner().invoke(app, list(args), env={"FARM_RECORDS_URL": url,
                                                      "COLUMNS": str(WIDTH)})
    assert result.exit_code == 0, (result.output, result.exception)
    for line in result.stdout.splitlines():
        assert len(line.rstrip()) <= WIDTH, f"{len(line.rstrip())}: {line!r}"
    assert "…" not in result.stdout
    return result.stdout


def test_summary_by_worker_fits_80_columns_and_names_the_client(url: str) -> None:
    client = fill(url)
    out = text(url, "summary", "--build", "latest")
    section = out[out.index("by worker"):out.index("slowest kernels")]
    assert re.search(r"^client\s+60\s+60\s+0\s+0\s", section, re.M), section
    assert f"session {client}" not in out
    # the long worker name wraps inside its column; every piece of it is there
    assert LONG_WORKER.split(".")[0] in section and "123456" in section
    assert "client: kernels the build's own process found in the store" in \
        " ".join(out.split())


def test_show_filters_limits_and_says_how_many_it_left(url: str) -> None:
    client = fill(url)
    default = text(url, "show", str(client))
    rows = re.findall(r"^\s*\d+\s+[\d.]+\s+[\d.]+\s+\w", default, re.M)
    assert len(rows) == SHOW_LIMIT
    assert f"({61 - SHOW_LIMIT} more record(s)" in " ".join(default.split())
    compiled = text(url, "show", str(client), "--outcome", "compiled", "--limit", "0")
    assert "Compiled" not in compiled  # the client's own session compiled nothing
    assert "no record of that family or outcome" in compiled
    loaded = text(url, "show", str(client), "--family", "matmul", "--outcome", "Loaded",
                  "-n", "5")
    assert len(re.findall(r"Loaded matmul\(", loaded)) == 5
    assert "(55 more record(s) of that family or outcome" in " ".join(loaded.split())
    everything = CliRunner().invoke(app, ["show", str(client), "--json"],
                                    env={"FARM_RECORDS_URL": url})
    assert len(json.loads(everything.stdout)["records"]) == 61  # --json: all, unless -n
    wrong = CliRunner().invoke(app, ["show", str(client), "--outcome", "compild"],
                               env={"FARM_RECORDS_URL": url})
    assert wrong.exit_code != 0 and "did you mean compiled?" in str(wrong.exception)


def test_sessions_wide_is_one_block_per_session_at_80_columns(url: str) -> None:
    client = fill(url)
    out = text(url, "sessions", "--wide")
    assert "…" not in out and "─" not in out  # blocks, not a table folded by the terminal
    block = out[out.index(str(client)):]
    for value in (str(client), "build big", "host vm", "batches 1", "compiled 0",
                  "loaded 60", "records 61"):
        assert value in " ".join(block.split()), value
    wide = CliRunner().invoke(app, ["sessions", "--wide"],
                              env={"FARM_RECORDS_URL": url, "COLUMNS": "200"})
    assert re.search(r"^id\s+started\s+label", wide.stdout, re.M)  # a table where it fits


def svg_of(url: str, tmp_path: Path, **fill_args: int) -> ET.Element:
    client = fill(url, **fill_args)
    target = tmp_path / "t.svg"
    told = CliRunner().invoke(app, ["timeline", str(client), "-o", str(target)],
                              env={"FARM_RECORDS_URL": url, "COLUMNS": str(WIDTH)})
    assert told.exit_code == 0, told.output
    said = " ".join(told.stdout.split())
    assert ("on 2 worker(s) and the client," if fill_args.get("loads", 1) else
            "on 2 worker(s),") in said, said
    return ET.fromstring(target.read_text())


def test_the_timeline_counts_workers_not_the_client_and_shows_loads(
        url: str, tmp_path: Path) -> None:
    svg = svg_of(url, tmp_path)
    assert (svg.get("data-lanes"), svg.get("data-workers")) == ("3", "2")
    heading = "".join(svg.itertext())
    assert "2 worker(s) and the client" in heading and "3 worker(s)" not in heading
    loads = [b for b in svg.findall(".//s:rect[@class='bar']", NS)
             if b.get("data-outcome") == "Loaded"]
    assert len(loads) == 60  # a millisecond each in a 3 s build: still a mark each
    assert min(float(b.get("width", "0")) for b in loads) >= MIN_BAR


def test_a_dominant_family_is_coloured_by_outcome_with_the_family_as_a_strip(
        url: str, tmp_path: Path) -> None:
    svg = svg_of(url, tmp_path)  # 68 of 70 kernels are matmuls
    assert svg.get("data-colour-by") == "outcome"
    bars = svg.findall(".//s:rect[@class='bar']", NS)
    by_outcome: dict[str, set[str]] = {}
    for bar in bars:
        by_outcome.setdefault(bar.get("data-outcome", ""), set()).add(bar.get("fill", ""))
    assert all(len(f) == 1 for f in by_outcome.values())
    assert len(set().union(*by_outcome.values())) == 3  # three outcomes, three colours
    strips = {s.get("fill") for s in svg.findall(".//s:rect[@class='strip']", NS)}
    assert len(strips) == 2  # matmul and reduce


def test_a_mixed_build_is_coloured_by_family(url: str, tmp_path: Path) -> None:
    svg = svg_of(url, tmp_path, loads=0, matmuls=2)  # 2 matmuls, 2 reduces
    assert svg.get("data-colour-by") == "family"
    fills = {b.get("data-family"): b.get("fill")
             for b in svg.findall(".//s:rect[@class='bar']", NS)}
    assert fills["matmul"] != fills["reduce"]


def _lab(color: str) -> tuple[float, float, float]:
    """sRGB hex -> CIE L*a*b* (D65)."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    x = (0.4124 * lin[0] + 0.3576 * lin[1] + 0.1805 * lin[2]) / 0.95047
    y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    z = (0.0193 * lin[0] + 0.1192 * lin[1] + 0.9505 * lin[2]) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_the_first_ten_family_colours_are_far_apart() -> None:
    """Ten families, ten colours a person tells apart (CIE76 distance of 20 or more)."""
    labs = [_lab(c) for c in PALETTE[:10]]
    closest = min(math.dist(a, b) for i, a in enumerate(labs) for b in labs[i + 1:])
    assert len(set(PALETTE)) == len(PALETTE) >= 10 and closest >= 20, closest
