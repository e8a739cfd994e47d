"""The picture of a build: one lane per worker, a bar per kernel, stragglers marked.

Rendered as SVG, standalone (``.svg``) or inside one self-contained HTML page
(``.html``: no script, no external file, opens in any browser and attaches to an
issue). SVG because it needs no plotting library on the machine that draws it (the
``timeline`` extra's matplotlib is not required), scales without blur, and every bar
carries a tooltip (``<title>``) naming the kernel by family and parameters, its outcome,
its work, and last its key. The picture is as wide as the window or page it is shown
in (a ``viewBox``, no fixed width), so nothing is clipped at 800 pixels.

What the picture shows at a glance: the fan-out (how many lanes were busy at once), idle
gaps on a lane (the worker waited for tasks), the tail (a build's wall time is its last
bar's end), where the time went, and stragglers (red outline: work at least
``STRAGGLER_FACTOR`` times the build's median, see ``farm.records.query``).

Colour says one thing at a time (``colour_by``): the **family** (the default when no
family holds more than three kernels in four; a palette of well separated colours, Kelly's),
or the **outcome** (Compiled, Rekeyed, Loaded) when one family dominates, since a build
that is mostly matmuls would otherwise be one band of one colour. Either way the other
is still there: by family, a Rekeyed bar is striped and a Loaded one pale with an
outline; by outcome, the family is the strip under each bar (its own colour) and the
name written in it. Every bar is at least ``MIN_BAR`` wide, so a kernel loaded in a
millisecond is a visible mark, not a sliver. The client (the build's own process, which
finds stored kernels itself) has a lane of its own and is not counted as a worker.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from farm.core.errors import InputError
from farm.core.outcomes import Outcome
from farm.records.query import STRAGGLER_FACTOR, Bar, Timeline

PALETTE = ("#0067a5", "#f38400", "#008856", "#875692", "#f3c300", "#a1caf1", "#e68fac",
           "#848482", "#882d17", "#8db600", "#604e97", "#c2b280")
"""Family colours: Kelly's colours of maximum contrast less white, black and red (red is
the stragglers'), given in the order families first start work; a build of more families
reuses them, and the bars' labels and tooltips tell them apart."""
STRAGGLER = "#e45756"
#: colours by outcome (``colour_by="outcome"``): the compiler ran, was avoided, or nothing
#: was built
OUTCOME_COLORS = {Outcome.COMPILED: "#1f4e79", Outcome.REKEYED: "#2e9c5a",
                  Outcome.LOADED: "#9aa5b1"}
#: how an outcome is drawn over its family's colour: Compiled solid, Rekeyed striped
#: (the compiler was avoided), Loaded pale with an outline (nothing was built)
OUTCOME_STYLE = {Outcome.COMPILED: "solid", Outcome.REKEYED: "striped", Outcome.LOADED: "pale"}
DOMINANT_SHARE = 0.75
"""A family holding more than this share of the kernels turns the colours to outcomes
(three in four: below that, the other families still show as bands of their own)."""
MIN_BAR = 3.0
"""The narrowest bar, in drawing units (0.3 % of the width): a load of a millisecond."""
WIDTH = 1000
"""Width of the drawing in its own units; it is shown as wide as the window (or page)."""
LANE_H = 24
TOP = 78
AXIS_H = 40
FORMATS = (".html", ".svg")


def colour_by(data: Timeline) -> str:
    """``"outcome"`` when one family holds more than ``DOMINANT_SHARE`` of the kernels
    and colours by family would say little (one band), else ``"family"``."""
    counts: dict[str, int] = {}
    for bar in data.bars:
        counts[bar.family] = counts.get(bar.family, 0) + 1
    dominant = bool(counts) and max(counts.values()) > DOMINANT_SHARE * len(data.bars)
    outcomes = {bar.outcome for bar in data.bars}
    return "outcome" if dominant and (len(counts) > 1 or len(outcomes) > 1) else "family"


def family_colors(data: Timeline) -> dict[str, str]:
    """Family -> colour, in the order the families first start work."""
    order: list[str] = []
    for bar in sorted(data.bars, key=lambda b: b.start_s):
        if bar.family not in order:
            order.append(bar.family)
    return {family: PALETTE[i % len(PALETTE)] for i, family in enumerate(order)}


def kernel_text(bar: Bar) -> str:
    """The kernel as people name it; its family and key for records older than names."""
    return bar.kernel or f"{bar.family} {bar.key}"


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


def _swatch(fill: str, extra: str = "", height: int = 10) -> str:
    return f'<rect x="{{x}}" y="{{y}}" width="12" height="{height}" fill="{fill}"{extra}/>'


def _legend(colors: dict[str, str], by: str, y: float) -> tuple[list[str], float]:
    """A row of the families' colours, then one of the outcomes' (their colours when
    colouring by outcome, else their styles) and the straggler mark, each wrapped as
    the width needs; returns the parts and the next y."""
    grey = "#555555"
    striped = '<rect x="{x}" y="{y}" width="12" height="10" fill="url(#striped)"/>'
    if by == "outcome":
        families = [(_swatch(color, height=5), family)
                    for family, color in colors.items()]
        outcomes = [(_swatch(OUTCOME_COLORS[o]), o.value) for o in OUTCOME_STYLE]
        family_title = "family (strip)"
    else:
        families = [(_swatch(color), family) for family, color in colors.items()]
        outcomes = [(_swatch(grey), "Compiled (solid)"),
                    (_swatch(grey) + striped, "Rekeyed (striped)"),
                    (_swatch(grey, f' fill-opacity="0.35" stroke="{grey}"'), "Loaded (pale)")]
        family_title = "families"
    outcomes.append((_swatch("none", f' stroke="{STRAGGLER}" stroke-width="2"'),
                     "straggler (outlined)"))
    parts: list[str] = []
    row_y = y
    for title, items in ((family_title, families), ("outcome", outcomes)):
        parts.append(f'<text x="10" y="{row_y + 9:.1f}" fill="#555555">{title}:</text>')
        x = 100.0
        for swatch, label in items:
            width = 22 + 6.5 * len(label)
            if x + width > WIDTH - 10:
                x, row_y = 100.0, row_y + 16
            parts.append(swatch.format(x=f"{x:.1f}", y=f"{row_y:.1f}")
                         + f'<text x="{x + 16:.1f}" y="{row_y + 9:.1f}">'
                         f"{html.escape(label)}</text>")
            x += width
        row_y += 16
    return parts, row_y


def render_svg(data: Timeline) -> str:
    """The timeline as one ``<svg>`` element (valid XML), as wide as where it is shown."""
    esc = html.escape
    lanes = ["build", *data.lanes]
    colors = family_colors(data)
    by = colour_by(data)
    label_w = min(240, max(60, 8 + 7 * max(len(lane) for lane in lanes)))
    plot_w = WIDTH - label_w - 20
    stragglers = sum(bar.straggler for bar in data.bars)
    started = data.started_at.isoformat(timespec="seconds") if data.started_at else "?"
    legend, top = _legend(colors, by, 50)
    top = max(top + 8, TOP)
    height = top + LANE_H * len(lanes) + AXIS_H + 10
    span = max(data.wall_s, 1e-6)

    def x(t: float) -> float:
        return label_w + plot_w * (t / span)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="100%" viewBox="0 0 {WIDTH} '
        f'{height}" preserveAspectRatio="xMinYMin meet" style="max-width:100%;height:auto" '
        f'font-family="sans-serif" font-size="12" data-build="{esc(data.build)}" '
        f'data-lanes="{len(data.lanes)}" data-workers="{len(data.workers)}" '
        f'data-colour-by="{by}">',
        '<defs><pattern id="striped" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#ffffff" '
        'fill-opacity="0.0"/><line x1="0" y1="0" x2="0" y2="6" stroke="#ffffff" '
        'stroke-width="3" stroke-opacity="0.6"/></pattern></defs>',
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{esc(data.label or "build")}'
        f" ({esc(data.build)})</text>",
        f'<text x="10" y="40">started {esc(started)} · wall {data.wall_s:.2f} s · '
        f"{len(data.bars)} kernel(s) on {esc(data.lanes_text())} · {stragglers} "
        f"straggler(s) (work ≥ {STRAGGLER_FACTOR:g} x median)</text>",
        *legend,
    ]
    for index, lane in enumerate(lanes):
        y = top + index * LANE_H
        fill = "#f4f4f4" if index % 2 else "#fafafa"
        css = "build" if index == 0 else "lane"
        parts.append(f'<g class="{css}" data-worker="{esc(lane)}">'
                     f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{LANE_H}" '
                     f'fill="{fill}"/><text x="{label_w - 8}" y="{y + LANE_H * 0.68:.1f}" '
                     f'text-anchor="end">{esc(lane)}</text></g>')
    parts.append(f'<rect class="wall" x="{x(0):.2f}" y="{top + 6}" '
                 f'width="{max(0.5, x(data.wall_s) - x(0)):.2f}" height="{LANE_H - 12}" '
                 f'fill="#999999"><title>build wall time {data.wall_s:.3f} s</title></rect>')

    lane_index = {lane: i for i, lane in enumerate(lanes)}
    for bar in data.bars:
        parts += _bar(bar, top + lane_index[bar.lane] * LANE_H + 3, x(bar.start_s),
                      x(bar.end_s), colors[bar.family], by)

    axis_y = top + LANE_H * len(lanes) + 4
    parts.append(f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" '
                 'stroke="#333333"/>')
    step = _nice_step(span)
    tick = 0.0
    while tick <= span + 1e-9:
        tx = x(tick)
        parts.append(f'<line x1="{tx:.2f}" y1="{top}" x2="{tx:.2f}" y2="{axis_y + 4}" '
                     f'stroke="#dddddd"/><text x="{tx:.2f}" y="{axis_y + 18}" '
                     f'text-anchor="middle">{tick:g}</text>')
        tick += step
    parts.append(f'<text x="{label_w + plot_w / 2}" y="{axis_y + 34}" text-anchor="middle">'
                 "seconds since the build started</text>")
    parts.append("</svg>")
    return "\n".join(parts)


def _bar(bar: Bar, y: float, left: float, right: float, color: str, by: str) -> list[str]:
    """One kernel: coloured by its family (its outcome as a style) or by its outcome (its
    family as a strip under it), at least ``MIN_BAR`` wide; its name in the tooltip (and
    inside the bar when it fits), the key last (on demand)."""
    esc = html.escape
    style = OUTCOME_STYLE[bar.outcome]
    height = LANE_H - 6
    width = max(MIN_BAR, right - left)
    if by == "outcome":
        fill, opacity, style = OUTCOME_COLORS[bar.outcome], "", "solid"
        height -= 4  # room for the family's strip
    else:
        fill = color
        opacity = ' fill-opacity="0.35"' if style == "pale" else ""
    stroke = (f' stroke="{STRAGGLER}" stroke-width="2"' if bar.straggler
              else f' stroke="{color}" stroke-width="1"' if style == "pale"
              else ' stroke="#ffffff" stroke-width="0.5"')
    tip = (f"{kernel_text(bar)}\n{bar.outcome.value}, work {bar.work_s:.3f} s, "
           f"{bar.start_s:.3f} to {bar.end_s:.3f} s on {bar.lane}"
           f"{' (straggler)' if bar.straggler else ''}"
           + (f"\nkey {bar.key}" if bar.kernel else ""))
    parts = [f'<rect class="bar" data-lane="{esc(bar.lane)}" data-family="{esc(bar.family)}" '
             f'data-outcome="{bar.outcome.value}" x="{left:.2f}" y="{y}" width="{width:.2f}" '
             f'height="{height}" fill="{fill}"{opacity}{stroke}>'
             f"<title>{esc(tip)}</title></rect>"]
    if by == "outcome":
        parts.append(f'<rect class="strip" x="{left:.2f}" y="{y + height}" '
                     f'width="{width:.2f}" height="4" fill="{color}" pointer-events="none"/>')
    if style == "striped":
        parts.append(f'<rect x="{left:.2f}" y="{y}" width="{width:.2f}" height="{height}" '
                     'fill="url(#striped)" pointer-events="none"/>')
    if width >= 6.5 * len(bar.family) + 8:  # the family's name fits inside
        ink = "#222222" if style == "pale" else "#ffffff"
        parts.append(f'<text x="{left + 4:.2f}" y="{y + height * 0.5 + 3:.1f}" '
                     f'font-size="10" fill="{ink}" pointer-events="none">'
                     f"{esc(bar.family)}</text>")
    return parts


def render_html(data: Timeline) -> str:
    """A self-contained page: the SVG, as wide as the window, then the stragglers."""
    esc = html.escape
    rows = "\n".join(
        f"<tr><td>{esc(b.lane)}</td><td class=\"kernel\" title=\"key {esc(b.key)}\">"
        f"{esc(kernel_text(b).replace(',', ', '))}</td>"
        f"<td>{b.outcome.value}</td><td>{b.work_s:.3f}</td><td>{b.end_s:.3f}</td></tr>"
        for b in sorted(data.bars, key=lambda bar: bar.work_s, reverse=True) if b.straggler
    ) or "<tr><td colspan=\"5\">none: no kernel's work reached that</td></tr>"
    missing = ""
    if data.missing_sessions:
        missing = ("<p>Sessions with records but no session row (not ingested yet, or "
                   "pruned), left out: " + ", ".join(map(str, data.missing_sessions)) + "</p>")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>timeline of build {esc(data.build)}</title>"
        "<style>body{font-family:sans-serif;margin:8px}svg{display:block;width:100%;"
        "height:auto}table{border-collapse:collapse;max-width:100%}td,th{border:1px solid "
        "#ccc;padding:2px 8px;text-align:left;white-space:nowrap}"
        "td.kernel{white-space:normal;overflow-wrap:anywhere}"
        "h3{font-size:1em}</style></head><body>\n"
        f"{render_svg(data)}\n{missing}"
        f"<h3>Stragglers (work ≥ {STRAGGLER_FACTOR:g} x the build's median; hover a kernel "
        "for its key)</h3>"
        "<table><tr><th>worker</th><th>kernel</th><th>outcome</th>"
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


__all__ = ["FORMATS", "OUTCOME_COLORS", "PALETTE", "colour_by", "family_colors",
           "kernel_text", "render_html", "render_svg", "write_timeline"]
