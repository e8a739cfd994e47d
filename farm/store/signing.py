"""Signed artifacts: writers sign, loaders refuse what is unsigned or wrongly signed.

Optional, and configuration only: ``FARM_SIGNING_KEY`` (an Ed25519 private key, base64;
only writers — workers, build clients — have it) makes every stored artifact signed;
``FARM_VERIFY_KEY`` (the public key, base64) makes every read refuse an artifact whose
signature does not verify. A writer verifies with its own public key too.

Why Ed25519 and not an HMAC: with an HMAC every loader that can verify could also sign.
A signature covers :meth:`ArtifactMeta.signed_bytes`: the namespace, key, family, digest
and size, so it binds the binary, the kernel it may be served as, and the device (the
fingerprint in the namespace) it may be served to. A signature is stored as
``v2:<base64>``. A bare base64 signature is version 1 (a farm before issue 19), which
covered the key, family, digest and size but not the namespace: such a signature keeps
that meaning, is recognised, and is refused by name ("signed without its namespace"),
since it cannot say which device the binary is for; a writer holding the key replaces
it the next time it stores the kernel, as it replaces any untrusted entry.

The rule lives in one wrapper, :class:`SigningStore`, around whatever store the settings
open: a refused signature is a miss, counted in ``stats.unsigned``, repaired by the next
writer that stores the kernel again.
"""

from __future__ import annotations

import base64
import logging

from farm.core.errors import SettingsError
from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactMeta, Key, Lowered
from farm.core.settings import Settings
from farm.core.signatures import SIGNATURE_V2, raw_key, valid
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
        return raw_key(text)
    except ValueError as exc:
        raise SettingsError(f"setting {setting}: {exc}") from None


class Signer:
    def __init__(self, private_b64: str) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self._key = Ed25519PrivateKey.from_private_bytes(_raw(private_b64, "FARM_SIGNING_KEY"))

    def sign(self, meta: ArtifactMeta, ns: Namespace) -> ArtifactMeta:
        """``meta`` with its version 2 signature for namespace ``ns``."""
        raw = self._key.sign(meta.signed_bytes(str(ns)))
        return meta.model_copy(update={"signature": SIGNATURE_V2 + base64.b64encode(raw).decode()})

    def verifier(self) -> Verifier:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        raw = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return Verifier(base64.b64encode(raw).decode())


class Verifier:
    def __init__(self, public_b64: str) -> None:
        self._key = _raw(public_b64, "FARM_VERIFY_KEY")

    def verify(self, meta: ArtifactMeta, ns: Namespace) -> bool:
        """Whether ``meta`` carries this key's version 2 signature for namespace ``ns``."""
        return self.check(meta, ns) == ""

    def check(self, meta: ArtifactMeta, ns: Namespace) -> str:
        """"" when ``meta`` is signed by this key for ``ns``, else why not (for the log)."""
        if not meta.signature:
            return "unsigned"
        if meta.signature.startswith(SIGNATURE_V2):
            if self._valid(meta.signature[len(SIGNATURE_V2):], meta.signed_bytes(str(ns))):
                return ""
            return "wrongly signed (another key, another namespace, or altered)"
        if self._valid(meta.signature, meta.signed_bytes_v1()):
            return ("signed without its namespace (a version 1 signature, which does not "
                    "say which device the binary is for)")
        return "wrongly signed"

    def _valid(self, text: str, message: bytes) -> bool:
        return valid(self._key, text, message)


class SigningStore(WrappedStore):
    """Signs what goes in (with a signer) and refuses what fails (with a verifier)."""

    #: refusals said (namespace, key, why) kept to say each once (a cluster build reads
    #: a refused key before sending it and again once a worker answered for it)
    TOLD_MAX = 4096

    def __init__(self, inner: ArtifactStore, signer: Signer | None,
                 verifier: Verifier | None) -> None:
        super().__init__(inner)
        self.signer = signer
        self.verifier = verifier
        self._told: set[tuple[str, Key, str]] = set()

    def _trusted(self, ns: Namespace, art: Artifact | None) -> Artifact | None:
        if art is None or self.verifier is None:
            return art
        why = self.verifier.check(art.meta, ns)
        if not why:
            return art
        self.stats.bump("unsigned")
        told = (str(ns), art.meta.key, why)
        if told not in self._told:  # said once per process, as every refusal is
            if len(self._told) < self.TOLD_MAX:
                self._told.add(told)
            log.warning("store %s: artifact %s/%s is %s; refused", self.location, ns,
                        art.meta.key, why)
        return None

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        return self._trusted(ns, self.inner.get(ns, key))

    def reading(self, inner: ArtifactStore) -> SigningStore:
        """This store's verifier in front of ``inner`` (e.g. a tiered store's shared
        tier), for reads only: it signs nothing."""
        return SigningStore(inner, None, self.verifier)

    def refusal(self, ns: Namespace, key: Key) -> str:
        """Why :meth:`get` gives nothing for ``key``: the verifier's reason for the
        artifact stored there, else "not in the store, or damaged" (the inner store
        said so when it read it). "" when it is there and trusted. For a caller's
        message after a refused read; it reads the artifact again."""
        art = self.inner.get(ns, key)
        if art is None:
            return "not in the store, or damaged"
        return self.verifier.check(art.meta, ns) if self.verifier is not None else ""

    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        if self.signer is None:
            return self.inner.put(ns, artifact, source=source)
        artifact = Artifact(meta=self.signer.sign(artifact.meta, ns), binary=artifact.binary)
        result = self.inner.put(ns, artifact, source=source)
        if result is PutResult.STORED or self.verifier is None:
            return result
        # Something was there already (the same binary, or another): keep it only if it
        # is trusted; an unsigned or foreign-signed entry is replaced. Checked only here,
        # so the common path (a new key) costs no extra read.
        held = self.inner.get(ns, artifact.meta.key)
        if held is not None and self.verifier.verify(held.meta, ns):
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
