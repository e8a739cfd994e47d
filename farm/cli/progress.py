"""What a person sees while a build runs: count, rate and ETA, always.

Fed by callbacks only (``kernel`` per kernel obtained, ``status`` for a live line such
as the cluster's chunks in flight), so it does not care who runs the build: the local
batch, the cluster client, the loader's warm-up. Two renderings, chosen by where stderr
goes:

- a terminal: a live display that is redrawn in place and removed at the end. Its first
  line (bar, done/total, rate, ETA, elapsed) is laid out first and always fits; the
  kernel's label and the status line get what is left of the width and are what gets
  shortened, never the count or the times;
- anything else (a CI log, a file, a pipe): a plain line at the first kernel, then at
  most one every ``PLAIN_INTERVAL_S`` seconds (also when no kernel finished meanwhile,
  so a log shows a long compile is alive), and one at the end. No line is wider than
  the console (``COLUMNS``, else 80): where count, last kernel and status do not fit
  on one, the count keeps its line and each detail gets one of its own, cut to fit.

The rate is kernels a second over the last ``RATE_WINDOW_S`` seconds (a build loads its
stored kernels in a burst, then compiles the rest far slower: an average since the start
would promise an ETA the compiles never keep); before that much time has passed, the
average since the start.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from farm.cli.console import err

if TYPE_CHECKING:
    from farm.core.model import KernelFailure
    from farm.core.outcomes import Outcome

PLAIN_INTERVAL_S = 5.0
"""Seconds between two plain progress lines (a CI log)."""

RATE_WINDOW_S = 20.0
"""Seconds of recent history the rate (and so the ETA) is measured over."""


class KernelDone(Protocol):
    """What a per-kernel callback receives (a batch's ``KernelResult``)."""

    outcome: Outcome | None
    failure: KernelFailure | None

    @property
    def label(self) -> str: ...


class RateMeter:
    """Done out of total, the rate over a recent window, and the ETA from it."""

    def __init__(self, total: int | None, clock: Callable[[], float] = time.monotonic,
                 window_s: float = RATE_WINDOW_S) -> None:
        self.total = total
        self.done = 0
        self._clock = clock
        self._window_s = window_s
        self.started = clock()
        self._samples: deque[tuple[float, int]] = deque([(self.started, 0)])

    def add(self, n: int = 1) -> None:
        self.done += n
        now = self._clock()
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window_s:
            self._samples.popleft()

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self.started

    @property
    def rate(self) -> float | None:
        """Kernels a second; ``None`` before the first one."""
        if self.done == 0:
            return None
        now = self._clock()
        t0, done0 = self._samples[0]
        if now - t0 >= self._window_s / 2 and self.done > done0:
            return (self.done - done0) / max(now - t0, 1e-9)
        return self.done / max(now - self.started, 1e-9)

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate; ``None`` when not known yet."""
        rate = self.rate
        if self.total is None or not rate:
            return None
        return max(0, self.total - self.done) / rate


def clock_text(seconds: float | None) -> str:
    """``m:ss`` (``h:mm:ss`` past an hour); ``-:--`` when unknown."""
    if seconds is None:
        return "-:--"
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def rate_text(rate: float | None) -> str:
    """Kernels a second to two significant digits: ``12/s``, ``1.4/s``, ``0.31/s``."""
    if rate is None:
        return "-/s"
    if rate >= 10:
        return f"{rate:.0f}/s"
    return f"{rate:.1f}/s" if rate >= 1 else f"{rate:.2f}/s"


class Progress:
    """The per-kernel callback (``progress(res)``) and ``status(line)`` of one build."""

    def __init__(self, total: int | None, *, description: str = "building",
                 console: Console | None = None, live: bool | None = None,
                 interval_s: float = PLAIN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, unit: str = "kernels") -> None:
        self.console = console or err
        self.description = description
        #: what is counted (``kernels``; ``keys`` while tuning)
        self.unit = unit
        self.meter = RateMeter(total, clock)
        self.last = ""
        self.status_line = ""
        self._clock = clock
        self._interval_s = interval_s
        self._live_wanted = self.console.is_terminal if live is None else live
        self._lock = threading.RLock()
        self._last_plain = -1.0  # never printed
        self._stop = threading.Event()
        self._live: Live | None = None
        self._thread: threading.Thread | None = None

    # -- the callbacks ------------------------------------------------------------------

    def __call__(self, res: KernelDone) -> None:
        """A batch's per-kernel callback."""
        what = res.outcome.value if res.outcome else (res.failure.kind if res.failure
                                                       else "")
        self.advance(what, res.label)

    def advance(self, what: str, label: str) -> None:
        """One kernel obtained (``what``: its outcome, or the kind of its failure)."""
        with self._lock:
            self.meter.add()
            self.last = f"{what} {label}".strip()
            if not self._live_wanted and (self._last_plain < 0 or self._clock()
                                          - self._last_plain >= self._interval_s):
                self._plain()

    def status(self, line: str) -> None:
        """A line of the caller's, e.g. the cluster's chunks in flight per worker."""
        with self._lock:
            self.status_line = line

    def set_total(self, total: int) -> None:
        with self._lock:
            self.meter.total = total

    # -- the two renderings -------------------------------------------------------------

    def headline(self) -> str:
        """``12/201 kernels (6%), 3.1/s, ETA 0:57, 0:04``: the part never shortened."""
        m = self.meter
        count = f"{m.done}/{m.total}" if m.total is not None else str(m.done)
        share = f" ({m.done / m.total:.0%})" if m.total else ""
        return (f"{count} {self.unit}{share}, {rate_text(m.rate)}, ETA {clock_text(m.eta_s)}, "
                f"elapsed {clock_text(m.elapsed_s)}")

    def _plain(self, final: bool = False) -> None:
        self._last_plain = self._clock()
        line = f"{self.description}: {self.headline()}"
        if final:
            line = (f"{self.description}: {self.meter.done}"
                    f"{'' if self.meter.total is None else f'/{self.meter.total}'} {self.unit} "
                    f"in {clock_text(self.meter.elapsed_s)} ({rate_text(self.meter.rate)})")
        else:
            parts = [p for p in (f"last: {self.last}" if self.last else "",
                                 self.status_line) if p]
            width = self.console.width
            whole = line + "".join(f"; {part}" for part in parts)
            if len(whole) <= width:
                line = whole
            else:  # the count on its line, each detail on its own, cut to the width
                line += "".join("\n" + _cut(f"  {part}", width) for part in parts)
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The live display, laid out for ``options.max_width``."""
        with self._lock:
            width = options.max_width
            m = self.meter
            count = f"{m.done}/{m.total}" if m.total is not None else str(m.done)
            times = (f"{count}  {rate_text(m.rate)}  ETA {clock_text(m.eta_s)}  "
                     f"{clock_text(m.elapsed_s)}")
            room = width - len(self.description) - len(times) - 2
            if room >= 6:  # the bar only where it has room; the numbers always
                grid = Table.grid(padding=(0, 1, 0, 0))
                grid.add_column(no_wrap=True)
                grid.add_column(no_wrap=True, width=min(40, room - 1))
                grid.add_column(no_wrap=True)
                grid.add_row(Text(self.description, style="bold"),
                             ProgressBar(total=m.total, completed=m.done,
                                         width=min(40, room - 1)), Text(times))
                yield grid
            else:
                yield Text(f"{self.description} {times}", style="bold", overflow="fold")
            for line in (self.last, self.status_line):
                if line:
                    yield Text(f"  {line}", no_wrap=True, overflow="ellipsis", end="\n")

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._live_wanted:
            self._live = Live(self, console=self.console, transient=True,
                              refresh_per_second=4)
            self._live.start()
            return
        self._thread = threading.Thread(target=self._tick, daemon=True,
                                        name="farm-progress")
        self._thread.start()

    def _tick(self) -> None:
        """Plain lines through long silences: a log shows a slow compile is alive."""
        while not self._stop.wait(min(1.0, self._interval_s)):
            with self._lock:
                if self._last_plain >= 0 and \
                        self._clock() - self._last_plain >= self._interval_s:
                    self._plain()

    def stop(self, finished: bool = True) -> None:
        self._stop.set()
        if self._live is not None:
            self._live.stop()
        if self._thread is not None:
            self._thread.join(timeout=2)
            if finished and self.meter.done:
                with self._lock:
                    self._plain(final=True)


def _cut(line: str, width: int) -> str:
    """``line`` within ``width`` characters: a progress detail (the last kernel's name,
    the chunks in flight) is a glimpse, its whole text is in the records."""
    return line if len(line) <= width else line[:max(1, width - 1)] + "…"


@contextlib.contextmanager
def progress(total: int | None, *, quiet: bool = False, description: str = "building",
             console: Console | None = None, interval_s: float = PLAIN_INTERVAL_S,
             unit: str = "kernels") -> Iterator[Progress]:
    """A build's progress on stderr while the block runs; nothing with ``quiet`` (under
    ``--json``: its callbacks still work, they just print nothing). ``unit`` names what
    is counted."""
    kind = _Silent if quiet else Progress
    shown = kind(total, description=description, console=console, interval_s=interval_s,
                 unit=unit)
    shown.start()
    ok = False
    try:
        yield shown
        ok = True
    finally:
        shown.stop(finished=ok)


class _Silent(Progress):
    """Counts, prints nothing."""

    def _plain(self, final: bool = False) -> None:
        return None

    def start(self) -> None:
        return None


__all__ = ["PLAIN_INTERVAL_S", "Progress", "RateMeter", "clock_text", "progress",
           "rate_text"]
