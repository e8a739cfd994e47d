"""Draw docs/dashboard.svg: every panel of the Grafana dashboard, from real metrics.

Starts a local cluster (Redis, MinIO, two workers and an ingester with their metrics
ports), runs two builds of fresh kernels (the second starting with the first's last
kernels, so that kernels in flight in both are compiled once, waited for (a lease) and
loaded by the other worker; each writes its
summary with ``--metrics-file``, as node-exporter's textfile collector would read it),
scrapes everything every half second, and draws each of the dashboard's panels as
Grafana would: its title, its unit (a second axis where a series overrides it), its
queries computed over the scrapes (``max by``, ``sum by``, ``rate``,
``histogram_quantile``, a ratio), and a table legend with each series' last and max.

Titles, units, layout and legends are read from the dashboard itself
(helm/kernel-farm/dashboards/kernel-farm.json), so the picture cannot drift from it; only
each query's evaluation is written here (``QUERIES``, by panel id), and a dashboard
panel without one fails the drawing.

Usage: ``.venv/bin/python scripts/dashboard_picture.py [OUT.svg]`` (about a minute).
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from farm.devservices.cluster import local_cluster
from farm.devservices.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "kernel-farm" / "dashboards" / "kernel-farm.json"
Labels = tuple[tuple[str, str], ...]
Sample = dict[tuple[str, Labels], float]
Series = list[tuple[float, Sample]]
Points = list[tuple[float, float]]
#: gauges that every process exports from Redis: the same value, merged with max
SHARED_GAUGES = ("farm_queue_depth", "farm_in_flight_chunks", "farm_workers",
                 "farm_worker_processes", "farm_broker_up", "farm_ingest_lag_entries",
                 "farm_ingest_pending_entries")


def parse(text: str) -> Sample:
    out: Sample = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(port: int) -> Sample:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return parse(reply.read().decode())


def total(sample: Sample, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in sample.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def manifest(path: Path, cols: list[int]) -> Path:
    """Cheap kernels, one per column count (the same count: the same kernel)."""
    lines = ["format = 1", f'name = "picture-{path.stem}"', ""]
    for c in cols:
        lines += ["[[kernels]]", 'family = "reduce"', f'params = {{ op = "sum", cols = {c} }}',
                  ""]
    path.write_text("\n".join(lines))
    return path


def record(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="farm-picture-") as tmp, \
            local_cluster(Path(tmp)) as cluster:
        ports = [free_port(), free_port(), free_port()]
        for port in ports[:2]:
            cluster.start_worker(concurrency=1, args=("--metrics-port", str(port)))
        cluster.extra_env["FARM_METRICS_PORT"] = str(ports[2])  # the ingester's only
        cluster.start_ingester(f"sqlite:///{Path(tmp) / 'records.sqlite'}")
        del cluster.extra_env["FARM_METRICS_PORT"]
        cluster.wait_ready()
        textfiles = [Path(tmp) / "a.prom", Path(tmp) / "b.prom"]
        series: Series = []
        stop = threading.Event()

        def sampler() -> None:
            start = time.monotonic()
            while not stop.is_set():
                merged: Sample = defaultdict(float)
                shared: Sample = {}
                scraped = []
                for port in ports:
                    try:
                        scraped.append(scrape(port))
                    except OSError:  # the ingester's listener may start a moment later
                        continue
                scraped += [parse(f.read_text()) for f in textfiles if f.exists()]
                for sample in scraped:
                    for key, value in sample.items():
                        if key[0] in SHARED_GAUGES or key[0].startswith("farm_build_"):
                            shared[key] = max(shared.get(key, 0.0), value)  # max, not sum
                        else:
                            merged[key] += value
                merged.update(shared)
                series.append((time.monotonic() - start, dict(merged)))
                stop.wait(0.5)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        time.sleep(2)
        env = cluster.env(Path(tmp) / "client")

        def build(name: str, cols: list[int], textfile: Path) -> list[str]:
            return [sys.executable, "-m", "farm", "build",
                    str(manifest(Path(tmp) / f"{name}.toml", cols)), "--cluster", "--json",
                    "--metrics-file", str(textfile)]

        first = subprocess.Popen(build("a", list(range(1001, 1033)), textfiles[0]), env=env,
                                 stdout=subprocess.DEVNULL)
        time.sleep(1)
        # Starts with the first's last chunk (FARM_CHUNK_SIZE 4): the queue hands the two
        # to the two workers at once, and the one that comes second waits for each kernel
        # the other compiles (a lease) and loads it, never compiling it twice.
        overlap = list(range(1029, 1033)) + list(range(2001, 2025))
        second = subprocess.run(build("b", overlap, textfiles[1]), env=env,
                                stdout=subprocess.DEVNULL, check=True)
        first.wait(timeout=600)
        assert second.returncode == 0 and first.returncode == 0
        time.sleep(4)  # the ingester's last records, the counters' last rate windows
        stop.set()
        thread.join()
    out.write_text(draw(series))
    print(f"dashboard picture: {out} ({len(series)} scrapes)")


# -- the queries ---------------------------------------------------------------------------

Grouped = dict[str, Points]
"""Legend label values (joined) -> points."""


def _window_start(series: Series, i: int, window: float) -> int:
    t = series[i][0]
    j = i
    while j > 0 and t - series[j - 1][0] <= window:
        j -= 1
    return j


def _groups(sample: Sample, name: str, by: tuple[str, ...], match: Callable[[dict[str, str]],
            bool]) -> dict[tuple[str, ...], list[tuple[Labels, float]]]:
    found: dict[tuple[str, ...], list[tuple[Labels, float]]] = defaultdict(list)
    for (n, ls), v in sample.items():
        labels = dict(ls)
        if n == name and match(labels):
            found[tuple(labels.get(b, "") for b in by)].append((ls, v))
    return found


def _any(_: dict[str, str]) -> bool:
    return True


def gauge_max(series: Series, name: str, by: tuple[str, ...] = ()) -> dict[tuple[str, ...],
                                                                          Points]:
    """``max by (by) (name)``."""
    out: dict[tuple[str, ...], Points] = defaultdict(list)
    for t, sample in series:
        for key, values in _groups(sample, name, by, _any).items():
            out[key].append((t, max(v for _, v in values)))
    return dict(out)


def rate_sum(series: Series, name: str, by: tuple[str, ...] = (),
             match: Callable[[dict[str, str]], bool] = _any,
             window: float = 4.0) -> dict[tuple[str, ...], Points]:
    """``sum by (by) (rate(name{match}[window]))``."""
    out: dict[tuple[str, ...], Points] = defaultdict(list)
    for i, (t, sample) in enumerate(series):
        j = _window_start(series, i, window)
        t0, base = series[j]
        for key, values in _groups(sample, name, by, match).items():
            if j == i:
                out[key].append((t, 0.0))
                continue
            grew = sum(v - base.get((name, ls), 0.0) for ls, v in values)
            out[key].append((t, max(0.0, grew) / (t - t0)))
    return dict(out)


def rates(series: Series, name: str, window: float = 4.0, **labels: str) -> Points:
    """``sum(rate(name{labels}[window]))``."""
    found = rate_sum(series, name, (), lambda ls: all(ls.get(k) == v
                                                      for k, v in labels.items()), window)
    return found.get((), [(t, 0.0) for t, _ in series])


def quantile_by(series: Series, name: str, q: float, by: tuple[str, ...] = (),
                window: float = 6.0) -> dict[tuple[str, ...], Points]:
    """``histogram_quantile(q, sum by (le, by) (rate(name_bucket[window])))`` as
    Prometheus computes it (linear within the bucket that holds the rank)."""
    out: dict[tuple[str, ...], Points] = defaultdict(list)
    for i, (t, sample) in enumerate(series):
        base = series[_window_start(series, i, window)][1]
        for key, values in _groups(sample, f"{name}_bucket", by, _any).items():
            buckets: dict[float, float] = defaultdict(float)
            for ls, v in values:
                le = dict(ls)["le"]
                bound = float("inf") if le == "+Inf" else float(le)
                buckets[bound] += v - base.get((f"{name}_bucket", ls), 0.0)
            value = _bucket_quantile(q, sorted(buckets.items()))
            if value is not None:
                out[key].append((t, value))
    return dict(out)


def _bucket_quantile(q: float, ordered: list[tuple[float, float]]) -> float | None:
    count = ordered[-1][1] if ordered else 0.0
    if count <= 0:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for bound, cumulative in ordered:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = bound, cumulative
    return None


def quantile(series: Series, name: str, q: float, window: float = 6.0) -> Points:
    """``histogram_quantile(q, sum(rate(name_bucket[window])))``."""
    return quantile_by(series, name, q, (), window).get((), [])


def hit_ratio(series: Series) -> dict[tuple[str, ...], Points]:
    """Panel 7: hits over hits and misses, by tier (no point while neither happens)."""
    hits = rate_sum(series, "farm_store_requests_total", ("tier",),
                    lambda ls: ls.get("result") == "hit")
    asked = rate_sum(series, "farm_store_requests_total", ("tier",),
                     lambda ls: ls.get("result") in ("hit", "miss"))
    return {tier: [(t, dict(hits.get(tier, [])).get(t, 0.0) / v) for t, v in points if v > 0]
            for tier, points in asked.items()}


def _is(label: str, *values: str) -> Callable[[dict[str, str]], bool]:
    return lambda ls: ls.get(label) in values


#: panel id -> its targets, in the dashboard's order: each a function of the scrapes
#: giving (legend label values -> points), the labels being the ones its legend names
QUERIES: dict[int, list[tuple[tuple[str, ...], Callable[[Series], dict[tuple[str, ...],
                                                                       Points]]]]] = {
    1: [(("fingerprint",), lambda s: gauge_max(s, "farm_queue_depth", ("fingerprint",)))],
    2: [(("fingerprint",), lambda s: gauge_max(s, "farm_in_flight_chunks", ("fingerprint",)))],
    3: [(("outcome",), lambda s: rate_sum(s, "farm_kernels_total", ("outcome",)))],
    4: [(("fingerprint",), lambda s: gauge_max(s, "farm_workers", ("fingerprint",))),
        (("fingerprint",), lambda s: gauge_max(s, "farm_worker_processes", ("fingerprint",)))],
    5: [(("fingerprint",), lambda s: quantile_by(s, "farm_compile_seconds", 0.5,
                                                  ("fingerprint",))),
        (("fingerprint",), lambda s: quantile_by(s, "farm_compile_seconds", 0.95,
                                                  ("fingerprint",)))],
    6: [(("fingerprint",), lambda s: quantile_by(s, "farm_load_seconds", 0.5,
                                                  ("fingerprint",))),
        (("fingerprint",), lambda s: quantile_by(s, "farm_load_seconds", 0.95,
                                                  ("fingerprint",)))],
    7: [(("tier",), hit_ratio)],
    8: [(("tier", "direction"), lambda s: rate_sum(s, "farm_store_bytes_total",
                                                   ("tier", "direction")))],
    9: [(("fingerprint",), lambda s: quantile_by(s, "farm_lease_wait_seconds", 0.95,
                                                  ("fingerprint",))),
        (("tier",), lambda s: rate_sum(s, "farm_store_requests_total", ("tier",),
                                       _is("result", "refused")))],
    10: [(("status", "fingerprint"), lambda s: rate_sum(
        s, "farm_tasks_total", ("status", "fingerprint"),
        lambda ls: ls.get("status") != "success"))],
    11: [(("stream",), lambda s: gauge_max(s, "farm_ingest_lag_entries", ("stream",))),
         (("stream",), lambda s: gauge_max(s, "farm_ingest_pending_entries", ("stream",)))],
    12: [((), lambda s: rate_sum(s, "farm_ingest_records_total")),
         ((), lambda s: rate_sum(s, "farm_ingest_dead_total")),
         ((), lambda s: rate_sum(s, "farm_ingest_lost_total"))],
    13: [(("manifest", "outcome"), lambda s: gauge_max(s, "farm_build_kernels",
                                                       ("manifest", "outcome")))],
    14: [(("manifest",), lambda s: gauge_max(s, "farm_build_wall_seconds", ("manifest",))),
         (("manifest",), lambda s: gauge_max(s, "farm_build_work_seconds", ("manifest",)))],
}


# -- drawing -------------------------------------------------------------------------------

COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#b877d9", "#f2495c", "#8ab8ff",
          "#96d98d", "#ffb357", "#ca95e5"]
COL_W, PLOT_H, LEGEND_ROW = 600, 110, 13


def fmt(value: float, unit: str) -> str:
    """A value as Grafana writes it in ``unit``."""
    if unit == "percentunit":
        return f"{value:.0%}"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if 0 < value < 1 else f"{value:.3g} s"
    if unit in ("ops", "Bps"):
        scaled, prefix = value, ""
        for step in ("k", "M", "G"):
            if abs(scaled) < 1000:
                break
            scaled, prefix = scaled / 1000, step
        return f"{scaled:.3g} {prefix}{'ops/s' if unit == 'ops' else 'B/s'}"
    return f"{value:.3g}"


def legend_name(fmt_text: str, names: tuple[str, ...], values: tuple[str, ...]) -> str:
    text = fmt_text
    for name, value in zip(names, values, strict=True):
        text = text.replace("{{" + name + "}}", value)
    return " ".join(text.split()) or "value"


def panel_lines(panel: dict[str, Any], series: Series) -> list[tuple[str, Points, str]]:
    """(legend, points, unit) of each series the panel's targets give, in order."""
    queries = QUERIES.get(panel["id"])
    if queries is None or len(queries) != len(panel["targets"]):
        raise SystemExit(f"panel {panel['id']} ({panel['title']}): no query evaluation for "
                         "its targets in scripts/dashboard_picture.py (QUERIES)")
    units = {o["matcher"]["options"]: p["value"]
             for o in panel["fieldConfig"].get("overrides", [])
             for p in o["properties"] if p["id"] == "unit"}
    default = panel["fieldConfig"]["defaults"].get("unit", "short")
    lines = []
    for target, (names, query) in zip(panel["targets"], queries, strict=True):
        unit = units.get(target["refId"], default)
        for values, points in sorted(query(series).items()):
            lines.append((legend_name(target.get("legendFormat", ""), names, values), points,
                          unit))
    return lines


def _axis(lines: list[tuple[str, Points, str]], unit: str) -> float:
    values = [v for _, pts, u in lines if u == unit for _, v in pts]
    top = max(values, default=0.0) * 1.15 or 1.0
    return 1.0 if unit == "percentunit" else top


def draw_panel(x: float, y: float, h: float, panel: dict[str, Any], series: Series,
               t_max: float) -> str:
    esc = html.escape
    lines = panel_lines(panel, series)
    units = list(dict.fromkeys([panel["fieldConfig"]["defaults"].get("unit", "short"),
                                *(p["value"] for o in panel["fieldConfig"].get("overrides", [])
                                  for p in o["properties"] if p["id"] == "unit")]))
    left, right = units[0], (units[1] if len(units) > 1 else None)
    tops = {u: _axis(lines, u) for u in units}
    ox, iw = x + 70, COL_W - 70 - (70 if right else 20)
    oy = y + 30 + PLOT_H
    parts = [f'<rect x="{x}" y="{y}" width="{COL_W - 8}" height="{h - 8}" rx="4" '
             'fill="#181b1f" stroke="#2c3235"/>',
             f'<text x="{x + 10}" y="{y + 20}" class="t">{esc(panel["title"])}</text>']
    for k in range(5):
        yy = oy - PLOT_H * k / 4
        parts.append(f'<line x1="{ox}" y1="{yy:.1f}" x2="{ox + iw}" y2="{yy:.1f}" '
                     'stroke="#2c3235"/>')
        parts.append(f'<text x="{ox - 6}" y="{yy + 4:.1f}" class="a" text-anchor="end">'
                     f"{esc(fmt(tops[left] * k / 4, left))}</text>")
        if right:
            parts.append(f'<text x="{ox + iw + 6}" y="{yy + 4:.1f}" class="a">'
                         f"{esc(fmt(tops[right] * k / 4, right))}</text>")
    step = max(10, int(t_max / 6) // 10 * 10 or 10)
    for k in range(0, int(t_max) + 1, step):
        parts.append(f'<text x="{ox + iw * k / t_max:.1f}" y="{oy + 14}" class="a" '
                     f'text-anchor="middle">{k}s</text>')
    if not lines:
        parts.append(f'<text x="{ox + iw / 2}" y="{oy - PLOT_H / 2}" class="a" '
                     'text-anchor="middle">No data</text>')
    ly = oy + 30
    parts.append(f'<text x="{x + 10}" y="{ly}" class="a">series</text>'
                 f'<text x="{x + COL_W - 150}" y="{ly}" class="a" text-anchor="end">last</text>'
                 f'<text x="{x + COL_W - 20}" y="{ly}" class="a" text-anchor="end">max</text>')
    for n, (label, pts, unit) in enumerate(lines):
        color = COLORS[n % len(COLORS)]
        top = tops[unit]
        dashed = ' stroke-dasharray="4 2"' if unit == right else ""
        if pts:
            path = " ".join(f"{ox + iw * t / t_max:.1f},{oy - PLOT_H * min(v, top) / top:.1f}"
                            for t, v in pts)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                         f'stroke-width="1.6"{dashed}/>')
        row = ly + LEGEND_ROW * (n + 1)
        last = fmt(pts[-1][1], unit) if pts else "-"
        peak = fmt(max(v for _, v in pts), unit) if pts else "-"
        parts.append(f'<rect x="{x + 10}" y="{row - 6}" width="10" height="3" fill="{color}"/>'
                     f'<text x="{x + 24}" y="{row}" class="l">{esc(label)}'
                     f'{" (right axis)" if unit == right else ""}</text>'
                     f'<text x="{x + COL_W - 150}" y="{row}" class="l" text-anchor="end">'
                     f"{esc(last)}</text><text x=\"{x + COL_W - 20}\" y=\"{row}\" class=\"l\" "
                     f'text-anchor="end">{esc(peak)}</text>')
    return "\n".join(parts)


def draw(series: Series, dashboard: dict[str, Any] | None = None) -> str:
    """Every panel of the dashboard, laid out on its grid (two panels a row)."""
    board = dashboard or json.loads(DASHBOARD.read_text())
    panels = sorted(board["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    t_max = max(series[-1][0] if series else 1.0, 1.0)
    last = series[-1][1] if series else {}
    rows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for p in panels:
        rows[p["gridPos"]["y"]].append(p)
    body, y = [], 44.0
    for _, row in sorted(rows.items()):
        count = max(len(panel_lines(p, series)) for p in row)
        h = 30 + PLOT_H + 40 + LEGEND_ROW * max(count, 1) + 12
        for p in row:
            x = 0 if p["gridPos"]["x"] < 12 else COL_W
            body.append(draw_panel(x, y, h, p, series, t_max))
        y += h
    compiled = total(last, "farm_kernels_total", outcome="compiled")
    loaded = total(last, "farm_kernels_total", outcome="loaded")
    head = (f'<text x="8" y="26" class="h">{html.escape(board["title"])}</text>'
            f'<text x="130" y="26" class="a">{len(panels)} panels, drawn from the metrics of '
            f"a local cluster (2 PoCL workers, an ingester) running two overlapping builds: "
            f"{compiled:.0f} kernels compiled, {loaded:.0f} loaded, {t_max:.0f} s of "
            "scrapes</text>")
    width, height = 2 * COL_W, y
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
            f'viewBox="0 0 {width} {height:.0f}">\n<style>.t{{font:600 13px sans-serif;'
            'fill:#d8d9da}.a{font:10px sans-serif;fill:#8e8e8e}.l{font:10px sans-serif;'
            'fill:#c7d0d9}.h{font:600 16px sans-serif;fill:#d8d9da}</style>\n'
            f'<rect width="100%" height="100%" fill="#111217"/>\n{head}\n'
            + "\n".join(body) + "\n</svg>\n")


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "dashboard.svg")
