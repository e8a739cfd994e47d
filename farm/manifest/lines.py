"""Where a field is in a TOML text: a small line scanner, so that an error can name the
line."""

from __future__ import annotations

import bisect
import re

#: where a value is in a manifest: the path of keys and list indices to it
Loc = tuple[str | int, ...]

# ----------------------------------------------------------------------------------------
# Line numbers for valid TOML
# ----------------------------------------------------------------------------------------
class _LineIndex:
    """The line where each table, key and array element of a TOML text starts.

    tomllib gives positions only for syntax errors. A validation error names a path
    (``kernels[3].params.op``); this index finds its line. The text has already parsed,
    so the scanner can assume valid TOML; it never raises, and a path it did not record
    falls back to its nearest recorded ancestor (a missing key: its table's header).
    Arrays of tables count from 0 like pydantic's locations.
    """

    def __init__(self, text: str = "") -> None:
        self._lines: dict[Loc, int] = {}
        self._aot: dict[Loc, int] = {}
        self._text = text
        self._pos = 0
        self._newlines = [i for i, c in enumerate(text) if c == "\n"]
        try:
            self._scan()
        except (ValueError, IndexError, RecursionError):
            pass  # keep what was found; callers fall back to ancestors
        self._text = ""
        self._newlines = []

    def line_of(self, loc: Loc) -> int | None:
        """The line of ``loc`` or of its nearest recorded ancestor."""
        for n in range(len(loc), 0, -1):
            line = self._lines.get(tuple(loc[:n]))
            if line is not None:
                return line
        return None

    # -- scanning ---------------------------------------------------------------------
    def _line(self) -> int:
        return bisect.bisect_left(self._newlines, self._pos) + 1

    def _mark(self, path: Loc) -> None:
        for n in range(1, len(path) + 1):
            self._lines.setdefault(path[:n], self._line())

    def _skip(self, newlines: bool) -> None:
        """Skip blanks and comments (and line ends, when ``newlines``)."""
        t = self._text
        while self._pos < len(t):
            c = t[self._pos]
            if c in " \t" or (newlines and c in "\r\n"):
                self._pos += 1
            elif c == "#":
                end = t.find("\n", self._pos)
                self._pos = len(t) if end < 0 else end
            else:
                return

    def _expect(self, token: str) -> None:
        self._skip(newlines=False)
        if not self._text.startswith(token, self._pos):
            raise ValueError(f"expected {token!r}")
        self._pos += len(token)

    def _scan(self) -> None:
        t = self._text
        table: Loc = ()
        while True:
            self._skip(newlines=True)
            if self._pos >= len(t):
                return
            if t.startswith("[[", self._pos):
                self._pos += 2
                base = self._resolve(self._key())
                self._expect("]]")
                index = self._aot.get(base, 0)
                self._aot[base] = index + 1
                table = (*base, index)
                self._mark(table)
            elif t[self._pos] == "[":
                self._pos += 1
                table = self._resolve(self._key())
                self._expect("]")
                self._mark(table)
            else:
                path = (*table, *self._key())
                self._mark(path)
                self._expect("=")
                self._value(path)

    def _resolve(self, parts: list[str]) -> Loc:
        """A header's path, with the current index of each array of tables in it."""
        out: list[str | int] = []
        for i, part in enumerate(parts):
            out.append(part)
            if i < len(parts) - 1 and tuple(out) in self._aot:
                out.append(self._aot[tuple(out)] - 1)
        return tuple(out)

    def _key(self) -> list[str]:
        t = self._text
        parts: list[str] = []
        while True:
            self._skip(newlines=False)
            c = t[self._pos]
            if c == '"':
                start = self._pos + 1
                self._string('"')
                parts.append(t[start:self._pos - 1])
            elif c == "'":
                end = t.index("'", self._pos + 1)
                parts.append(t[self._pos + 1:end])
                self._pos = end + 1
            else:
                match = re.compile(r"[A-Za-z0-9_-]+").match(t, self._pos)
                if not match:
                    raise ValueError("expected a key")
                parts.append(match[0])
                self._pos = match.end()
            self._skip(newlines=False)
            if t.startswith(".", self._pos):
                self._pos += 1
                continue
            return parts

    def _string(self, quote: str) -> None:
        """Skip a one-line string whose opening quote is at the cursor."""
        t = self._text
        self._pos += 1
        while t[self._pos] != quote:
            self._pos += 2 if quote == '"' and t[self._pos] == "\\" else 1
        self._pos += 1

    def _long_string(self, quote: str) -> None:
        t = self._text
        self._pos += 3
        while not t.startswith(quote * 3, self._pos):
            self._pos += 2 if quote == '"' and t[self._pos] == "\\" else 1
        self._pos += 3
        for _ in range(2):  # up to two quotes may end the content
            if t.startswith(quote, self._pos):
                self._pos += 1

    def _value(self, path: Loc) -> None:
        t = self._text
        self._skip(newlines=False)
        c = t[self._pos]
        if c == "{":
            self._pos += 1
            while True:
                self._skip(newlines=True)
                if t[self._pos] == "}":
                    self._pos += 1
                    return
                sub = (*path, *self._key())
                self._mark(sub)
                self._expect("=")
                self._value(sub)
                self._skip(newlines=True)
                if t[self._pos] == ",":
                    self._pos += 1
        elif c == "[":
            self._pos += 1
            index = 0
            while True:
                self._skip(newlines=True)
                if t[self._pos] == "]":
                    self._pos += 1
                    return
                self._mark((*path, index))
                self._value((*path, index))
                self._skip(newlines=True)
                if t[self._pos] == ",":
                    self._pos += 1
                    index += 1
        elif t.startswith('"""', self._pos) or t.startswith("'''", self._pos):
            self._long_string(c)
        elif c in "\"'":
            self._string(c)
        else:
            start = self._pos
            while self._pos < len(t) and t[self._pos] not in ",]}\r\n#":
                self._pos += 1
            if self._pos == start:
                raise ValueError("expected a value")
