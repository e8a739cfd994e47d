"""Draw docs/dashboard.svg: the main panels of the Grafana dashboard, from real metrics.

Starts a local cluster (Redis, MinIO, two workers with their metrics ports), runs two
builds of fresh kernels (the second overlapping the first, so that kernels in flight in
both are compiled once and loaded by the other), scrapes the workers every half second,
and draws what the dashboard's queries show: queue depth and chunks in flight, kernels
per second by outcome, compile-time percentiles, and store reads and writes. No Grafana
is needed to see what the dashboard looks like on a working farm.

Usage: ``.venv/bin/python scripts/dashboard_picture.py [OUT.svg]`` (about a minute).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from farm.devservices.cluster import local_cluster
from farm.devservices.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Sample:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: Sample = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(sample: Sample, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in sample.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def maximum(sample: Sample, name: str) -> float:
    return max([v for (n, _), v in sample.items() if n == name] or [0.0])


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
        ports = [free_port(), free_port()]
        for port in ports:
            cluster.start_worker(concurrency=1, args=("--metrics-port", str(port)))
        cluster.wait_ready()
        series: list[tuple[float, Sample]] = []
        stop = threading.Event()

        def sampler() -> None:
            start = time.monotonic()
            while not stop.is_set():
                merged: Sample = defaultdict(float)
                depth: Sample = {}
                for port in ports:
                    for key, value in scrape(port).items():
                        if key[0] in ("farm_queue_depth", "farm_in_flight_chunks"):
                            depth[key] = max(depth.get(key, 0.0), value)  # max, not sum
                        else:
                            merged[key] += value
                merged.update(depth)
                series.append((time.monotonic() - start, dict(merged)))
                stop.wait(0.5)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        time.sleep(2)
        env = cluster.env(Path(tmp) / "client")
        first = subprocess.Popen([sys.executable, "-m", "farm", "build",
                                  str(manifest(Path(tmp) / "a.toml", list(range(1001, 1033)))),
                                  "--cluster", "--json"], env=env, stdout=subprocess.DEVNULL)
        time.sleep(3)
        # Overlaps the first: its kernels still in flight there are waited for (leases)
        # and loaded, not compiled twice.
        overlap = list(range(1013, 1033)) + list(range(2001, 2013))
        second = subprocess.run([sys.executable, "-m", "farm", "build",
                                 str(manifest(Path(tmp) / "b.toml", overlap)), "--cluster",
                                 "--json"], env=env, stdout=subprocess.DEVNULL, check=True)
        first.wait(timeout=600)
        assert second.returncode == 0 and first.returncode == 0
        time.sleep(2)
        time.sleep(1)
        stop.set()
        thread.join()
    out.write_text(draw(series))
    print(f"dashboard picture: {out} ({len(series)} scrapes)")


# -- drawing ---------------------------------------------------------------------------

COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#b877d9", "#f2495c"]
W, H, PAD = 560, 230, 44


def rates(series: list[tuple[float, Sample]], name: str, window: float = 4.0,
          **labels: str) -> list[tuple[float, float]]:
    out = []
    for i, (t, sample) in enumerate(series):
        j = i
        while j > 0 and t - series[j - 1][0] <= window:
            j -= 1
        if j == i:
            out.append((t, 0.0))
            continue
        t0, s0 = series[j]
        out.append((t, (total(sample, name, **labels) - total(s0, name, **labels)) / (t - t0)))
    return out


def quantile(series: list[tuple[float, Sample]], name: str, q: float,
             window: float = 6.0) -> list[tuple[float, float]]:
    """histogram_quantile(q, rate(name_bucket[window])) as Prometheus computes it."""
    out = []
    for i, (t, sample) in enumerate(series):
        j = i
        while j > 0 and t - series[j - 1][0] <= window:
            j -= 1
        base = series[j][1]
        buckets: dict[float, float] = defaultdict(float)
        for (n, ls), v in sample.items():
            if n == f"{name}_bucket":
                le = dict(ls)["le"]
                bound = float("inf") if le == "+Inf" else float(le)
                buckets[bound] += v - base.get((n, ls), 0.0)
        ordered = sorted(buckets.items())
        count = ordered[-1][1] if ordered else 0.0
        if count <= 0:
            continue
        rank, lower, below = q * count, 0.0, 0.0
        for bound, cumulative in ordered:
            if cumulative >= rank:
                if bound == float("inf"):
                    out.append((t, lower))
                else:
                    share = (rank - below) / max(cumulative - below, 1e-12)
                    out.append((t, lower + (bound - lower) * share))
                break
            lower, below = bound, cumulative
    return out


def panel(x: int, y: int, title: str, lines: list[tuple[str, list[tuple[float, float]]]],
          t_max: float, unit: str = "") -> str:
    values = [v for _, pts in lines for _, v in pts] or [1.0]
    top = max(values) * 1.15 or 1.0
    iw, ih = W - PAD - 16, H - PAD - 46
    ox, oy = x + PAD, y + 30 + ih

    def px(t: float, v: float) -> str:
        return f"{ox + iw * t / t_max:.1f},{oy - ih * v / top:.1f}"

    parts = [f'<rect x="{x}" y="{y}" width="{W - 8}" height="{H - 8}" rx="4" fill="#181b1f" '
             'stroke="#2c3235"/>',
             f'<text x="{x + 10}" y="{y + 20}" class="t">{title}</text>']
    if top >= 4:
        top = float(-(-top // 4) * 4)  # whole-number ticks
    for k in range(5):
        v = top * k / 4
        yy = oy - ih * k / 4
        parts.append(f'<line x1="{ox}" y1="{yy:.1f}" x2="{ox + iw}" y2="{yy:.1f}" '
                     'stroke="#2c3235"/>')
        label = f"{v:.2f}" if top < 10 else f"{v:.0f}"
        parts.append(f'<text x="{ox - 6}" y="{yy + 4:.1f}" class="a" '
                     f'text-anchor="end">{label}{unit}</text>')
    for k in range(0, int(t_max) + 1, max(10, int(t_max / 6) // 10 * 10 or 10)):
        parts.append(f'<text x="{ox + iw * k / t_max:.1f}" y="{oy + 14}" class="a" '
                     f'text-anchor="middle">{k}s</text>')
    for n, (label, pts) in enumerate(lines):
        color = COLORS[n % len(COLORS)]
        if pts:
            path = " ".join(px(t, v) for t, v in pts)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                         'stroke-width="1.6"/>')
        lx = x + 10 + n * 120
        parts.append(f'<rect x="{lx}" y="{y + H - 26}" width="10" height="3" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{y + H - 21}" class="a">{label}</text>')
    return "\n".join(parts)


def draw(series: list[tuple[float, Sample]]) -> str:
    t_max = series[-1][0] if series else 1.0
    last = series[-1][1] if series else {}
    panels = [
        panel(0, 40, "Queue depth and chunks in flight (max by fingerprint)", [
            ("waiting", [(t, maximum(s, "farm_queue_depth")) for t, s in series]),
            ("in flight", [(t, maximum(s, "farm_in_flight_chunks")) for t, s in series])],
            t_max),
        panel(W, 40, "Kernels per second by outcome", [
            (o, rates(series, "farm_kernels_total", outcome=o))
            for o in ("compiled", "loaded", "failed")], t_max),
        panel(0, 40 + H, "Compile seconds (p50, p95)", [
            ("p50", quantile(series, "farm_compile_seconds", 0.5)),
            ("p95", quantile(series, "farm_compile_seconds", 0.95))], t_max, "s"),
        panel(W, 40 + H, "Store requests per second (minio tier); lease waits", [
            *[(r, rates(series, "farm_store_requests_total", result=r))
              for r in ("hit", "miss", "stored")],
            ("lease waits", rates(series, "farm_lease_wait_seconds_count"))], t_max),
    ]
    compiled = total(last, "farm_kernels_total", outcome="compiled")
    loaded = total(last, "farm_kernels_total", outcome="loaded")
    head = (f'<text x="8" y="26" class="h">kernel-farm</text><text x="130" y="26" class="a">'
            f'local cluster, 2 workers (PoCL): {compiled:.0f} kernels compiled, '
            f'{loaded:.0f} loaded, over {t_max:.0f} s of scrapes</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{40 + 2 * H}" '
            f'viewBox="0 0 {2 * W} {40 + 2 * H}">\n<style>.t{{font:600 13px sans-serif;'
            'fill:#d8d9da}.a{font:10px sans-serif;fill:#8e8e8e}.h{font:600 16px '
            'sans-serif;fill:#d8d9da}</style>\n'
            f'<rect width="100%" height="100%" fill="#111217"/>\n{head}\n'
            + "\n".join(panels) + "\n</svg>\n")


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "dashboard.svg")
