"""The rekey rule: when a key misses but its source is stored under another key.

The artifact is reused without running the compiler and kept under the new key too.
When the other key is of an earlier build of the same family (same family, another
build id) it is *moved*: that key can never be served again, since its family's code
changed, so keeping it would only leak space. Otherwise (a kernel of the current build,
or of another family, whose source happens to be identical) it is *copied*: the other
key is still valid.
"""

from __future__ import annotations

from enum import StrEnum

from farm.core.model import Key


class RekeyAction(StrEnum):
    COPY = "copy"
    MOVE = "move"


def rekey_action(found: Key, found_family: str, wanted: Key,
                 wanted_family: str) -> RekeyAction:
    """How to reuse the artifact of ``found_family`` stored under ``found`` for ``wanted``."""
    if found_family == wanted_family and found.build_id != wanted.build_id:
        return RekeyAction.MOVE
    return RekeyAction.COPY
