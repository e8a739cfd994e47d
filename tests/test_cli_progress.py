"""The pieces of what a person reads, in process: listings that fit a width without
cutting a value, the progress display (rate, ETA, plain lines, the live layout), and a
fingerprint given by a prefix."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from farm.cli.progress import Progress, RateMeter, clock_text, rate_text
from farm.cli.tables import Column, fit, print_one_row, print_table
from farm.core.device import resolve_fingerprint
from farm.core.errors import InputError

FP = "pocl-pthread-intel-r-xeon-r-processor-4d81ba5f25cb"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def console(width: int) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, color_system=None, highlight=False), buf


# -- listings --------------------------------------------------------------------------------

COLUMNS = [Column("id"), Column("label", wrap=True), Column("compiled", "right"),
           Column("host", optional=True), Column("records", "right", optional=True)]
ROWS = [["1796187761603293040", "build a model with a long label", "20", "a-rather-long-host",
         "21"]]


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_a_listing_never_cuts_a_value(width: int) -> None:
    con, buf = console(width)
    print_table(COLUMNS, ROWS, title=f"sessions in /a/path/{FP}", console=con)
    text = buf.getvalue()
    assert "…" not in text
    assert "1796187761603293040" in text  # the id on one line, whole
    if width > len(FP) + 8:  # the title wraps at spaces, not inside the fingerprint
        assert FP in text
    assert FP in "".join(text.split())  # narrower still: folded, never cut
    assert all(word in text.split() for word in ROWS[0][1].split())  # wrapped, whole


def test_optional_columns_go_first_and_are_named_and_wide_brings_them_back() -> None:
    con, _ = console(60)
    _, dropped, at = fit(COLUMNS, ROWS, width=60, console=con)
    assert dropped == ["host", "records"] and at == 60
    _, dropped, at = fit(COLUMNS, ROWS, width=60, console=con, wide=True)
    assert dropped == [] and at > 60  # printed wider than the terminal, not cut
    _, dropped, _ = fit(COLUMNS, ROWS, width=200, console=con)
    assert dropped == []
    con, buf = console(60)
    print_table(COLUMNS, ROWS, console=con)
    assert "(host, records: --wide, or --json)" in buf.getvalue()


def test_a_summary_row_too_wide_is_stacked_in_pairs() -> None:
    columns = [Column(c, "right") for c in ("kernels", "loaded", "rekeyed", "compiled",
                                            "unsupported", "failed", "work", "wall",
                                            "work/wall")]
    row = ["201", "0", "0", "201", "0", "0", "1234.56 s", "321.00 s", "3.85x"]
    con, buf = console(80)
    print_one_row(columns, row, title=f"farm build medium on {FP}", console=con)
    text = buf.getvalue()
    assert text.splitlines()[0] == f"farm build medium on {FP}"
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= 80
    for header, value in zip((c.header for c in columns), row, strict=True):
        assert f"{header} " in text and value in text
    con, buf = console(200)
    print_one_row(columns, row, title="t", console=con)
    assert len(buf.getvalue().splitlines()) == 4  # title, header, rule, row


# -- progress --------------------------------------------------------------------------------


def test_the_rate_is_recent_and_the_eta_follows_it() -> None:
    clock = FakeClock()
    meter = RateMeter(100, clock, window_s=20.0)
    assert meter.rate is None and meter.eta_s is None
    clock.now += 1
    meter.add(50)  # a burst of stored kernels
    assert meter.rate == pytest.approx(50.0)
    for _ in range(30):  # then compiles, one a second
        clock.now += 1
        meter.add()
    assert meter.rate == pytest.approx(1.0, rel=0.1)  # the burst is out of the window
    assert meter.eta_s == pytest.approx(20.0, rel=0.1)


def test_clock_and_rate_texts() -> None:
    assert clock_text(None) == "-:--" and clock_text(7.4) == "0:07"
    assert clock_text(3725) == "1:02:05"
    assert rate_text(None) == "-/s" and rate_text(12.4) == "12/s"
    assert rate_text(1.44) == "1.4/s" and rate_text(0.314) == "0.31/s"


def test_plain_lines_come_at_the_first_kernel_then_every_interval_then_at_the_end() -> None:
    clock = FakeClock()
    con, buf = console(120)
    shown = Progress(10, console=con, live=False, interval_s=5.0, clock=clock)
    clock.now += 2
    shown.advance("Compiled", "matmul(k=512,n=768)")
    clock.now += 1
    shown.advance("Loaded", "softmax(cols=128)")  # within the interval: no line
    clock.now += 5
    shown.status("in flight: vm:1 2")
    shown.advance("Compiled", "rotary(heads=4)")
    shown.stop()  # no thread was started: stop prints nothing more
    lines = buf.getvalue().splitlines()
    assert lines == [
        "building: 1/10 kernels (10%), 0.50/s, ETA 0:18, elapsed 0:02; last: Compiled "
        "matmul(k=512,n=768)",
        "building: 3/10 kernels (30%), 0.38/s, ETA 0:19, elapsed 0:08; last: Compiled "
        "rotary(heads=4); in flight: vm:1 2"]


def test_a_plain_line_too_wide_puts_each_detail_on_a_line_of_its_own() -> None:
    """Piped at 80 columns: the count keeps its line, the last kernel and the status get
    one each, cut to fit (its whole name is in the records)."""
    clock = FakeClock()
    con, buf = console(80)
    shown = Progress(10, console=con, live=False, interval_s=5.0, clock=clock)
    shown.status("in flight: vm:1 2, vm:2 2")
    clock.now += 2
    label = "matmul(dtype=float,k=4096,m=4096,n=4096,tile_k=16,tile_m=64,tile_n=64,wpt_m=4)"
    shown.advance("Compiled", label)
    lines = buf.getvalue().splitlines()
    assert lines == ["building: 1/10 kernels (10%), 0.50/s, ETA 0:18, elapsed 0:02",
                     f"  last: Compiled {label}"[:79] + "…",
                     "  in flight: vm:1 2, vm:2 2"]
    assert all(len(line) <= 80 for line in lines)


@pytest.mark.parametrize("width", [40, 80, 100])
def test_the_live_display_keeps_count_rate_and_eta_and_shortens_the_label(width: int) -> None:
    clock = FakeClock()
    con, buf = console(width)
    shown = Progress(201, console=con, live=True, clock=clock)
    clock.now += 20
    shown.meter.add(57)
    shown.advance("Compiled", "matmul(dtype=float,k=512,m=1,n=768,tile_k=8,tile_m=16,"
                  "tile_n=16,wpt_m=1,wpt_n=1)")
    shown.status("in flight: queued 49, " + ", ".join(f"vm:{3266 + i} 1" for i in range(9)))
    con.print(shown)
    lines = buf.getvalue().splitlines()
    assert all(len(line) <= width for line in lines), lines
    assert "58/201" in lines[0] and "/s" in lines[0] and "ETA 0:" in lines[0]
    assert lines[1].startswith("  Compiled matmul(dtype=float,k=512")
    assert lines[2].startswith("  in flight: queued 49")


# -- fingerprints ----------------------------------------------------------------------------


def test_a_fingerprint_is_taken_whole_or_by_a_unique_prefix() -> None:
    other = "nvidia-nvidia-h200-cuda-12-8-0123456789ab"
    served = [FP, other, "pocl-cuda-nvidia-h200-aabbccddeeff"]
    assert resolve_fingerprint(FP, served) == FP
    assert resolve_fingerprint("pocl-pth", served) == FP
    assert resolve_fingerprint("nvidia", served) == other
    assert resolve_fingerprint("amd", served) == "amd"  # the caller says what is served
    with pytest.raises(InputError, match="start of 2 fingerprints"):
        resolve_fingerprint("pocl", served)
