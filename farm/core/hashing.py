"""Stable hashes: the same bytes on every machine, process and Python version.

Why not ``hash()``: it is salted per process. Why canonical JSON: dict order, float
formatting and whitespace must not change a key. SHA-256 is the one hash function.
"""

from __future__ import annotations

import hashlib
import json

#: a 64-digit lowercase hex SHA-256 (source hashes, digests)
SHA256_HEX = r"^[0-9a-f]{64}$"


def canonical_json(value: object) -> str:
    """Serialize ``value`` to JSON with sorted keys and no insignificant whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def sha256_hex(data: bytes | str) -> str:
    """Hex SHA-256 of bytes or of a UTF-8 string."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def stable_hash(value: object, length: int = 32) -> str:
    """Hash of the canonical JSON of ``value``, truncated to ``length`` hex digits."""
    return sha256_hex(canonical_json(value))[:length]
