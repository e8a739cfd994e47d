"""The rekey rule: when a key misses but its source is stored under another key.

The artifact is reused without running the compiler and kept under the new key too.
When the other key is the same kernel of an earlier build (same id hash, another build
id) it is *moved*: the old key can never be served again, since its family's code
changed, so keeping it would only leak space. Otherwise (another kernel whose source
happens to be identical) it is *copied*: the other key is still valid.
"""

from __future__ import annotations

from enum import StrEnum

from farm.model import Key


class RekeyAction(StrEnum):
    COPY = "copy"
    MOVE = "move"


def rekey_action(found: Key, wanted: Key) -> RekeyAction:
    """How to reuse the artifact stored under ``found`` for ``wanted``."""
    if found.id_hash == wanted.id_hash and found.build_id != wanted.build_id:
        return RekeyAction.MOVE
    return RekeyAction.COPY
