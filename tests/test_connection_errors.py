"""An authentication or TLS failure says what failed (issue 19 item 8), for real: a Redis
that wants a password, a Redis that speaks TLS with a private CA, and MinIO.

Before, all of these read "is it running?" (or were waited out as an outage for
``FARM_OUTAGE_LIMIT`` seconds): a wrong password or an untrusted certificate is not an
outage, and waiting cannot fix it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from farm.devservices.ports import free_port

pytestmark = pytest.mark.integration


def farm(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    clean.update(FARM_OUTAGE_LIMIT="20", **env)
    return subprocess.run([sys.executable, "-m", "farm", *args], env=clean, text=True,
                          capture_output=True, timeout=120, check=False)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (the CA is the certificate itself)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def redis_server(*args: str) -> Iterator[int]:
    """A redis-server of this test's own (stopped by its process id)."""
    import socket

    port = free_port()
    tls = "--tls-cert-file" in args
    argv = ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            *(("--port", "0", "--tls-port", str(port)) if tls else ("--port", str(port))),
            *args]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "no redis-server"
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def password_redis() -> Iterator[int]:
    yield from redis_server("--requirepass", "right-pw-8Kx2")


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    cert, key = self_signed(tmp_path)
    for port in redis_server("--tls-cert-file", str(cert), "--tls-key-file", str(key),
                             "--tls-auth-clients", "no"):
        yield port, cert


def test_a_wrong_redis_password_says_authentication_failed(password_redis: int) -> None:
    started = time.monotonic()
    proc = farm("workers", FARM_REDIS_URL=f"redis://:wrong-pw@127.0.0.1:{password_redis}/0")
    line = one_line(proc)
    assert proc.returncode == 1
    assert "authentication failed" in line and "FARM_REDIS_URL" in line, line
    assert "is it running" not in line and "wrong-pw" not in line
    assert time.monotonic() - started < 15  # not waited out as an outage
    ok = farm("workers", FARM_REDIS_URL=f"redis://:right-pw-8Kx2@127.0.0.1:{password_redis}/0")
    assert ok.returncode == 0, ok.stderr


def test_an_untrusted_redis_certificate_says_tls_failed(tls_redis: tuple[int, Path]) -> None:
    port, cert = tls_redis
    proc = farm("workers", FARM_REDIS_URL=f"rediss://127.0.0.1:{port}/0")
    line = one_line(proc)
    assert proc.returncode == 1
    assert "TLS" in line and "certificate verify failed" in line, line
    assert "SSL_CERT_FILE" in line and "is it running" not in line
    trusted = farm("workers", FARM_REDIS_URL=f"rediss://127.0.0.1:{port}/0",
                   SSL_CERT_FILE=str(cert))  # the private CA, as the chart mounts it
    assert trusted.returncode == 0, trusted.stderr
    assert "no worker is running" in trusted.stdout


def test_minio_tls_and_credential_failures_say_what_failed(minio_server: Any,
                                                           tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text('format = 1\n\n[[kernels]]\nfamily = "elementwise_unary"\n'
                        'params = { op = "neg" }\n')
    common = {"FARM_HOME": str(tmp_path / "home"), "FARM_MINIO_BUCKET": "told",
              "FARM_MINIO_ACCESS_KEY": minio_server.access_key}
    started = time.monotonic()
    tls = farm("warm", str(manifest), "--on-miss", "fail",
               FARM_MINIO_ENDPOINT=f"https://{minio_server.endpoint}",
               FARM_MINIO_SECRET_KEY=minio_server.secret_key, **common)
    line = one_line(tls)
    assert tls.returncode == 1 and "TLS" in line and "unreachable" not in line, line
    assert time.monotonic() - started < 15
    wrong = farm("warm", str(manifest), "--on-miss", "fail",
                 FARM_MINIO_ENDPOINT=minio_server.endpoint,
                 FARM_MINIO_SECRET_KEY="not-the-secret", **common)
    line = one_line(wrong)
    assert wrong.returncode == 1 and "credentials were refused" in line, line
    assert "FARM_MINIO_SECRET_KEY" in line and "not-the-secret" not in line
