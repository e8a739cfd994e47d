"""Signed artifacts: writers sign, loaders refuse what is unsigned or wrongly signed.

Optional, and configuration only: ``FARM_SIGNING_KEY`` (an Ed25519 private key, base64;
only writers — workers, build clients — have it) makes every stored artifact signed;
``FARM_VERIFY_KEY`` (the public key, base64) makes every read refuse an artifact whose
signature does not verify. A writer verifies with its own public key too.

Why Ed25519 and not an HMAC: with an HMAC every loader that can verify could also sign.
A signature covers :meth:`ArtifactMeta.signed_bytes` (key, family, digest, size), so it
binds the binary and the key it may be served under.

The rule lives in one wrapper, :class:`SigningStore`, around whatever store the settings
open: a refused signature is a miss, counted in ``stats.unsigned``, repaired by the next
writer that stores the kernel again.
"""

from __future__ import annotations

import base64
import binascii
import logging

from farm.core.errors import SettingsError
from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactMeta, Key, Lowered
from farm.core.settings import Settings
from farm.store.base import ArtifactStore, PutResult, WrappedStore

log = logging.getLogger(__name__)


# cryptography is imported where a key is made or used: a process that neither signs
# nor verifies (most of them) does not pay for importing it.


def generate_keypair() -> tuple[str, str]:
    """(private key, public key), both base64 of their 32 raw bytes."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    private = Ed25519PrivateKey.generate()
    raw_private = private.private_bytes_raw()
    raw_public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw_private).decode(), base64.b64encode(raw_public).decode()


def _raw(text: str, setting: str) -> bytes:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SettingsError(f"setting {setting}: not base64") from None
    if len(raw) != 32:
        raise SettingsError(f"setting {setting}: an Ed25519 key is 32 bytes, not {len(raw)}")
    return raw


class Signer:
    def __init__(self, private_b64: str) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self._key = Ed25519PrivateKey.from_private_bytes(_raw(private_b64, "FARM_SIGNING_KEY"))

    def sign(self, meta: ArtifactMeta) -> ArtifactMeta:
        signature = base64.b64encode(self._key.sign(meta.signed_bytes())).decode()
        return meta.model_copy(update={"signature": signature})

    def verifier(self) -> Verifier:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        raw = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return Verifier(base64.b64encode(raw).decode())


class Verifier:
    def __init__(self, public_b64: str) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        self._key = Ed25519PublicKey.from_public_bytes(_raw(public_b64, "FARM_VERIFY_KEY"))

    def verify(self, meta: ArtifactMeta) -> bool:
        from cryptography.exceptions import InvalidSignature

        if not meta.signature:
            return False
        try:
            self._key.verify(base64.b64decode(meta.signature), meta.signed_bytes())
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True


class SigningStore(WrappedStore):
    """Signs what goes in (with a signer) and refuses what fails (with a verifier)."""

    def __init__(self, inner: ArtifactStore, signer: Signer | None,
                 verifier: Verifier | None) -> None:
        super().__init__(inner)
        self.signer = signer
        self.verifier = verifier

    def _trusted(self, ns: Namespace, art: Artifact | None) -> Artifact | None:
        if art is None or self.verifier is None or self.verifier.verify(art.meta):
            return art
        self.stats.bump("unsigned")
        log.warning("store %s: artifact %s/%s is unsigned or wrongly signed; refused",
                    self.location, ns, art.meta.key)
        return None

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        return self._trusted(ns, self.inner.get(ns, key))

    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        if self.signer is None:
            return self.inner.put(ns, artifact, source=source)
        artifact = Artifact(meta=self.signer.sign(artifact.meta), binary=artifact.binary)
        result = self.inner.put(ns, artifact, source=source)
        if result is PutResult.STORED or self.verifier is None:
            return result
        # Something was there already (the same binary, or another): keep it only if it
        # is trusted; an unsigned or foreign-signed entry is replaced. Checked only here,
        # so the common path (a new key) costs no extra read.
        held = self.inner.get(ns, artifact.meta.key)
        if held is not None and self.verifier.verify(held.meta):
            return result
        self.inner.delete(ns, artifact.meta.key)
        return self.inner.put(ns, artifact, source=source)


def with_signatures(store: ArtifactStore, settings: Settings) -> ArtifactStore:
    """``store`` wrapped by the signing rules the settings ask for (or as it is)."""
    signer = Signer(settings.signing_key.get_secret_value()) if settings.signing_key else None
    verifier = Verifier(settings.verify_key) if settings.verify_key else (
        signer.verifier() if signer else None)
    if signer is None and verifier is None:
        return store
    return SigningStore(store, signer, verifier)
