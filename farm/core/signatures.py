"""What an artifact's signature covers and how one is checked, with the standard library
(and ``cryptography`` where a key is used).

:mod:`farm.store.signing` signs and verifies artifacts for every store the settings open;
a served application's quick path (:mod:`farm.programs.rows`) verifies the same
signatures before anything of pydantic is imported. Both use what is here, so a
signature means one thing everywhere: version 2 (``v2:<base64>``) over the canonical JSON
of the namespace, key, family, digest and size (:func:`signed_message`).
"""

from __future__ import annotations

import base64
import binascii

from farm.core.hashing import canonical_json

#: prefix of a version 2 signature (over :func:`signed_message`, namespace included); a
#: signature without it is version 1
SIGNATURE_V2 = "v2:"


def signed_message(namespace: str, key: str, family: str, digest: str, size: int) -> bytes:
    """What a version 2 signature covers: the namespace binds the device, the key which
    kernel the binary may be served as, the digest and size the binary itself."""
    return canonical_json({"v": 2, "namespace": namespace, "key": key, "family": family,
                           "digest": digest, "size": size}).encode()


def raw_key(text: str) -> bytes:
    """The 32 raw bytes of a base64 Ed25519 key; ``ValueError`` for anything else."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 key is 32 bytes, not {len(raw)}")
    return raw


def public_of(private: bytes) -> bytes:
    """The raw public key of a raw Ed25519 private key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes(
        Encoding.Raw, PublicFormat.Raw)


def valid(public: bytes, signature_b64: str, message: bytes) -> bool:
    """Whether ``signature_b64`` (base64, no version prefix) is ``public``'s signature
    of ``message``."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public).verify(
            base64.b64decode(signature_b64, validate=True), message)
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True
