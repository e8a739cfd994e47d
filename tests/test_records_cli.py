"""``farm records`` on a storage filled here with known sessions, on SQLite and PostgreSQL.

The filling stands for what a real farm leaves behind: an embedded build, a cluster
build whose client and two workers recorded it (one kernel recorded twice, as after a
re-delivered task, and one straggler), and an old session. Clocks are fakes, so every
number the commands print is known in advance.
"""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_records_stream import farm_argv, fresh_pg_database
from typer.testing import CliRunner

from farm.cli.records import app
from farm.core.outcomes import Outcome
from farm.records import (
    Recorder,
    RecordsConfig,
    RequestedBy,
    Session,
    SessionStorage,
    StorageSink,
)
from farm.records.model import BatchCounts, Trip
from farm.records.query import BuildRef, group_builds, timeline


class Clock:
    """Wall and monotonic clocks a test sets by hand (ns)."""

    def __init__(self, wall_ns: int) -> None:
        self.wall = wall_ns
        self.mono = 0

    def wall_ns(self) -> int:
        return self.wall

    def monotonic_ns(self) -> int:
        return self.mono

    def at(self, seconds: float) -> Clock:
        """Move the monotonic clock to ``seconds`` after the session's start."""
        self.mono = int(seconds * 1e9)
        return self


@dataclass
class Filled:
    url: str
    old: int
    embedded: int
    client: int
    worker1: int
    worker2: int


def _recorder(storage: SessionStorage, label: str, start_s: float,
              t0: int = 0) -> tuple[Recorder, Clock]:
    """A recorder whose session starts ``start_s`` after ``t0`` (ns; default: now)."""
    clock = Clock((t0 or Session.start("t0").id) + int(start_s * 1e9))
    return Recorder(StorageSink(storage), RecordsConfig(), label, clock=clock), clock


def fill(url: str) -> Filled:
    """Five sessions; the cluster build ``client:1`` has 6 kernels, 5 recorded by workers.

    Session ids are start times and unique in a process (an id is bumped past the last
    one handed out), so the start times here count from a fresh session's, never from a
    fixed date that sessions made earlier in the test run could have passed.
    """
    t0 = Session.start("t0").id + 1_000_000
    with SessionStorage(url) as storage:
        old, clock = _recorder(storage, "build old", 0.0, t0)
        old.compilation(Trip(family="softmax", key="k-old", outcome=Outcome.COMPILED, work_s=0.1))
        old.close()

        emb, clock = _recorder(storage, "build tiny", 10.0, t0)
        clock.at(0.1)
        emb.compilation(Trip(family="matmul", key="k1", outcome=Outcome.LOADED, work_s=0.01))
        clock.at(0.6)
        emb.compilation(Trip(family="reduce", key="k2", outcome=Outcome.COMPILED, work_s=0.5))
        emb.compilation(Trip(family="matmul", key="k3", outcome=Outcome.COMPILED, work_s=0.2))
        emb.batch(BatchCounts(kernels=4, loaded=1, compiled=2, failed=1, wall_s=0.6,
                              work_s=0.71), label="build tiny")
        emb.close()

        # The cluster build: the client reserves its batch seq, the workers name it.
        client, client_clock = _recorder(storage, "build small", 20.0, t0)
        batch = client.reserve_seq()
        asked = RequestedBy(session=client.session.id, batch=batch)

        w1, clock = _recorder(storage, "worker vm:1", 20.5, t0)  # started 0.5 s after the client
        for end, key, family, outcome, work in (
            (0.4, "k10", "matmul", Outcome.COMPILED, 0.3),
            (2.0, "k11", "reduce", Outcome.COMPILED, 1.6),  # the straggler
            (2.06, "k12", "matmul", Outcome.REKEYED, 0.05),
        ):
            clock.at(end)  # this worker names its kernels (w2's records are older ones)
            w1.compilation(Trip(family=family, key=key, outcome=outcome, work_s=work,
                                worker="vm:1", host="vm", requested_by=asked,
                                kernel=f"{family}(cols=1{key[1:]},dtype=float)"))
        w1.close()

        w2, clock = _recorder(storage, "worker vm:2", 20.6, t0)
        for end, key, family, outcome, work in (
            (0.5, "k13", "matmul", Outcome.COMPILED, 0.4),
            (0.86, "k14", "reduce", Outcome.COMPILED, 0.35),
            (0.9, "k10", "matmul", Outcome.LOADED, 0.01),  # re-delivered: counted once
        ):
            clock.at(end)
            w2.compilation(Trip(family=family, key=key, outcome=outcome, work_s=work,
                                worker="vm:2", host="vm", requested_by=asked))
        w2.close()

        client_clock.at(2.6)
        client.batch(BatchCounts(kernels=6, loaded=1, rekeyed=1, compiled=4, wall_s=2.5, work_s=2.7,
                                 parallelism=2), label="build small", seq=batch)
        client.close()
    return Filled(url=url, old=old.session.id, embedded=emb.session.id,
                  client=client.session.id, worker1=w1.session.id, worker2=w2.session.id)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def filled(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Filled]:
    if request.param == "sqlite":
        yield fill(f"sqlite:///{tmp_path / 'records.sqlite'}")
    else:
        with fresh_pg_database(request.getfixturevalue("postgres_server")) as url:
            yield fill(url)


@pytest.fixture
def sqlite_filled(tmp_path: Path) -> Filled:
    return fill(f"sqlite:///{tmp_path / 'records.sqlite'}")


def run(filled: Filled, *args: str) -> Any:
    """``farm records ARGS --json``, in process; the parsed JSON."""
    result = CliRunner().invoke(app, [*args, "--json"],
                                env={"FARM_RECORDS_URL": filled.url, "COLUMNS": "200"})
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def test_sessions_are_listed_newest_first_with_what_they_changed(filled: Filled) -> None:
    rows = run(filled, "sessions")
    assert [r["id"] for r in rows] == [filled.worker2, filled.worker1, filled.client,
                                       filled.embedded, filled.old]
    by_id = {r["id"]: r for r in rows}
    assert by_id[filled.worker1]["label"] == "worker vm:1" and by_id[filled.worker1]["host"]
    assert (by_id[filled.worker1]["compiled"], by_id[filled.worker1]["rekeyed"]) == (2, 1)
    assert (by_id[filled.worker2]["compiled"], by_id[filled.worker2]["loaded"]) == (2, 1)
    assert by_id[filled.client]["batches"] == 1 and by_id[filled.client]["records"] == 1
    assert all(r["missing"] == 0 for r in rows)
    assert [r["id"] for r in run(filled, "sessions", "--limit", "2")] == [
        filled.worker2, filled.worker1]


def test_show_lists_a_session_s_records_in_order(filled: Filled) -> None:
    shown = run(filled, "show", str(filled.worker1))
    assert shown["session"]["label"] == "worker vm:1"
    assert [r["stamp"]["seq"] for r in shown["records"]] == [1, 2, 3]
    assert [r["key"] for r in shown["records"]] == ["k10", "k11", "k12"]
    assert shown["records"][0]["requested_by"] == {"session": filled.client, "batch": 1}
    latest = run(filled, "show", "latest")
    assert latest["session"]["id"] == filled.worker2
    client = run(filled, "show", str(filled.client))
    assert [r["kind"] for r in client["records"]] == ["records/v1/compilation_batch"]
    assert client["records"][0]["stamp"]["seq"] == 1  # written under its reserved seq


def test_summary_of_a_cluster_build_counts_each_kernel_once_and_names_its_workers(
    filled: Filled,
) -> None:
    found = run(filled, "summary", "--build", str(filled.client))
    assert found["builds"] == [f"{filled.client}:1"]
    assert found["sessions"] == 3  # the client and both workers
    assert found["kernels"] == 6
    assert found["outcomes"] == {"kernels": 6, "loaded": 1, "rekeyed": 1, "compiled": 4,
                                 "unsupported": 0, "failed": 0}
    assert found["unattributed"] == 1  # the one the client found in the store itself
    assert found["workers"] == ["vm:1", "vm:2"]
    by_worker = {w["name"]: w for w in found["by_worker"]}
    assert (by_worker["vm:1"]["kernels"], by_worker["vm:1"]["compiled"]) == (3, 2)
    assert (by_worker["vm:2"]["kernels"], by_worker["vm:2"]["loaded"]) == (2, 0)
    by_family = {f["name"]: f for f in found["by_family"]}
    assert (by_family["matmul"]["kernels"], by_family["reduce"]["kernels"]) == (3, 2)
    assert found["work_s"] == pytest.approx(0.3 + 1.6 + 0.05 + 0.4 + 0.35)
    assert found["wall_s"] == pytest.approx(2.5)
    assert found["work_over_wall"] == pytest.approx(2.7 / 2.5, abs=1e-3)
    assert found["store_hit_rate"] == pytest.approx(1 / 6, abs=1e-3)
    assert found["compiler_avoided_rate"] == pytest.approx(2 / 6, abs=1e-3)
    assert found["slowest"][0]["key"] == "k11" and found["slowest"][0]["worker"] == "vm:1"
    # The same build named with its batch.
    assert run(filled, "summary", "--build", f"{filled.client}:1")["kernels"] == 6


def test_summary_of_everything(filled: Filled) -> None:
    found = run(filled, "summary", "--top", "3")
    assert found["builds"] == [f"{filled.old}", f"{filled.embedded}:4", f"{filled.client}:1"]
    assert found["kernels"] == 1 + 4 + 6
    assert found["outcomes"]["failed"] == 1 and found["outcomes"]["compiled"] == 1 + 2 + 4
    assert found["sessions"] == 5
    assert len(found["slowest"]) == 3
    assert found["wall_s"] == pytest.approx(0.1 + 0.6 + 2.5)


def test_timeline_writes_a_picture_with_one_lane_per_worker(
    sqlite_filled: Filled, tmp_path: Path
) -> None:
    for suffix in (".html", ".svg"):
        target = tmp_path / f"build{suffix}"
        told = run(sqlite_filled, "timeline", str(sqlite_filled.client), "-o", str(target))
        assert told["lanes"] == ["vm:1", "vm:2"] and told["bars"] == 6
        assert told["stragglers"] == 1
        text = target.read_text()
        svg_text = text[text.index("<svg"):text.index("</svg>") + len("</svg>")]
        svg = ET.fromstring(svg_text)  # well-formed XML
        ns = {"s": "http://www.w3.org/2000/svg"}
        lanes = svg.findall(".//s:g[@class='lane']", ns)
        assert [g.get("data-worker") for g in lanes] == ["vm:1", "vm:2"]
        bars = svg.findall(".//s:rect[@class='bar']", ns)
        assert len(bars) == 6
        stragglers = [b for b in bars if b.get("stroke") == "#e45756"]
        assert len(stragglers) == 1 and "k11" in (stragglers[0].findtext("s:title", "", ns))
        if suffix == ".html":
            assert text.startswith("<!DOCTYPE html>") and "<script" not in text
    told = run(sqlite_filled, "timeline", f"{sqlite_filled.client}:1", "-o",
               str(tmp_path / "again.html"))
    # The client's batch ran from 0.1 s to 2.6 s of its session; the last bar ends before.
    assert told["wall_s"] == pytest.approx(2.5, abs=1e-5)
    # Workers started 0.5 and 0.6 s after the client: their bars sit on one time line.
    with SessionStorage(sqlite_filled.url) as storage:
        data = timeline(storage, BuildRef(session=sqlite_filled.client))
    bars = {(b.lane, b.key): b for b in data.bars}
    assert bars["vm:1", "k10"].start_s == pytest.approx(0.5, abs=1e-5)  # 20.5 + 0.4 - 0.3 - 20.1
    assert bars["vm:2", "k13"].start_s == pytest.approx(0.6, abs=1e-5)  # 20.6 + 0.5 - 0.4 - 20.1
    assert bars["vm:1", "k11"].straggler and not bars["vm:2", "k13"].straggler


def test_latest_names_the_newest_build_not_a_worker_started_after_it(
    sqlite_filled: Filled, tmp_path: Path
) -> None:
    """The workers' sessions are newer than the client's, but hold no build."""
    assert run(sqlite_filled, "summary", "--build", "latest")["builds"] == [
        f"{sqlite_filled.client}:1"]
    assert run(sqlite_filled, "summary", "--build", "latest:1")["kernels"] == 6
    told = run(sqlite_filled, "timeline", "latest", "-o", str(tmp_path / "t.svg"))
    assert told["build"] == str(sqlite_filled.client) and told["bars"] == 6


def test_records_name_kernels_by_family_and_parameters_keys_on_demand(
    sqlite_filled: Filled,
) -> None:
    def text(*args: str) -> str:
        result = CliRunner().invoke(app, list(args), env={
            "FARM_RECORDS_URL": sqlite_filled.url, "COLUMNS": "80"})
        assert result.exit_code == 0, (result.output, result.exception)
        assert "…" not in result.stdout
        return " ".join(result.stdout.split())

    shown = text("show", str(sqlite_filled.worker1))
    assert "Compiled reduce(cols=111, dtype=float) on vm:1" in shown
    assert "k11" not in shown
    assert "reduce(cols=111, dtype=float) k11" in text("show", str(sqlite_filled.worker1),
                                                        "--wide")
    older = text("show", str(sqlite_filled.worker2))  # records without a name: the key
    assert "Compiled matmul k13 on vm:2" in older
    summary = text("summary", "--build", "latest")
    assert "1.600 s Compiled reduce(cols=111," in summary  # wrapped between parameters
    assert run(sqlite_filled, "summary")["slowest"][0]["kernel"] == "reduce(cols=111,dtype=float)"


def test_the_timeline_fits_its_window_and_colours_bars_by_family(
    sqlite_filled: Filled, tmp_path: Path
) -> None:
    target = tmp_path / "build.html"
    run(sqlite_filled, "timeline", str(sqlite_filled.client), "-o", str(target))
    page = target.read_text()
    svg = ET.fromstring(page[page.index("<svg"):page.index("</svg>") + len("</svg>")])
    assert svg.get("width") == "100%" and svg.get("viewBox", "").startswith("0 0 1000 ")
    ns = {"s": "http://www.w3.org/2000/svg"}
    bars = svg.findall(".//s:rect[@class='bar']", ns)
    fills: dict[str, set[str]] = {}
    for bar in bars:
        fills.setdefault(bar.get("data-family", ""), set()).add(bar.get("fill", ""))
    assert set(fills) == {"matmul", "reduce"}
    assert all(len(f) == 1 for f in fills.values())  # one colour a family ...
    assert fills["matmul"] != fills["reduce"]  # ... and its own
    outcomes = {bar.get("data-outcome"): bar for bar in bars}
    assert outcomes["Loaded"].get("fill-opacity") == "0.35"  # pale
    tips = [bar.findtext("s:title", "", ns) for bar in bars]
    assert any(t.startswith("reduce(cols=111,dtype=float)\n") and t.endswith("key k11")
               for t in tips), tips
    assert any(t.startswith("matmul k13\n") for t in tips)  # an older record: its key
    # the stragglers table: the kernel by name, its key on hover
    assert '<td class="kernel" title="key k11">reduce(cols=111, dtype=float)</td>' in page


def test_prune_keeps_the_newest(filled: Filled) -> None:
    assert run(filled, "prune", "--keep", "2") == {"deleted": 3, "kept": 2}
    assert [r["id"] for r in run(filled, "sessions")] == [filled.worker2, filled.worker1]
    with SessionStorage(filled.url) as storage:
        assert storage.count_records() == 3 + 3


def test_builds_join_when_the_client_wrote_its_batch_record_without_the_reserved_seq(
    tmp_path: Path,
) -> None:
    with SessionStorage(f"sqlite:///{tmp_path / 'r.sqlite'}") as storage:
        client, _ = _recorder(storage, "build", 0.0)
        asked = RequestedBy(session=client.session.id, batch=client.reserve_seq())
        worker, _ = _recorder(storage, "worker", 0.1)
        worker.compilation(Trip(family="matmul", key="k", outcome=Outcome.COMPILED, work_s=0.1,
                                worker="w", requested_by=asked))
        worker.close()
        # seq 2, the next after the reservation
        client.batch(BatchCounts(kernels=1, compiled=1, wall_s=0.2))
        client.close()
        (build,) = group_builds(storage.all_records())
    assert build.ref == BuildRef(session=client.session.id, batch=1)
    assert build.batch is not None and build.batch.stamp.seq == 2 and len(build.runs) == 1


def test_errors_are_one_line_and_an_exit_status(sqlite_filled: Filled, tmp_path: Path) -> None:
    env = {"FARM_RECORDS_URL": sqlite_filled.url, "PATH": "/usr/bin:/bin"}
    for args, needle in ((("show", "42"), "no session 42"),
                         (("summary", "--build", "nope"), "SESSION:BATCH"),
                         (("summary", "--build", "42:1"), "no records of build 42:1"),
                         (("timeline", str(sqlite_filled.client), "-o",
                           str(tmp_path / "x.png")), ".html or .svg")):
        proc = subprocess.run(farm_argv("records", *args), env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.strip().count("\n") == 0 and needle in proc.stderr, proc.stderr


def test_summary_counts_a_stored_kernel_whose_record_never_came(tmp_path: Path) -> None:
    """``missing``: the client counted two kernels as compiled, one record arrived."""
    from farm.records.query import summarize

    with SessionStorage(f"sqlite:///{tmp_path / 'r.sqlite'}") as storage:
        client, _ = _recorder(storage, "build", 0.0)
        asked = RequestedBy(session=client.session.id, batch=client.reserve_seq())
        worker, _ = _recorder(storage, "worker", 0.1)
        worker.compilation(Trip(family="matmul", key="k1", outcome=Outcome.COMPILED, work_s=0.1,
                                worker="w", requested_by=asked))
        worker.close()  # the record of k2 never came (its process was killed)
        client.batch(BatchCounts(kernels=3, compiled=2, loaded=1, wall_s=0.2), seq=asked.batch)
        client.close()
        found = summarize(group_builds(storage.all_records()))
    assert found.missing == 1
    assert found.outcomes.compiled == 2
