"""The PromQL of the Grafana dashboard, evaluated over scrapes taken here.

``scripts/dashboard_picture.py`` draws each panel from the expressions in the dashboard
file itself (helm/kernel-farm/dashboards/kernel-farm.json), parsed and evaluated by this
module, so the picture cannot drift from what Grafana shows. It covers the part of
PromQL the dashboard uses, and refuses the rest in one line naming the expression (a
new panel with another construct stops the drawing rather than being drawn wrong):

* selectors with label matchers (``=``, ``!=``, ``=~``, ``!~``), range selectors
  ``[4s]`` under ``rate``/``increase``;
* ``rate`` and ``increase`` (the increase over the window divided by the time the
  window's samples span: Prometheus's result without its extrapolation to the window's
  edges; a counter reset counts from zero), ``histogram_quantile`` (linear within the
  bucket holding the rank, as Prometheus), ``clamp_min``, ``label_replace``;
* ``sum``, ``max``, ``min``, ``avg``, ``count`` with ``by (...)`` or ``without (...)``;
* ``+ - * /`` between two vectors (one-to-one, on equal label sets) or a vector and a
  number, and the filters ``> >= < <= == !=`` against a number;
* the dashboard's variables: ``$fingerprint`` is its ``allValue`` (all), and
  ``$__rate_interval`` the window given to :func:`evaluate`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]
Sample = dict[tuple[str, Labels], float]
"""One scrape: (metric name, sorted labels) -> value."""
Series = list[tuple[float, Sample]]
"""Scrapes in time order: (seconds since the first, sample)."""
Vector = dict[Labels, float]


class PromQLError(ValueError):
    """An expression this evaluator does not read (or that is not PromQL)."""


# -- parsing -------------------------------------------------------------------------------
_TOKEN = re.compile(r"""\s*(?:
    (?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)
  | (?P<duration>\[\s*[^\]]+\])
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/(){}=,<>])
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
)""", re.X)
AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum, "max": max, "min": min, "count": len,
    "avg": lambda vs: sum(vs) / len(vs)}
FUNCTIONS = ("rate", "increase", "histogram_quantile", "clamp_min", "label_replace")
_PRECEDENCE = {"==": 1, "!=": 1, ">": 1, "<": 1, ">=": 1, "<=": 1, "+": 2, "-": 2,
               "*": 3, "/": 3}


@dataclass(frozen=True)
class Node:
    """A parsed expression: ``kind`` and its parts."""

    kind: str  # number, string, selector, call, aggregate, binary
    name: str = ""
    value: float = 0.0
    matchers: tuple[tuple[str, str, str], ...] = ()
    window: float | None = None
    args: tuple[Node, ...] = ()
    grouping: tuple[str, ...] = ()
    without: bool = False


def _tokens(text: str) -> list[tuple[str, str]]:
    found, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise PromQLError(f"cannot read {text[pos:pos + 20]!r} in {text!r}")
        kind = match.lastgroup
        assert kind is not None
        found.append((kind, match.group(kind)))
        pos = match.end()
    return found


def _seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text.strip())
    if match is None:
        raise PromQLError(f"a duration like 4s or 5m, not {text!r}")
    return float(match.group(1)) * units[match.group(2)]


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokens(text)
        self.pos = 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ("end", "")

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if value is not None and token[1] != value:
            raise PromQLError(f"expected {value!r}, found {token[1] or 'the end'!r} in "
                              f"{self.text!r}")
        self.pos += 1
        return token

    def expression(self, floor: int = 0) -> Node:
        left = self.unary()
        while True:
            kind, op = self.peek()
            if kind != "op" or op not in _PRECEDENCE or _PRECEDENCE[op] < floor:
                return left
            self.take()
            right = self.expression(_PRECEDENCE[op] + 1)
            left = Node("binary", name=op, args=(left, right))

    def unary(self) -> Node:
        kind, value = self.peek()
        if kind == "number":
            self.take()
            return Node("number", value=float(value))
        if kind == "string":
            self.take()
            return Node("string", name=value[1:-1].replace('\\"', '"'))
        if value == "(":
            self.take()
            inner = self.expression()
            self.take(")")
            return inner
        if kind != "name":
            raise PromQLError(f"unexpected {value or 'end'!r} in {self.text!r}")
        self.take()
        if value in AGGREGATIONS:
            return self.aggregate(value)
        if self.peek()[1] == "(":
            if value not in FUNCTIONS:
                raise PromQLError(f"function {value}() is not read here: {self.text!r}")
            self.take("(")
            args = [self.expression()]
            while self.peek()[1] == ",":
                self.take()
                args.append(self.expression())
            self.take(")")
            return Node("call", name=value, args=tuple(args))
        return self.selector(value)

    def aggregate(self, op: str) -> Node:
        grouping: tuple[str, ...] = ()
        without = False
        if self.peek()[1] in ("by", "without"):
            without = self.take()[1] == "without"
            grouping = self.labels()
        self.take("(")
        inner = self.expression()
        self.take(")")
        if self.peek()[1] in ("by", "without"):
            without = self.take()[1] == "without"
            grouping = self.labels()
        return Node("aggregate", name=op, args=(inner,), grouping=grouping, without=without)

    def labels(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            names.append(self.take()[1])
            if self.peek()[1] == ",":
                self.take()
        self.take(")")
        return tuple(names)

    def selector(self, name: str) -> Node:
        matchers = []
        if self.peek()[1] == "{":
            self.take()
            while self.peek()[1] != "}":
                label = self.take()[1]
                op = self.take()[1]
                if op not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"matcher {op!r} in {self.text!r}")
                kind, quoted = self.take()
                if kind != "string":
                    raise PromQLError(f"a quoted value after {label}{op} in {self.text!r}")
                matchers.append((label, op, quoted[1:-1].replace('\\"', '"')))
                if self.peek()[1] == ",":
                    self.take()
            self.take("}")
        window = None
        if self.peek()[0] == "duration":
            window = _seconds(self.take()[1][1:-1])
        return Node("selector", name=name, matchers=tuple(matchers), window=window)


def parse(expr: str, variables: dict[str, str]) -> Node:
    """The expression with the dashboard's ``$variables`` put in, parsed."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${name}", variables[name])
    if re.search(r"\$\{?[A-Za-z_]", expr):  # ($1 in label_replace is not a variable)
        raise PromQLError(f"a variable this evaluator does not know in {expr!r}")
    parser = _Parser(expr)
    node = parser.expression()
    if parser.peek()[0] != "end":
        raise PromQLError(f"unexpected {parser.peek()[1]!r} in {expr!r}")
    return node


# -- evaluation ----------------------------------------------------------------------------
def _matches(labels: dict[str, str], matchers: tuple[tuple[str, str, str], ...]) -> bool:
    for label, op, value in matchers:
        have = labels.get(label, "")
        ok = {"=": have == value, "!=": have != value,
              "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def _select(sample: Sample, node: Node) -> Vector:
    return {labels: value for (name, labels), value in sample.items()
            if name == node.name and _matches(dict(labels), node.matchers)}


def _increase(series: Series, i: int, node: Node) -> tuple[Vector, float]:
    """Each counter's increase over ``node.window`` ending at scrape ``i``, and the
    seconds the window's samples span (0 when it holds one sample)."""
    assert node.window is not None
    t = series[i][0]
    j = i
    while j > 0 and t - series[j - 1][0] <= node.window:
        j -= 1
    grown: Vector = defaultdict(float)
    for labels in _select(series[i][1], node):
        previous = None
        for k in range(j, i + 1):
            current = series[k][1].get((node.name, labels))
            if current is None:
                continue
            if previous is not None:
                grown[labels] += current - previous if current >= previous else current
            previous = current
        grown.setdefault(labels, 0.0)
    return dict(grown), t - series[j][0]


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over (upper bound, cumulative count) pairs."""
    buckets.sort()
    count = buckets[-1][1] if buckets else 0.0
    if count <= 0 or not math.isinf(buckets[-1][0]):
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = bound, cumulative
    return None


_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
_ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))}


def _at(series: Series, i: int, node: Node) -> Vector | float:
    """The value of ``node`` at scrape ``i``: a vector, or a number."""
    if node.kind == "number":
        return node.value
    if node.kind == "selector":
        if node.window is not None:
            raise PromQLError(f"a range of {node.name} outside rate()/increase()")
        return _select(series[i][1], node)
    if node.kind == "aggregate":
        inner = _vector(series, i, node.args[0])
        groups: dict[Labels, list[float]] = defaultdict(list)
        for labels, value in inner.items():
            kept = tuple((k, v) for k, v in labels if (k not in node.grouping) == node.without)
            groups[kept].append(value)
        return {labels: float(AGGREGATIONS[node.name](values))
                for labels, values in groups.items()}
    if node.kind == "call":
        return _call(series, i, node)
    left, right = (_at(series, i, arg) for arg in node.args)
    return _binary(node.name, left, right)


def _vector(series: Series, i: int, node: Node) -> Vector:
    value = _at(series, i, node)
    if not isinstance(value, dict):
        raise PromQLError("a number where a vector is needed")
    return value


def _call(series: Series, i: int, node: Node) -> Vector:
    if node.name in ("rate", "increase"):
        (arg,) = node.args
        if arg.kind != "selector" or arg.window is None:
            raise PromQLError(f"{node.name}() of a range selector, e.g. x[4s]")
        grown, span = _increase(series, i, arg)
        if span <= 0:  # one sample in the window: no rate yet, as in Prometheus
            return {}
        if node.name == "increase":
            return grown
        return {labels: value / span for labels, value in grown.items()}
    if node.name == "label_replace":
        return _label_replace(series, i, node)
    if node.name == "clamp_min":
        vector, floor = _vector(series, i, node.args[0]), _at(series, i, node.args[1])
        assert isinstance(floor, float)
        return {labels: max(value, floor) for labels, value in vector.items()}
    q, inner = _at(series, i, node.args[0]), _vector(series, i, node.args[1])
    assert isinstance(q, float)
    buckets: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, value in inner.items():
        label_map = dict(labels)
        bound = label_map.pop("le", None)
        if bound is None:
            continue
        buckets[tuple(sorted(label_map.items()))].append((float(bound), value))
    found = {labels: _quantile(q, pairs) for labels, pairs in buckets.items()}
    return {labels: value for labels, value in found.items() if value is not None}


def _label_replace(series: Series, i: int, node: Node) -> Vector:
    """``label_replace(v, dst, replacement, src, regex)``: where ``regex`` matches the
    whole of ``src``, ``dst`` becomes ``replacement`` with ``$1``... filled in."""
    vector = _vector(series, i, node.args[0])
    dst, replacement, src, regex = (_text(arg) for arg in node.args[1:])
    out: Vector = {}
    for labels, value in vector.items():
        label_map = dict(labels)
        match = re.fullmatch(regex, label_map.get(src, ""))
        if match is not None:
            made = _expand(replacement, ("", *match.groups()))
            if made:
                label_map[dst] = made
            else:
                label_map.pop(dst, None)
        out[tuple(sorted(label_map.items()))] = value
    return out


def _expand(replacement: str, groups: tuple[str | None, ...]) -> str:
    """``$1``/``${1}`` in ``replacement`` -> the regex's groups (a missing one: "")."""
    return re.sub(r"\$\{?(\d+)\}?", lambda m: groups[int(m.group(1))] or "", replacement)


def _text(node: Node) -> str:
    if node.kind != "string":
        raise PromQLError("label_replace takes quoted strings after the vector")
    return node.name


def _binary(op: str, left: Vector | float, right: Vector | float) -> Vector | float:
    if op in _COMPARE:
        if not isinstance(left, dict) or isinstance(right, dict):
            raise PromQLError(f"a filter is a vector {op} a number")
        return {labels: v for labels, v in left.items() if _COMPARE[op](v, right)}
    fn = _ARITHMETIC[op]
    if isinstance(left, dict) and isinstance(right, dict):
        out = {labels: fn(v, right[labels]) for labels, v in left.items() if labels in right}
        return {labels: v for labels, v in out.items() if not math.isnan(v)}
    if isinstance(left, dict):
        assert isinstance(right, float)
        return {labels: fn(v, right) for labels, v in left.items()}
    if isinstance(right, dict):
        return {labels: fn(left, v) for labels, v in right.items()}
    return fn(left, right)


def evaluate(expr: str, series: Series, *, rate_interval: float,
             variables: dict[str, str] | None = None) -> dict[Labels, list[tuple[float, float]]]:
    """``expr`` at every scrape of ``series``: labels -> [(seconds, value)], the way a
    Grafana time series panel gets it (a series has points where it has a value)."""
    known = {"__rate_interval": f"{rate_interval:g}s", **(variables or {})}
    node = parse(expr, known)
    out: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for i, (t, _) in enumerate(series):
        for labels, value in _vector(series, i, node).items():
            if math.isfinite(value):
                out[labels].append((t, value))
    return dict(out)


__all__ = ["Labels", "PromQLError", "Sample", "Series", "evaluate", "parse"]
