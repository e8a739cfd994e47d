"""What a tuning run reports: the ``--json`` document, the figures of the table, the
geometric-mean speedup.

The JSON has exactly these keys (docs/TUNING.md)::

    {"fingerprint", "timed", "reused",
     "keys": [{"family", "problem", "winner", "winner_ms", "first_ms",
               "candidates": [{"params", "ms", "spread", "status"}]}]}

``problem`` and each candidate's ``params`` are parameter mappings (a candidate's: its
tuning parameters), ``winner`` the winner's tuning parameters (``null`` when no
candidate was right), times are medians in milliseconds, ``spread`` the interquartile
range over the median. ``timed`` counts the keys measured by this run, ``reused`` those
whose result the store held.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from farm.tuning.keys import Params, TuningSpec
from farm.tuning.runner import TuneOutcome


def key_json(outcome: TuneOutcome) -> dict[str, Any]:
    spec, result = outcome.spec, outcome.result
    won = result.winner_figures if result is not None else None
    return {
        "family": spec.family,
        "problem": spec.problem,
        "winner": won.params if won is not None else None,
        "winner_ms": won.ms if won is not None else None,
        "first_ms": result.first.ms if result is not None else None,
        "candidates": [{"params": f.params, "ms": f.ms, "spread": f.spread,
                        "status": f.status}
                       for f in (result.candidates if result is not None else ())],
    }


def document(fingerprint: str, outcomes: Sequence[TuneOutcome]) -> dict[str, Any]:
    """The ``--json`` document of a run."""
    return {"fingerprint": fingerprint,
            "timed": sum(1 for o in outcomes if o.result is not None and not o.reused),
            "reused": sum(1 for o in outcomes if o.reused),
            "keys": [key_json(o) for o in outcomes]}


def geomean(values: Iterable[float]) -> float | None:
    """The geometric mean of positive ``values``; ``None`` for none."""
    logs = [math.log(v) for v in values if v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def speedups(outcomes: Iterable[TuneOutcome]) -> list[float]:
    """Each key's first-listed time over its winner's, where both have one."""
    found = (o.result.speedup for o in outcomes if o.result is not None)
    return [s for s in found if s is not None]


def short_problem(spec: TuningSpec) -> str:
    """The problem in a table cell: values, named where they are numbers
    (``m=1024 n=32000 k=512 float``)."""
    parts = [str(v) if isinstance(v, str) else f"{k}={v}" for k, v in spec.problem.items()]
    if spec.launch.local_size is not None:
        parts.append(f"local={'x'.join(map(str, spec.launch.local_size))}")
    if spec.variant.options:
        parts.append(" ".join(spec.variant.options))
    return " ".join(parts)


def short_params(params: Params, names: Sequence[str]) -> str:
    """A candidate's tuning parameters as values in ``names`` order: ``64/128/8/4/8``."""
    return "/".join(str(params.get(n, "-")) for n in names)
