"""Draw docs/dashboard.svg: every panel of the Grafana dashboard, from real metrics.

Starts a local cluster (Redis, MinIO, two workers of two pool processes each and an
ingester, with their metrics ports), and runs, one after another or overlapping:

* build ``a``: fresh kernels, one of which fails to compile (a family of the picture's
  own, ``broken``, on every process through ``FARM_FAMILY_MODULES``): its chunk is
  counted ``kernel_failed``, not ``success``;
* build ``b`` at the same moment, with the first 16 kernels of ``a``: the two meet, and a
  worker waits for the other's compile of the same source (a lease) and loads it;
* build ``a`` again once both are done: its client finds every kernel in the store but
  the failed one (the client-side store hit ratio goes from 0 to 96 %).

Each build writes its summary with ``--metrics-file`` (as node-exporter's textfile
collector would read it). Everything is scraped every half second, and each panel is
drawn as Grafana would: title, unit (a second axis where a series overrides it),
``decimals``, and a table legend with each series' last and max. The series are the
dashboard's own queries: every target's ``expr`` is parsed and evaluated over the
scrapes by ``scripts/promql.py`` (a construct it does not read stops the drawing), so
the picture cannot drift from the dashboard file
(helm/kernel-farm/dashboards/kernel-farm.json).

Usage: ``.venv/bin/python scripts/dashboard_picture.py [OUT.svg]`` (a minute or two).
"""

from __future__ import annotations

import html
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from promql import PromQLError, Sample, Series, evaluate

from farm.devservices.cluster import local_cluster
from farm.devservices.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "kernel-farm" / "dashboards" / "kernel-farm.json"
Points = list[tuple[float, float]]
#: gauges that every process exports from Redis: the same value, merged with max
SHARED_GAUGES = ("farm_queue_depth", "farm_in_flight_chunks", "farm_workers",
                 "farm_worker_processes", "farm_broker_up", "farm_ingest_lag_entries",
                 "farm_ingest_pending_entries")
RATE_INTERVAL_S = 4.0
"""``$__rate_interval`` over scrapes every half second (Grafana's is four scrape
intervals or more)."""

BROKEN_FAMILY = '''\
"""A family whose source does not compile: the picture's failed kernel."""
from farm.core.model import Lowered
from farm.families.base import KernelFamily, Params


class BrokenParams(Params):
    n: int = 1


class Broken(KernelFamily[BrokenParams]):
    name = "broken"
    params_model = BrokenParams

    def lower(self, params, launch, device):
        return Lowered(source="__kernel void broken(__global float *x) { x[0] = ; }\\n",
                       kernel_names=("broken",))


FAMILIES = [Broken]
'''


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


def manifest(path: Path, name: str, cols: list[int], broken: bool = False) -> Path:
    """Cheap kernels, one per column count (the same count: the same kernel)."""
    lines = ["format = 1", f'name = "{name}"', ""]
    if broken:  # first: the kernels another build meets are at the end
        lines += ["[[kernels]]", 'family = "broken"', ""]
    for c in cols:
        lines += ["[[kernels]]", 'family = "reduce"', f'params = {{ op = "sum", cols = {c} }}',
                  ""]
    path.write_text("\n".join(lines))
    return path


def record(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="farm-picture-") as tmp, \
            local_cluster(Path(tmp)) as cluster:
        plugins = Path(tmp) / "plugins"
        plugins.mkdir()
        (plugins / "brokenfamily.py").write_text(BROKEN_FAMILY)
        cluster.extra_env.update(PYTHONPATH=str(plugins),
                                 FARM_FAMILY_MODULES=json.dumps(["brokenfamily"]))
        ports = [free_port(), free_port(), free_port()]
        for port in ports[:2]:
            cluster.start_worker(concurrency=2, args=("--metrics-port", str(port)))
        cluster.extra_env["FARM_METRICS_PORT"] = str(ports[2])  # the ingester's only
        cluster.start_ingester(f"sqlite:///{Path(tmp) / 'records.sqlite'}")
        del cluster.extra_env["FARM_METRICS_PORT"]
        cluster.wait_ready()
        # one file per manifest, as the Pushgateway keeps one group per manifest: a
        # manifest's next build replaces its last
        textfiles = [Path(tmp) / f"{n}.prom" for n in ("a", "b")]
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
        env = cluster.env(Path(tmp) / "client", FARM_CHUNK_SIZE="1")
        cols = list(range(1001, 1025))

        def build(name: str, kernels: list[int], textfile: Path,
                  broken: bool = False) -> list[str]:
            path = manifest(Path(tmp) / f"{textfile.stem}.toml", name, kernels, broken)
            return [sys.executable, "-m", "farm", "build", str(path), "--cluster", "--json",
                    "--metrics-file", str(textfile)]

        # b asks for a's kernels in reverse order at the same moment: whichever client
        # sends first, the queue holds its last kernels right before the other's first
        # ones, the same kernels: two workers take them at once, and the second waits
        # for the first's compile (a lease) and loads it
        first = subprocess.Popen(build("a", cols, textfiles[0], broken=True), env=env,
                                 stdout=subprocess.DEVNULL)
        second = subprocess.run(build("b", cols[::-1], textfiles[1]), env=env,
                                stdout=subprocess.DEVNULL, check=False)
        first.wait(timeout=600)
        assert second.returncode == 0 and first.returncode == 1  # a: one kernel failed
        time.sleep(3)
        again = subprocess.run(build("a", cols, textfiles[0], broken=True), env=env,
                               stdout=subprocess.DEVNULL, check=False)
        assert again.returncode == 1  # the broken kernel fails again; the rest is stored
        time.sleep(5)  # the ingester's last records, the counters' last rate windows
        stop.set()
        thread.join()
    out.write_text(draw(series))
    print(f"dashboard picture: {out} ({len(series)} scrapes)")


# -- the queries: the dashboard's own, evaluated by scripts/promql.py -----------------------


def legend_name(fmt_text: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format, filled in."""
    text = fmt_text
    for name, value in labels.items():
        text = text.replace("{{" + name + "}}", value)
    return " ".join(text.split()) or "value"


def panel_lines(panel: dict[str, Any], series: Series) -> list[tuple[str, Points, str]]:
    """(legend, points, unit) of each series the panel's targets give, in order: each
    target's ``expr`` evaluated as written in the dashboard (its variables at their
    "All" values), named by its ``legendFormat``."""
    units = {o["matcher"]["options"]: p["value"]
             for o in panel["fieldConfig"].get("overrides", [])
             for p in o["properties"] if p["id"] == "unit"}
    default = panel["fieldConfig"]["defaults"].get("unit", "short")
    lines = []
    for target in panel["targets"]:
        unit = units.get(target["refId"], default)
        try:
            found = evaluate(target["expr"], series, rate_interval=RATE_INTERVAL_S,
                             variables={"fingerprint": ".*"})
        except PromQLError as exc:
            raise SystemExit(f"panel {panel['id']} ({panel['title']}), target "
                             f"{target['refId']}: {exc}") from None
        for labels, points in sorted(found.items()):
            lines.append((legend_name(target.get("legendFormat", ""), dict(labels)), points,
                          unit))
    return lines


# -- drawing -------------------------------------------------------------------------------

#: Grafana's classic palette order, then more: 14 colours apart on a dark background
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#b877d9", "#f2495c", "#8ab8ff",
          "#fade2a", "#37872d", "#c4162a", "#1f60c4", "#8f3bb8", "#ffb357", "#96d98d"]
COL_W, PLOT_H, LEGEND_ROW = 600, 110, 13
TICKS = 4


def fmt(value: float, unit: str, decimals: int | None = None) -> str:
    """A value as Grafana writes it in ``unit`` (``decimals`` when the panel sets it)."""
    if unit == "percentunit":
        return f"{value:.0%}"
    if unit == "s":
        if 0 < value < 1:
            return f"{value * 1000:.3g} ms"
        return f"{value:.3g} s"
    if unit == "Bps":
        scaled, prefix = value, ""
        for step in ("k", "M", "G"):
            if abs(scaled) < 1000:
                break
            scaled, prefix = scaled / 1000, step
        return f"{scaled:.3g} {prefix}B/s"
    number = f"{value:.{decimals}f}" if decimals is not None else f"{value:.3g}"
    if unit.startswith("suffix:"):
        return f"{number}{unit.removeprefix('suffix:')}"
    return number


def nice_scale(top: float, unit: str, decimals: int | None) -> tuple[float, float]:
    """(axis maximum, tick step): steps of 1, 2, 2.5 or 5 times a power of ten, whole
    numbers where the panel shows no decimals, the maximum a whole number of steps."""
    if unit == "percentunit":
        return 1.0, 0.25
    top = top if top > 0 else 1.0
    raw = top / TICKS
    power = 10 ** math.floor(math.log10(raw))
    step = next(f * power for f in (1, 2, 2.5, 5, 10) if f * power >= raw)
    if decimals == 0:
        step = max(1.0, math.ceil(step))
    return step * math.ceil(top / step - 1e-9), step


def _ticks(top: float, step: float) -> list[float]:
    return [k * step for k in range(round(top / step) + 1)]


def draw_panel(x: float, y: float, h: float, panel: dict[str, Any], series: Series,
               t_max: float) -> str:
    esc = html.escape
    lines = panel_lines(panel, series)
    decimals = panel["fieldConfig"]["defaults"].get("decimals")
    units = list(dict.fromkeys([panel["fieldConfig"]["defaults"].get("unit", "short"),
                                *(p["value"] for o in panel["fieldConfig"].get("overrides", [])
                                  for p in o["properties"] if p["id"] == "unit")]))
    left, right = units[0], (units[1] if len(units) > 1 else None)
    scales = {u: nice_scale(max((v for _, pts, lu in lines if lu == u for _, v in pts),
                                default=0.0), u, decimals) for u in units}
    ox, iw = x + 70, COL_W - 70 - (70 if right else 20)
    oy = y + 30 + PLOT_H
    parts = [f'<rect x="{x}" y="{y}" width="{COL_W - 8}" height="{h - 8}" rx="4" '
             'fill="#181b1f" stroke="#2c3235"/>',
             f'<text x="{x + 10}" y="{y + 20}" class="t">{esc(panel["title"])}</text>']
    top_left, step_left = scales[left]
    for tick in _ticks(top_left, step_left):
        yy = oy - PLOT_H * tick / top_left
        parts.append(f'<line x1="{ox}" y1="{yy:.1f}" x2="{ox + iw}" y2="{yy:.1f}" '
                     'stroke="#2c3235"/>')
        parts.append(f'<text x="{ox - 6}" y="{yy + 4:.1f}" class="a" text-anchor="end">'
                     f"{esc(fmt(tick, left, decimals))}</text>")
    if right:
        top_right, step_right = scales[right]
        for tick in _ticks(top_right, step_right):
            yy = oy - PLOT_H * tick / top_right
            parts.append(f'<text x="{ox + iw + 6}" y="{yy + 4:.1f}" class="a">'
                         f"{esc(fmt(tick, right, decimals))}</text>")
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
    drawn: list[set[str]] = []
    for n, (label, pts, unit) in enumerate(lines):
        color = COLORS[n % len(COLORS)]
        top = scales[unit][0]
        dashed = ' stroke-dasharray="4 2"' if unit == right else ""
        if pts:
            xy = [(ox + iw * t / t_max, oy - PLOT_H * min(v, top) / top) for t, v in pts]
            points = {f"{px:.0f},{py:.0f}" for px, py in xy}
            under = sum(len(points & earlier) >= len(points) / 2 for earlier in drawn)
            drawn.append(points)
            if under:  # on an earlier series for most of its length: dashed, and lifted
                dashed = ' stroke-dasharray="6 4"'  # 2 px a series below, so both show
            path = " ".join(f"{px:.1f},{py - 2 * under:.1f}" for px, py in xy)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                         f'stroke-width="1.6"{dashed}/>')
        row = ly + LEGEND_ROW * (n + 1)
        last = fmt(pts[-1][1], unit, decimals) if pts else "-"
        peak = fmt(max(v for _, v in pts), unit, decimals) if pts else "-"
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
            f'<text x="130" y="26" class="a">{len(panels)} panels, each drawn from its own '
            "queries over the metrics of a local cluster (2 PoCL workers of 2 processes, an "
            f"ingester) running three builds: {compiled:.0f} kernels compiled, "
            f"{loaded:.0f} loaded by workers, {t_max:.0f} s of scrapes</text>")
    width, height = 2 * COL_W, y
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
            f'viewBox="0 0 {width} {height:.0f}">\n<style>.t{{font:600 13px sans-serif;'
            'fill:#d8d9da}.a{font:10px sans-serif;fill:#8e8e8e}.l{font:10px sans-serif;'
            'fill:#c7d0d9}.h{font:600 16px sans-serif;fill:#d8d9da}</style>\n'
            f'<rect width="100%" height="100%" fill="#111217"/>\n{head}\n'
            + "\n".join(body) + "\n</svg>\n")


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "dashboard.svg")
