"""Signed artifacts: writers sign; a verifying reader refuses unsigned or wrongly signed."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.core.errors import SettingsError
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key
from farm.core.settings import Settings
from farm.store import PutResult, SQLiteStore
from farm.store.signing import Signer, SigningStore, Verifier, generate_keypair, with_signatures

NS = Namespace.for_fingerprint("pocl-test-device-0123456789ab")
NVIDIA = Namespace.for_fingerprint("nvidia-h200-0123456789ab")
KEY = Key(id_hash="a" * 32, build_id="b" * 24)


def art(payload: bytes = b"binary", key: Key = KEY) -> Artifact:
    return Artifact.create(key, "fam", payload, "5" * 64)


@pytest.fixture
def keys() -> tuple[str, str]:
    return generate_keypair()


def test_a_writer_signs_and_a_verifying_reader_accepts(tmp_path: Path,
                                                       keys: tuple[str, str]) -> None:
    private, public = keys
    raw = SQLiteStore(tmp_path / "s.sqlite")
    writer = SigningStore(raw, Signer(private), None)
    assert writer.put(NS, art()) is PutResult.STORED
    stored = raw.get(NS, KEY)
    assert stored is not None and stored.meta.signature
    reader = SigningStore(raw, None, Verifier(public))
    got = reader.get(NS, KEY)
    assert got is not None and got.binary == b"binary"


def test_unsigned_and_foreign_signatures_are_refused(tmp_path: Path,
                                                     keys: tuple[str, str]) -> None:
    _, public = keys
    raw = SQLiteStore(tmp_path / "s.sqlite")
    raw.put(NS, art())  # written by a process without the key: unsigned
    reader = SigningStore(raw, None, Verifier(public))
    assert reader.get(NS, KEY) is None
    assert reader.stats.unsigned == 1

    other_private, _ = generate_keypair()  # signed, but by another key
    key2 = Key(id_hash="c" * 32, build_id="b" * 24)
    SigningStore(raw, Signer(other_private), None).put(NS, art(key=key2))
    assert reader.get(NS, key2) is None
    assert reader.stats.unsigned == 2


def test_a_signature_cannot_be_replayed_under_another_key(tmp_path: Path,
                                                          keys: tuple[str, str]) -> None:
    private, public = keys
    raw = SQLiteStore(tmp_path / "s.sqlite")
    SigningStore(raw, Signer(private), None).put(NS, art())
    signed = raw.get(NS, KEY)
    assert signed is not None
    other = Key(id_hash="d" * 32, build_id="b" * 24)
    replay = Artifact(meta=signed.meta.model_copy(update={"key": other}), binary=signed.binary)
    raw.put(NS, replay)
    assert SigningStore(raw, None, Verifier(public)).get(NS, other) is None


def test_a_writer_repairs_an_unsigned_entry(tmp_path: Path, keys: tuple[str, str]) -> None:
    private, _ = keys
    raw = SQLiteStore(tmp_path / "s.sqlite")
    raw.put(NS, art())
    writer = with_signatures(raw, Settings(signing_key=private))  # verifies with its own key
    assert writer.get(NS, KEY) is None
    assert writer.put(NS, art()) is PutResult.STORED
    assert writer.get(NS, KEY) is not None


def test_bad_keys_are_one_line_settings_errors() -> None:
    with pytest.raises(SettingsError, match="FARM_VERIFY_KEY: not base64"):
        Verifier("not base64!!")
    with pytest.raises(SettingsError, match="32 bytes"):
        Signer("AAAA")


def test_end_to_end_a_signed_build_warms_and_an_unsigned_one_is_refused(
        tmp_path: Path, keys: tuple[str, str]) -> None:
    import json
    import os
    import subprocess
    import sys

    private, public = keys
    manifest = tmp_path / "m.toml"
    manifest.write_text('format = 1\nname = "sig"\n\n[[kernels]]\nfamily = "elementwise_unary"\n'
                        'params = { op = "neg" }\n')

    def farm(home: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
        env.update(FARM_HOME=str(tmp_path / home), PYOPENCL_NO_CACHE="1",
                   POCL_KERNEL_CACHE="0", **extra)
        return subprocess.run([sys.executable, "-m", "farm", *args], env=env, text=True,
                              capture_output=True, check=False)

    assert farm("signed", "build", str(manifest), "--local",
                FARM_SIGNING_KEY=private).returncode == 0
    warm = farm("signed", "warm", str(manifest), "--json", "--on-miss", "fail",
                FARM_VERIFY_KEY=public)
    assert warm.returncode == 0, warm.stderr
    assert json.loads(warm.stdout)["summary"]["local"] == 1

    assert farm("unsigned", "build", str(manifest), "--local").returncode == 0
    refused = farm("unsigned", "warm", str(manifest), "--json", "--on-miss", "fail",
                   FARM_VERIFY_KEY=public)
    assert refused.returncode == 1, refused.stdout
    assert json.loads(refused.stdout)["summary"]["local"] == 0


def test_keygen_writes_a_private_file_and_prints_the_public_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    target = tmp_path / "signing.key"
    proc = subprocess.run([sys.executable, "-m", "farm", "keygen", str(target)],
                          capture_output=True, text=True, check=True)
    assert target.stat().st_mode & 0o777 == 0o600
    public = proc.stdout.split("FARM_VERIFY_KEY=")[1].split()[0]
    signed = Signer(target.read_text().strip()).sign(art().meta, NS)
    assert Verifier(public).verify(signed, NS)
    assert not Verifier(generate_keypair()[1]).verify(signed, NS)
    again = subprocess.run([sys.executable, "-m", "farm", "keygen", str(target)],
                           capture_output=True, text=True, check=False)
    assert again.returncode == 2 and "exists" in again.stderr


def test_a_signed_artifact_copied_into_another_namespace_is_refused(
        tmp_path: Path, keys: tuple[str, str]) -> None:
    """Issue 19 item 3: the signature binds the namespace (the device), so a signed PoCL
    binary copied under an NVIDIA fingerprint's namespace does not verify there."""
    private, public = keys
    raw = SQLiteStore(tmp_path / "s.sqlite")
    SigningStore(raw, Signer(private), None).put(NS, art())
    signed = raw.get(NS, KEY)
    assert signed is not None
    assert raw.put(NVIDIA, signed) is PutResult.STORED  # a store writer without the key
    reader = SigningStore(raw, None, Verifier(public))
    assert reader.get(NS, KEY) is not None
    assert reader.get(NVIDIA, KEY) is None
    assert reader.stats.unsigned == 1


def test_a_signature_without_its_namespace_is_refused_and_named(
        tmp_path: Path, keys: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    """A signature made before the namespace was signed (version 1: key, family, digest,
    size) keeps that meaning: it is recognised as such, and refused, because it does not
    say which device the binary is for; a writer with the key replaces it."""
    import base64

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from farm.core.hashing import canonical_json

    private, public = keys
    meta = art().meta
    v1 = canonical_json({"key": str(meta.key), "family": meta.family,
                         "digest": meta.digest, "size": meta.size}).encode()
    raw_key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(private))
    old = meta.model_copy(update={"signature": base64.b64encode(raw_key.sign(v1)).decode()})
    raw = SQLiteStore(tmp_path / "s.sqlite")
    raw.put(NS, Artifact(meta=old, binary=b"binary"))
    reader = SigningStore(raw, None, Verifier(public))
    with caplog.at_level("WARNING"):
        assert reader.get(NS, KEY) is None
    assert "without its namespace" in caplog.text
    writer = with_signatures(raw, Settings(signing_key=private))
    assert writer.put(NS, art()) is PutResult.STORED
    assert reader.get(NS, KEY) is not None
