"""The picture of a build: one lane per worker, a bar per kernel, stragglers marked.

Rendered as SVG, standalone (``.svg``) or inside one self-contained HTML page
(``.html``: no script, no external file, opens in any browser and attaches to an
issue). SVG because it needs no plotting library on the machine that draws it (the
``timeline`` extra's matplotlib is not required), scales without blur, and every bar
carries a tooltip (``<title>``) naming the kernel, its outcome and its work.

What the picture shows at a glance: the fan-out (how many lanes were busy at once), idle
gaps on a lane (the worker waited for tasks), the tail (a build's wall time is its last
bar's end), and stragglers (red outline: work at least ``STRAGGLER_FACTOR`` times the
build's median, see ``farm.records.query``).
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from farm.core.errors import InputError
from farm.core.model import Outcome
from farm.records.query import STRAGGLER_FACTOR, Timeline

COLORS = {Outcome.COMPILED: "#4c78a8", Outcome.REKEYED: "#54a24b", Outcome.LOADED: "#bab0ac"}
STRAGGLER = "#e45756"
WIDTH = 1100
LABEL_W = 200
LANE_H = 24
TOP = 70
AXIS_H = 40
FORMATS = (".html", ".svg")


def _nice_step(span: float, ticks: int = 10) -> float:
    """A tick spacing of 1, 2 or 5 times a power of ten giving about ``ticks`` ticks."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def render_svg(data: Timeline) -> str:
    """The timeline as one ``<svg>`` element (valid XML)."""
    esc = html.escape
    lanes = ["build", *data.lanes]
    plot_w = WIDTH - LABEL_W - 20
    height = TOP + LANE_H * len(lanes) + AXIS_H + 30
    span = max(data.wall_s, 1e-6)

    def x(t: float) -> float:
        return LABEL_W + plot_w * (t / span)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12" '
        f'data-build="{esc(data.build)}" data-lanes="{len(data.lanes)}">',
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{esc(data.label or "build")}'
        f" ({esc(data.build)})</text>",
    ]
    stragglers = sum(bar.straggler for bar in data.bars)
    started = data.started_at.isoformat(timespec="seconds") if data.started_at else "?"
    parts.append(
        f'<text x="10" y="42">started {esc(started)} · wall {data.wall_s:.2f} s · '
        f"{len(data.bars)} kernel(s) on {len(data.lanes)} worker(s) · {stragglers} "
        f"straggler(s) (work ≥ {STRAGGLER_FACTOR:g} x median)</text>")
    legend_x = 10.0
    for outcome, color in COLORS.items():
        parts.append(f'<rect x="{legend_x}" y="50" width="12" height="10" fill="{color}"/>'
                     f'<text x="{legend_x + 16}" y="59">{outcome.value}</text>')
        legend_x += 90
    parts.append(f'<rect x="{legend_x}" y="50" width="12" height="10" fill="none" '
                 f'stroke="{STRAGGLER}" stroke-width="2"/><text x="{legend_x + 16}" '
                 f'y="59">straggler</text>')

    for index, lane in enumerate(lanes):
        y = TOP + index * LANE_H
        fill = "#f4f4f4" if index % 2 else "#fafafa"
        css = "build" if index == 0 else "lane"
        parts.append(f'<g class="{css}" data-worker="{esc(lane)}">'
                     f'<rect x="{LABEL_W}" y="{y}" width="{plot_w}" height="{LANE_H}" '
                     f'fill="{fill}"/><text x="{LABEL_W - 8}" y="{y + LANE_H * 0.68:.1f}" '
                     f'text-anchor="end">{esc(lane)}</text></g>')
    parts.append(f'<rect class="wall" x="{x(0):.2f}" y="{TOP + 6}" '
                 f'width="{max(0.5, x(data.wall_s) - x(0)):.2f}" height="{LANE_H - 12}" '
                 f'fill="#999999"><title>build wall time {data.wall_s:.3f} s</title></rect>')

    lane_index = {lane: i for i, lane in enumerate(lanes)}
    for bar in data.bars:
        y = TOP + lane_index[bar.lane] * LANE_H + 3
        left, right = x(bar.start_s), x(bar.end_s)
        stroke = (f' stroke="{STRAGGLER}" stroke-width="2"' if bar.straggler
                  else ' stroke="#ffffff" stroke-width="0.5"')
        tip = (f"{bar.family} {bar.key}\n{bar.outcome.value}, work {bar.work_s:.3f} s, "
               f"{bar.start_s:.3f} to {bar.end_s:.3f} s on {bar.lane}"
               f"{' (straggler)' if bar.straggler else ''}")
        parts.append(f'<rect class="bar" data-lane="{esc(bar.lane)}" x="{left:.2f}" y="{y}" '
                     f'width="{max(0.8, right - left):.2f}" height="{LANE_H - 6}" '
                     f'fill="{COLORS[bar.outcome]}"{stroke}><title>{esc(tip)}</title></rect>')
        if right - left >= 7 * len(bar.family) + 6:  # the family's name fits inside
            parts.append(f'<text x="{left + 4:.2f}" y="{y + LANE_H * 0.5:.1f}" font-size="10" '
                         f'fill="#ffffff" pointer-events="none">{esc(bar.family)}</text>')

    axis_y = TOP + LANE_H * len(lanes) + 4
    parts.append(f'<line x1="{LABEL_W}" y1="{axis_y}" x2="{LABEL_W + plot_w}" y2="{axis_y}" '
                 'stroke="#333333"/>')
    step = _nice_step(span)
    tick = 0.0
    while tick <= span + 1e-9:
        tx = x(tick)
        parts.append(f'<line x1="{tx:.2f}" y1="{TOP}" x2="{tx:.2f}" y2="{axis_y + 4}" '
                     f'stroke="#dddddd"/><text x="{tx:.2f}" y="{axis_y + 18}" '
                     f'text-anchor="middle">{tick:g}</text>')
        tick += step
    parts.append(f'<text x="{LABEL_W + plot_w / 2}" y="{axis_y + 34}" text-anchor="middle">'
                 "seconds since the build started</text>")
    parts.append("</svg>")
    return "\n".join(parts)


def render_html(data: Timeline) -> str:
    """A self-contained page: the SVG, then the stragglers and lanes as a table."""
    esc = html.escape
    rows = "\n".join(
        f"<tr><td>{esc(b.lane)}</td><td>{esc(b.family)}</td><td><code>{esc(b.key)}</code>"
        f"</td><td>{b.outcome.value}</td><td>{b.work_s:.3f}</td><td>{b.end_s:.3f}</td></tr>"
        for b in sorted(data.bars, key=lambda bar: bar.work_s, reverse=True) if b.straggler)
    missing = ""
    if data.missing_sessions:
        missing = ("<p>Sessions with records but no session row (not ingested yet, or "
                   "pruned), left out: " + ", ".join(map(str, data.missing_sessions)) + "</p>")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>timeline of build {esc(data.build)}</title>"
        "<style>body{font-family:sans-serif;margin:16px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}</style></head><body>\n"
        f"{render_svg(data)}\n{missing}"
        f"<h3>Stragglers (work ≥ {STRAGGLER_FACTOR:g} x the build's median)</h3>"
        "<table><tr><th>worker</th><th>family</th><th>key</th><th>outcome</th>"
        f"<th>work s</th><th>ended at s</th></tr>\n{rows}\n</table>\n</body></html>\n"
    )


def write_timeline(data: Timeline, path: Path) -> Path:
    """Write ``.html`` or ``.svg`` (by the file's suffix); ``InputError`` for others."""
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise InputError(f"timeline file {path}: write .html or .svg (self-contained, no "
                         "plotting library needed)")
    text = render_html(data) if suffix == ".html" else render_svg(data) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


__all__ = ["COLORS", "FORMATS", "render_html", "render_svg", "write_timeline"]
