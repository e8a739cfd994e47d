"""The headers of stored program bodies and work-group function records, read with the
standard library.

A program's stored bytes are a body (:mod:`farm.programs.body`) and its work-group
functions travel in records (:mod:`farm.programs.supplements`); both are a magic, a
length, a JSON header and bytes, and both are read by their pydantic models in the
program server. A served application's quick path (:mod:`farm.programs.quick`) reads the
same bytes before anything of pydantic is imported (0.1 s of a fresh process), so the
formats' constants and patterns are here, once, and so is a reader of each header that
accepts **exactly** what the model accepts:

* it decides alone wherever the JSON holds the types the farm writes (a string where
  the model has a string, an integer where an integer, ``true``/``false`` where a bool,
  an array where a tuple): then every constraint (pattern, length, range, no other
  field) is the model's, checked the same way (patterns matched whole, as pydantic's
  engine does: a string ending in a newline does not match ``...$``);
* anything else (a number given as a string, ``1.0`` for ``1``, ``true`` for an integer,
  a string that is not valid Unicode, a recorded launch) it leaves to the model (pydantic
  coerces some of these, refuses others): :class:`Undecided`, and the caller asks the
  model (:func:`farm.programs.body.read_body`, :func:`farm.programs.supplements.decode`).

tests/test_headers.py holds both readers to the same answers on hostile headers.
"""

from __future__ import annotations

import json
import re
import struct
from collections import namedtuple

from farm.compilation.elfstub import MAX_FUNCTION_BYTES, exports
from farm.compilation.poclcache import FARM_NAMED, KERNEL
from farm.core.hashing import SHA256_HEX, sha256_hex

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

BODY_MAGIC = b"KFPROG01"
RECORD_MAGIC = b"KFWGSUP2"
LENGTH = struct.Struct(">I")
#: a body header's largest size: a log of 4 MiB (escaped in JSON up to six times) and names
MAX_BODY_HEADER = 32 * 1024 * 1024
#: a record header's largest size
MAX_RECORD_HEADER = 1024 * 1024
#: kernels one program may hold
MAX_KERNELS = 4096
#: a build log's characters at most
MAX_LOG = 4 * 1024 * 1024
#: functions one record holds at most; a harvest with more writes several records
MAX_FUNCTIONS = 256
#: bytes of functions one record holds at most
MAX_RECORD_BYTES = 64 * 1024 * 1024
#: a local size PoCL specialises for, per dimension, at most
MAX_LOCAL = 4096

PROGRAM_PATTERN = r"^[0-9a-f]{8,64}\.[0-9a-f]{8,64}$"
DEVICE_PATTERN = r"^[a-z0-9][a-z0-9-]{0,99}$"
KERNEL_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,1023}$"

_PROGRAM = re.compile(PROGRAM_PATTERN)
_DEVICE = re.compile(DEVICE_PATTERN)
_PROGRAM_KERNEL = re.compile(KERNEL_PATTERN)
_SHA256 = re.compile(SHA256_HEX)

#: a body read: the key and device it names, its kernels and log, the device binary
BodyView = namedtuple("BodyView", "program device kernels log binary")


class BodyError(ValueError):
    """Stored bytes that are not the body of the program and device being served."""


class SupplementError(ValueError):
    """A record that is not one the farm accepts (see :mod:`farm.programs.supplements`)."""


class StaleRecord(SupplementError):
    """A record of another binary of the same program."""


class Undecided(Exception):
    """A header whose JSON holds types the farm never writes: the model decides."""


def spec_name(local: tuple[int, int, int], zero_offset: bool, small_grid: bool) -> str:
    """PoCL's folder name of a work-group function's specialisation."""
    return (f"{local[0]}-{local[1]}-{local[2]}" + ("-goffs0" if zero_offset else "")
            + ("-smallgrid" if small_grid else ""))


# -- bodies ------------------------------------------------------------------------------------
def read_body(data: bytes, program: str, device: str) -> BodyView:
    """The body ``data`` holds, checked to be ``program``'s for ``device`` as
    :func:`farm.programs.body.read_body` checks it; :class:`BodyError` (one line) when
    it is not, :class:`Undecided` when the model must decide."""
    start = len(BODY_MAGIC) + LENGTH.size
    if not data.startswith(BODY_MAGIC) or len(data) < start:
        raise BodyError("not a program body (no 'KFPROG01' magic)")
    size = LENGTH.unpack_from(data, len(BODY_MAGIC))[0]
    if size > MAX_BODY_HEADER or start + size >= len(data):
        raise BodyError("the body's header runs past its end, or no binary follows it")
    try:
        header = json.loads(data[start:start + size])
    except (ValueError, RecursionError) as exc:
        raise BodyError(f"the body's header does not validate: {exc}"[:300]) from None
    why = _body_header(header)
    if why:
        raise BodyError(f"the body's header does not validate: {why}"[:300])
    if header["program"] != program:
        raise BodyError(f"the body is program {header['program'][:24]}'s, not "
                        f"{program[:24]}'s")
    if header["device"] != device:
        raise BodyError(f"the body was built for device {header['device']}, not {device}")
    kernels = tuple(header.get("kernels", ()))
    if len(set(kernels)) != len(kernels):
        raise BodyError("the body names a kernel twice")
    return BodyView(header["program"], header["device"], kernels, header.get("log", ""),
                    data[start + size:])


def _body_header(header: object) -> str:
    """Why ``header`` is not a body header the model accepts ("" when it is);
    :class:`Undecided` where the model must say."""
    why = _fields(header, required=("program", "device"),
                  optional=("format", "kernels", "log"))
    if why:
        return why
    fields: dict[str, Any] = header  # type: ignore[assignment]  # _fields: an object
    why = _exact(fields.get("format", 1), 1, "format") or _text(
        fields["program"], "program", _PROGRAM) or _text(fields["device"], "device", _DEVICE)
    if why:
        return why
    kernels = fields.get("kernels", [])
    if type(kernels) is not list:
        raise Undecided("kernels")
    if len(kernels) > MAX_KERNELS:
        return "kernels: too many"
    for i, kernel in enumerate(kernels):
        why = _text(kernel, f"kernels.{i}", _PROGRAM_KERNEL)
        if why:
            return why
    log = fields.get("log", "")
    why = _text(log, "log", None)
    if not why and len(log) > MAX_LOG:
        why = "log: too long"
    return why


# -- records ---------------------------------------------------------------------------------
def read_record(data: bytes, program: str, base: str, device: str, kernels: frozenset[str]
                ) -> dict[tuple[str, str], bytes]:
    """The functions of a record, checked as :func:`farm.programs.supplements.decode`
    checks them (same order, same outcome); :class:`SupplementError` for one refused,
    :class:`StaleRecord` for one of another binary, :class:`Undecided` where the model
    must decide (a recorded launch among them)."""
    if not data.startswith(RECORD_MAGIC) or len(data) < len(RECORD_MAGIC) + LENGTH.size:
        raise SupplementError("not a work-group function record of this format")
    size = LENGTH.unpack_from(data, len(RECORD_MAGIC))[0]
    start = len(RECORD_MAGIC) + LENGTH.size
    if size > MAX_RECORD_HEADER or start + size > len(data):
        raise SupplementError("record header runs past the record")
    try:
        header = json.loads(data[start:start + size])
    except (ValueError, RecursionError) as exc:
        raise SupplementError(f"record header does not validate: {exc}"[:200]) from None
    functions = _record_header(header)
    if header["program"] != program:
        raise SupplementError("record of another program")
    if header["base"] != base:
        raise StaleRecord(f"record of binary {header['base']}, not {base}")
    if header["device"] != device:
        raise SupplementError(f"record made on device {header['device']}, not {device}")
    out: dict[tuple[str, str], bytes] = {}
    at = start + size
    for kernel, spec, fn_size, digest in functions:
        body = data[at:at + fn_size]
        at += fn_size
        if len(body) != fn_size or sha256_hex(body) != digest:
            raise SupplementError(f"{kernel}/{spec}: bytes disagree with the header")
        if kernel not in kernels:
            raise SupplementError(f"{kernel}: no such kernel in the program")
        if (kernel, spec) in out:
            raise SupplementError(f"{kernel}/{spec}: twice in the record")
        if not exports(body, kernel):
            raise SupplementError(f"{kernel}/{spec}: not a work-group function of this host")
        out[(kernel, spec)] = body
    if at != len(data):
        raise SupplementError("bytes after the last function")
    return out


def _record_header(header: object) -> list[tuple[str, str, int, str]]:
    """(kernel, specialisation, size, SHA-256) of each function of a record header the
    model accepts; :class:`SupplementError` when it refuses it, :class:`Undecided` where
    it must say."""
    why = _fields(header, required=("program", "base", "device", "functions"),
                  optional=("format",))
    if why:
        raise SupplementError(f"record header does not validate: {why}"[:200])
    fields: dict[str, Any] = header  # type: ignore[assignment]  # _fields: an object
    why = (_exact(fields.get("format", 2), 2, "format")
           or _text(fields["program"], "program", _PROGRAM)
           or _text(fields["base"], "base", FARM_NAMED)
           or _text(fields["device"], "device", _DEVICE))
    functions = fields["functions"]
    if not why and type(functions) is not list:
        raise Undecided("functions")
    if not why and not 1 <= len(functions) <= MAX_FUNCTIONS:
        why = "functions: between 1 and 256"
    out = []
    for i, fn in enumerate(functions if not why else ()):
        got = _function(fn, f"functions.{i}")
        if isinstance(got, str):
            why = got
            break
        out.append(got)
    if why:
        raise SupplementError(f"record header does not validate: {why}"[:200])
    return out


def _function(fn: object, where: str) -> tuple[str, str, int, str] | str:
    why = _fields(fn, required=("kernel", "local_size", "zero_offset", "small_grid",
                                "size", "sha256"), optional=("launch",))
    if why:
        return f"{where}: {why}"
    fields: dict[str, Any] = fn  # type: ignore[assignment]  # _fields: an object
    if fields.get("launch") is not None:
        raise Undecided("a recorded launch")
    why = (_text(fields["kernel"], f"{where}.kernel", KERNEL)
           or _text(fields["sha256"], f"{where}.sha256", _SHA256)
           or _integer(fields["size"], f"{where}.size", 1, MAX_FUNCTION_BYTES))
    local = fields["local_size"]
    if why:
        return why
    if type(local) is not list:
        raise Undecided(f"{where}.local_size")
    if len(local) != 3:
        return f"{where}.local_size: three sizes"
    for i, n in enumerate(local):
        why = _integer(n, f"{where}.local_size.{i}", 1, MAX_LOCAL)
        if why:
            return why
    for name in ("zero_offset", "small_grid"):
        if type(fields[name]) is not bool:
            raise Undecided(f"{where}.{name}")
    return (fields["kernel"], spec_name((local[0], local[1], local[2]), fields["zero_offset"],
                                        fields["small_grid"]), fields["size"], fields["sha256"])


# -- the model's rules, on the types the farm writes -----------------------------------------
def _fields(value: object, required: tuple[str, ...], optional: tuple[str, ...]) -> str:
    """Why ``value`` is not an object of exactly these fields ("" when it is): the model
    refuses anything but an object, a field missing, a field it does not have."""
    if type(value) is not dict:
        return "not an object"
    missing = [f for f in required if f not in value]
    if missing:
        return f"{missing[0]}: missing"
    extra = sorted(value.keys() - {*required, *optional})
    return f"{extra[0][:40]}: not a field" if extra else ""


def _exact(value: object, expected: int, where: str) -> str:
    """Why ``value`` is not the literal ``expected`` ("" when it is); :class:`Undecided`
    for a value that is not an integer (the model takes ``true`` or ``1.0`` for 1)."""
    if type(value) is not int:
        raise Undecided(where)
    return "" if value == expected else f"{where}: not {expected}"


def _text(value: object, where: str, pattern: re.Pattern[str] | None) -> str:
    """Why the string ``value`` breaks ``pattern`` (matched whole) ("" when it does not);
    :class:`Undecided` for a value that is not a string of valid Unicode."""
    if type(value) is not str or not (value.isascii() or _encodes(value)):
        raise Undecided(where)
    if pattern is not None and not pattern.fullmatch(value):
        return f"{where}: does not match {pattern.pattern}"
    return ""


def _encodes(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\\ud800")
        return False
    return True


def _integer(value: object, where: str, low: int, high: int) -> str:
    if type(value) is not int:
        raise Undecided(where)
    return "" if low <= value <= high else f"{where}: not in {low}..{high}"
