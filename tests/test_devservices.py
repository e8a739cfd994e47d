"""The development services start real servers, round-trip data, and leave nothing behind."""

from __future__ import annotations

import io
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from minio import Minio

from farm.devservices import (
    MinioServer,
    PostgresServer,
    RedisServer,
    ServiceError,
    port_answers,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll `check` until it is true or the timeout passes; the last answer counts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


# Redis


def test_redis_round_trip_reaches_the_append_only_file(redis_server: RedisServer) -> None:
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    client = redis.Redis.from_url(redis_server.url)
    value = secrets.token_hex(8)
    try:
        assert client.set("farm:devservices:probe", value)
        assert client.get("farm:devservices:probe") == value.encode()
    finally:
        client.close()

    def in_aof() -> bool:
        return any(
            value.encode() in path.read_bytes()
            for path in redis_server.directory.rglob("*.aof")
            if path.is_file()
        )

    assert _eventually(in_aof), "the SET never reached an append-only file in the workdir"


def test_redis_stop_ends_the_server_and_removes_its_folder(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        port, folder = server.port, server.directory
        assert folder.parent == tmp_path
        assert port_answers(port)
    assert not server.running
    assert not port_answers(port)
    assert not folder.exists()
    server.stop()  # idempotent


def test_redis_bin_names_the_server_to_run(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """FARM_REDIS_BIN (a carried server on a host with no network) is the one started:
    here a wrapper around the machine's server that leaves a mark when it runs."""
    import shutil

    real = shutil.which("redis-server")
    assert real is not None
    mark = tmp_path / "wrapper-ran"
    wrapper = tmp_path / "redis-server"
    wrapper.write_text(f'#!/bin/sh\ntouch {mark}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("FARM_REDIS_BIN", str(wrapper))
    with RedisServer(tmp_path / "work") as server:
        assert redis.Redis.from_url(server.url).ping()
    assert mark.exists()


@pytest.mark.parametrize("name", ["FARM_REDIS_BIN", "FARM_MINIO_BIN"])
def test_a_chosen_server_that_is_not_there_is_named(tmp_path: Path, name: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, str(tmp_path / "missing"))
    server = RedisServer(tmp_path) if name == "FARM_REDIS_BIN" else MinioServer(tmp_path)
    with pytest.raises(ServiceError, match=f"{name}=.*missing is not an executable file"):
        server.start()
    assert not server.running
    assert not list(tmp_path.glob("farm-*"))


# MinIO


def test_minio_round_trip(minio_server: MinioServer) -> None:
    client = Minio(
        minio_server.endpoint,
        access_key=minio_server.access_key,
        secret_key=minio_server.secret_key,
        secure=False,
    )
    bucket = f"farm-test-{secrets.token_hex(4)}"
    payload = secrets.token_bytes(4096)
    client.make_bucket(bucket)
    client.put_object(bucket, "a/b/artifact.bin", io.BytesIO(payload), len(payload))
    response = client.get_object(bucket, "a/b/artifact.bin")
    try:
        assert response.read() == payload
    finally:
        response.close()
        response.release_conn()
    assert [obj.object_name for obj in client.list_objects(bucket, recursive=True)] == [
        "a/b/artifact.bin"
    ]


def test_minio_credentials_stay_out_of_logs_and_repr(minio_server: MinioServer) -> None:
    assert minio_server.secret_key not in repr(minio_server)
    assert minio_server.access_key not in repr(minio_server)
    log = minio_server.log_path.read_text(errors="replace")
    assert minio_server.secret_key not in log


def test_minio_credentials_are_random_per_start(minio_server: MinioServer) -> None:
    with MinioServer() as other:
        assert other.secret_key != minio_server.secret_key
        assert other.access_key != minio_server.access_key
        wrong = Minio(
            other.endpoint,
            access_key=minio_server.access_key,
            secret_key=minio_server.secret_key,
            secure=False,
        )
        with pytest.raises(Exception, match=r"(?i)access key|signature|InvalidAccessKeyId"):
            wrong.list_buckets()


def test_minio_stop_ends_the_server_and_removes_its_folder(tmp_path: Path) -> None:
    with MinioServer(tmp_path) as server:
        port, folder = server.port, server.directory
        assert port_answers(port)
    assert not server.running
    assert not port_answers(port)
    assert not folder.exists()


# PostgreSQL


def test_postgres_round_trip(postgres_server: PostgresServer) -> None:
    assert postgres_server.url == f"postgresql+psycopg://farm@127.0.0.1:{postgres_server.port}/farm"
    engine = sa.create_engine(postgres_server.url)
    table = f"probe_{secrets.token_hex(4)}"
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"create table {table} (id integer primary key, name text)"))
            conn.execute(
                sa.text(f"insert into {table} (id, name) values (:id, :name)"),
                [{"id": 1, "name": "gemm"}, {"id": 2, "name": "conv"}],
            )
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"select id, name from {table} order by id")).all()
            database = conn.execute(sa.text("select current_database()")).scalar_one()
        assert [tuple(row) for row in rows] == [(1, "gemm"), (2, "conv")]
        assert database == "farm"
    finally:
        engine.dispose()


def test_postgres_stop_ends_the_server_and_removes_its_folder() -> None:
    with PostgresServer() as server:
        port, folder = server.port, server.directory
        assert port_answers(port)
    assert not server.running
    assert not port_answers(port)
    assert not folder.exists()


def test_postgres_in_a_private_workdir_runs_or_says_why(tmp_path: Path) -> None:
    """pytest's tmp_path is private to its owner: root cannot hand it to `postgres`."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    server = PostgresServer(private)
    if os.geteuid() == 0:
        with pytest.raises(ServiceError, match="cannot write"):
            server.start()
    else:
        with server:
            assert server.directory.parent == private
    assert not server.running
    assert list(private.iterdir()) == []


# python -m farm.devservices up


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_up_prints_settings_and_stops_on_signal(tmp_path: Path, stop_signal: int) -> None:
    env_file = tmp_path / "farm.env"
    stdout = tmp_path / "stdout"
    with stdout.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "farm.devservices",
                "up",
                "--redis",
                "--env-file",
                str(env_file),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.PIPE,
        )
    try:
        assert _eventually(env_file.exists, timeout=30), "`up` never wrote its env file"
        lines = env_file.read_text().splitlines()
        assert len(lines) == 1 and lines[0].startswith("export FARM_REDIS_URL=redis://127.0.0.1:")
        assert stdout.read_text().splitlines() == lines
        url = lines[0].split("=", 1)[1]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert redis.Redis.from_url(url).ping()
        process.send_signal(stop_signal)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err.decode()
    assert b"stopped" in err
    assert not port_answers(port)
    assert not env_file.exists()
