"""Reading a manifest file (bounded; one-line errors naming file, line and field), and
finding a built-in manifest by name."""

from __future__ import annotations

import difflib
import re
import stat
import tomllib
from pathlib import Path

from pydantic import ValidationError

from farm.core.errors import ManifestError, every_error
from farm.manifest.expand import _plan
from farm.manifest.lines import _LineIndex
from farm.manifest.messages import _allowed_keys, _clean_loc, _error, _format_loc, _one_line
from farm.manifest.schema import FORMAT_VERSION, MAX_FILE_BYTES, Manifest
from farm.manifests import builtin_manifests


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------
def load_manifest(path: Path) -> Manifest:
    """Read, parse and validate a manifest file.

    Raises :class:`ManifestError` (one line naming the file, the line and the field) for
    anything wrong with the file: unreadable, not a file, too large, not UTF-8, binary,
    empty, bad TOML, a field of the wrong type or range, an unknown key, or a model whose
    expansion would exceed :data:`MAX_KERNELS`.
    """
    path = Path(path)
    shown = str(path)
    text = _read_text(path, shown)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, what = _toml_position(str(exc), text)
        raise _error(shown, line, "", f"TOML syntax error: {what}") from None
    except RecursionError:
        raise _error(shown, None, "", "TOML nesting too deep") from None
    except ValueError as exc:  # tomllib's int() of a number of more than 4300 digits
        raise _error(shown, None, "", f"TOML value out of range ({_one_line(str(exc))[:120]})"
                     ) from None
    if not data:
        raise _error(shown, None, "", "no keys (only comments or blank lines); a manifest "
                     f"needs format = {FORMAT_VERSION} and a [model] table or [[kernels]] "
                     "entries")
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, shown, _LineIndex(text)) from None
    manifest._source = shown
    manifest._text = text
    for _ in _plan(manifest):  # refuses a runaway expansion now, not in the middle of a build
        pass
    return manifest


def _read_text(path: Path, shown: str) -> str:
    """The file's text, refusing what is not a manifest before reading much of it."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise _error(shown, None, "", "no such file") from None
    except OSError as exc:
        raise _error(shown, None, "", f"cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise _error(shown, None, "", "is a directory, not a manifest file")
    if not stat.S_ISREG(info.st_mode):
        raise _error(shown, None, "", "not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise _error(shown, None, "", f"{info.st_size} bytes; a manifest may have at most "
                     f"{MAX_FILE_BYTES} bytes (16 MiB)")
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise _error(shown, None, "", f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:  # grew since stat
        raise _error(shown, None, "", f"a manifest may have at most {MAX_FILE_BYTES} bytes")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise _error(shown, raw.count(b"\n", 0, nul) + 1, "",
                     "binary data (a NUL byte), not a TOML text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _error(shown, raw.count(b"\n", 0, exc.start) + 1, "",
                     f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
                     ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise _error(shown, None, "", "empty file; a manifest needs format = "
                     f"{FORMAT_VERSION} and a [model] table or [[kernels]] entries")
    return text


_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_TOML_END = re.compile(r"\s*\(at end of document\)\s*$")


def _toml_position(message: str, text: str) -> tuple[int | None, str]:
    """Split tomllib's message into (line, message with the column kept)."""
    match = _TOML_AT.search(message)
    if match:
        return int(match[1]), f"{message[:match.start()]} (column {match[2]})"
    match = _TOML_END.search(message)
    if match:
        return text.count("\n") + (0 if text.endswith("\n") else 1) or 1, \
            f"{message[:match.start()]} (at end of file: truncated?)"
    return None, message


def _validation_error(exc: ValidationError, shown: str, lines: _LineIndex) -> ManifestError:
    """Every error of the manifest's shape, each at its own line and field."""
    problems: list[tuple[int, str]] = []
    for err, (_, why) in zip(exc.errors(include_url=False), every_error(exc), strict=True):
        loc = _clean_loc(err["loc"])
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            why = "unknown key" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
        problems.append((lines.line_of(loc) or 0,
                         str(_error(shown, lines.line_of(loc), _format_loc(loc), why))))
    ordered = [text for _, text in sorted(problems, key=lambda p: p[0])]  # as the file reads
    return ManifestError(_summary(ordered), ordered)


def _summary(problems: list[str]) -> str:
    """The first problem, and how many more there are (the message of one exception)."""
    more = len(problems) - 1
    return problems[0] + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")


# ----------------------------------------------------------------------------------------
# Built-in manifests
# ----------------------------------------------------------------------------------------
def resolve_manifest(name_or_path: str) -> Path:
    """A path when one exists, else the built-in manifest of that name.

    A path wins so that a file the user wrote is never shadowed by a built-in of the same
    name; a built-in is named without ``.toml`` (``tiny``) or with it.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    builtins = builtin_manifests()
    name = name_or_path.removesuffix(".toml")
    if name in builtins and "/" not in name_or_path and "\\" not in name_or_path:
        return builtins[name]
    names = ", ".join(builtins) or "none installed"
    close = difflib.get_close_matches(name, list(builtins), n=1)
    guess = f": did you mean {close[0]}?" if close else ""
    raise ManifestError(_one_line(f"{name_or_path}: no such file, and no built-in manifest "
                                  f"of that name{guess} (built-in: {names})"))
