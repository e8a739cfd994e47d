"""Property tests of every surface that takes input from outside (issue 9).

For each surface, hypothesis generates hostile inputs (structured values with extreme
integers, non-finite floats, odd text; and byte mutations of valid inputs) and checks:

* the input is refused cleanly (the surface's one error type, a one-line message) or it
  gives a correct result;
* never any other exception (a traceback), never a hang (each example is timed by
  hypothesis' deadline under the nightly profile);
* nothing already stored is changed by a refused input.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, a few seconds per surface) and
``nightly`` (thousands of examples per surface).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import sqlite3
import tarfile
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from farm.cluster.payloads import PayloadError, parse_request
from farm.core.errors import BundleError, FarmError, ManifestError, SettingsError
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.core.settings import load_settings
from farm.families import Registry
from farm.manifest import expand, load_manifest
from farm.programs.request import ChunkRequest
from farm.records import SessionStorage
from farm.records.model import Session
from farm.records.stream import (
    EntryError,
    decode_record,
    decode_records,
    decode_session,
    encode_packs,
    encode_record,
    encode_session,
)
from farm.store import MemoryStore, SQLiteStore
from farm.store.bundle import export_bundle, import_bundle

settings.register_profile(
    "ci", max_examples=150, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "nightly", max_examples=3000, deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

NS = Namespace.for_fingerprint("pocl-test-device-0123456789ab")
REGISTRY = Registry.load()


def one_line(exc: BaseException) -> None:
    text = str(exc)
    assert text and "\n" not in text, repr(text)


# -- hostile values ----------------------------------------------------------------------------
EXTREME_INTS = st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1,
                                2**70, 10**4000])
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [math.inf, -math.inf, math.nan, 1e308, 5e-324, -0.0])
TEXT = st.text(max_size=40) | st.sampled_from(
    ["", "..", "../x", "a\nb", "x" * 3000, "²", "\x00", "opencl/v1/x", "-O2", "$(id)",
     "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59", "2262-04-12T00:00:00Z"])
SCALARS = st.none() | st.booleans() | st.integers() | EXTREME_INTS | FLOATS | TEXT
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)


def mutate_json(value: Any, rnd: random.Random, replacement: Any) -> Any:
    """``value`` with one randomly chosen leaf (or a new key) replaced."""
    if isinstance(value, dict) and value:
        key = rnd.choice([*value, "extra_field"])
        if rnd.random() < 0.7 and key in value:
            return {**value, key: mutate_json(value[key], rnd, replacement)}
        return {**value, key: replacement}
    if isinstance(value, list) and value:
        i = rnd.randrange(len(value))
        return [*value[:i], mutate_json(value[i], rnd, replacement), *value[i + 1:]]
    return replacement


def mutate_bytes(data: bytes, rnd: random.Random, edits: int) -> bytes:
    out = bytearray(data)
    for _ in range(edits):
        how = rnd.random()
        pos = rnd.randrange(max(1, len(out)))
        if how < 0.6 and out:
            out[pos] = rnd.randrange(256)
        elif how < 0.8:
            del out[pos:pos + rnd.randrange(1, 600)]
        else:
            out[pos:pos] = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 40)))
    return bytes(out)


# -- manifests ---------------------------------------------------------------------------------
GOOD_MANIFEST = """\
format = 1
name = "p"

[model]
name = "m"
hidden = 64
heads = 4
head_dim = 16
intermediate = 128
vocab = 1000
tokens = [1, 8]

[[kernels]]
family = "elementwise_unary"
params = { op = "relu" }
local_size = [64]
"""


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") \
            if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}"
                                for k, v in value.items() if v is not None) + " }"
    return '""'


MODEL_KEYS = ["hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tokens",
              "dtypes", "tuning", "options", "name"]
KERNEL_KEYS = ["family", "params", "local_size", "options", "alignment"]


@given(data=st.data())
def test_manifests_are_expanded_or_refused_in_one_line(data: st.DataObject,
                                                       tmp_path_factory: Any) -> None:
    rnd = random.Random(data.draw(st.integers(0, 2**32)))
    if data.draw(st.booleans()):  # a structured manifest with hostile values
        key = data.draw(st.sampled_from(MODEL_KEYS + KERNEL_KEYS))
        value = data.draw(JSONISH | EXTREME_INTS.map(lambda i: [i]))
        text = GOOD_MANIFEST
        literal = data.draw(st.sampled_from(["", "9" * 5000, "1e999", "[" * 2000]))
        line = f"{key} = {literal or toml_value(value)}\n"
        if key in MODEL_KEYS:
            text = text.replace("tokens = [1, 8]\n", "tokens = [1, 8]\n" + line) \
                if key != "tokens" else text.replace("tokens = [1, 8]\n", line)
        else:
            text = text.replace('local_size = [64]\n', line if key == "local_size"
                                else 'local_size = [64]\n' + line)
        raw = text.encode("utf-8", "surrogatepass")
    else:  # byte mutations of a valid one
        raw = mutate_bytes(GOOD_MANIFEST.encode(), rnd, data.draw(st.integers(1, 6)))
    path = tmp_path_factory.mktemp("m") / "m.toml"
    path.write_bytes(raw)
    try:
        entries = expand(load_manifest(path), REGISTRY)
    except ManifestError as exc:
        one_line(exc)
        assert str(exc).startswith(str(path))
        return
    except FarmError as exc:  # an unknown family or bad parameters: input errors too
        one_line(exc)
        return
    assert 0 < len(entries) <= 100_000
    for entry in entries:  # every accepted kernel has a key
        assert len(entry.artifact.id_hash) == 32


# -- task payloads -----------------------------------------------------------------------------
GOOD_PAYLOAD = {"fingerprint": NS.fingerprint, "requested_by": {"session": 5, "batch": 1},
                "kernels": [{"artifact": {"kernel": {"family": "elementwise_unary",
                                                     "params": {"op": "relu"},
                                                     "launch": {"local_size": [64]}},
                                          "variant": {"options": ["-O2"], "alignment": 0}},
                             "build_id": "1" * 24}]}


@given(seed=st.integers(0, 2**32), replacement=JSONISH)
def test_task_payloads_are_validated_or_refused_in_one_line(seed: int,
                                                            replacement: Any) -> None:
    payload = mutate_json(GOOD_PAYLOAD, random.Random(seed), replacement)
    try:
        # as Celery's JSON gives it
        request = parse_request(json.loads(json.dumps(payload)), ChunkRequest)
    except PayloadError as exc:
        one_line(exc)
        return
    for kernel in request.kernels:  # an accepted payload always yields a key
        assert len(kernel.artifact.id_hash) == 32
        assert json.loads(request.model_dump_json())  # and serializes back to JSON


# -- records stream entries ----------------------------------------------------------------------
def _good_record_fields() -> dict[str, str]:
    from farm.core.outcomes import Outcome
    from farm.records import CompilationRecord, RequestedBy, Stamp

    record = CompilationRecord(stamp=Stamp(session=7, seq=3, offset_s=0.5), family="axpy",
                               key="0" * 32 + "." + "1" * 24, outcome=Outcome.COMPILED,
                               work_s=0.25, requested_by=RequestedBy(session=9, batch=1))
    return encode_record(record)


GOOD_RECORD = _good_record_fields()
GOOD_SESSION = encode_session(Session.start("p"), 3)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def records_storage(request: pytest.FixtureRequest) -> Iterator[SessionStorage]:
    """Both storages: PostgreSQL is the stricter (32-bit pid, 64-character columns, no
    NUL in text), and an entry it refuses would stop the ingester on every retry."""
    if request.param == "sqlite":
        with SessionStorage("sqlite://") as storage:
            yield storage
        return
    from test_records_stream import fresh_pg_database

    with fresh_pg_database(request.getfixturevalue("postgres_server")) as url, \
            SessionStorage(url) as storage:
        yield storage


def _emptied(storage: SessionStorage) -> SessionStorage:
    import sqlalchemy as sa

    with storage._engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM records"))
        conn.execute(sa.text("DELETE FROM sessions"))
    return storage


@given(seed=st.integers(0, 2**32), replacement=JSONISH,
       raw_field=st.binary(max_size=30), session=st.booleans(), as_bytes=st.booleans())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
def test_stream_entries_decode_and_store_or_are_refused(
        records_storage: SessionStorage, seed: int, replacement: Any, raw_field: bytes,
        session: bool, as_bytes: bool) -> None:
    rnd = random.Random(seed)
    base = dict(GOOD_SESSION if session else GOOD_RECORD)
    inner_name = "session" if session else "record"
    choice = rnd.random()
    fields: dict[Any, Any]
    if choice < 0.5:  # a hostile value inside the record's JSON
        inner = mutate_json(json.loads(base[inner_name]), rnd, replacement)
        fields = {**base, inner_name: json.dumps(inner)}
    elif choice < 0.8:  # a hostile envelope field
        fields = {**base, rnd.choice([*base, "x"]): json.dumps(replacement)
                  if not isinstance(replacement, str) else replacement}
    else:  # raw bytes (not UTF-8, say) in a field
        fields = {**base, rnd.choice([*base]): raw_field}
    if as_bytes:
        fields = {k.encode() if isinstance(k, str) else k:
                  v.encode("utf-8", "surrogatepass") if isinstance(v, str) else v
                  for k, v in fields.items()}
    try:
        decoded = decode_session(fields) if session else decode_record(fields)
    except EntryError as exc:
        assert str(exc)
        return
    # accepted: it must store and read back (no OverflowError, no value out of a
    # column's range, no unreadable null) in either storage
    storage = _emptied(records_storage)
    if session:
        storage.write_batch([decoded.session], [])  # type: ignore[union-attr]
        assert storage.sessions() == [decoded.session]  # type: ignore[union-attr]
    else:
        storage.write_batch([], [decoded])  # type: ignore[list-item]
        assert storage.records(decoded.stamp.session) == [decoded]  # type: ignore[union-attr]


def _good_pack_fields() -> dict[str, str]:
    from farm.core.outcomes import Outcome
    from farm.records import CompilationRecord, RequestedBy, Stamp

    records = [CompilationRecord(stamp=Stamp(session=7, seq=seq, offset_s=0.5), family="axpy",
                                 key="0" * 32 + "." + "1" * 24, outcome=Outcome.COMPILED,
                                 work_s=0.25, requested_by=RequestedBy(session=9, batch=1))
               for seq in (1, 2, 3)]
    ((_, fields),) = encode_packs(records)
    return fields


GOOD_PACK = _good_pack_fields()


@given(seed=st.integers(0, 2**32), replacement=JSONISH, raw_field=st.binary(max_size=30),
       as_bytes=st.booleans())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
def test_record_packs_decode_and_store_or_are_refused(
        records_storage: SessionStorage, seed: int, replacement: Any, raw_field: bytes,
        as_bytes: bool) -> None:
    """A hostile pack is refused whole in one line, or each of its records is either
    stored (and reads back) or set aside in one line: never an exception, never a
    record that validated and then fails in storage, never a record lost silently."""
    rnd = random.Random(seed)
    choice = rnd.random()
    fields: dict[Any, Any]
    members = json.loads(GOOD_PACK["records"])
    if choice < 0.6:  # a hostile value inside one record of the pack
        fields = {**GOOD_PACK, "records": json.dumps(mutate_json(members, rnd, replacement))}
    elif choice < 0.7:  # a hostile record added to the pack
        fields = {**GOOD_PACK, "records": json.dumps([*members, replacement])}
    elif choice < 0.9:  # a hostile envelope field
        fields = {**GOOD_PACK, rnd.choice([*GOOD_PACK, "x"]): json.dumps(replacement)
                  if not isinstance(replacement, str) else replacement}
    else:  # raw bytes (not UTF-8, say) in a field
        fields = {**GOOD_PACK, rnd.choice([*GOOD_PACK]): raw_field}
    if as_bytes:
        fields = {k.encode() if isinstance(k, str) else k:
                  v.encode("utf-8", "surrogatepass") if isinstance(v, str) else v
                  for k, v in fields.items()}
    try:
        decoded = decode_records(fields)
    except EntryError as exc:
        one_line(exc)
        return
    for bad in decoded.bad:
        one_line(bad.error)
    if fields.get("records", fields.get(b"records")) is not None:
        total = len(json.loads(fields.get("records") or fields[b"records"]))
        assert len(decoded.records) + len(decoded.bad) == total  # none lost silently
    storage = _emptied(records_storage)
    storage.write_batch([], decoded.records)
    first: dict[tuple[int, int], Any] = {}  # a mutated seq may repeat another: first wins
    for record in decoded.records:
        first.setdefault((record.stamp.session, record.stamp.seq), record)
    stored = {(r.stamp.session, r.stamp.seq): r
              for session in {key[0] for key in first} for r in storage.records(session)}
    assert stored == first


# -- bundles -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_bundle(tmp_path_factory: Any) -> Path:
    root = tmp_path_factory.mktemp("bundle")
    store = SQLiteStore(root / "s.sqlite")
    for i in range(3):
        low = Lowered(source=f"__kernel void k{i}() {{}}", kernel_names=(f"k{i}",))
        store.put(NS, Artifact.create(Key(id_hash=f"{i:032x}", build_id="1" * 24), "f",
                                      bytes([i]) * (50 + i), low.source_hash), source=low)
    export_bundle(store, None, root / "b.bundle")
    store.close()
    return root / "b.bundle"  # a path: hypothesis prints its arguments when one fails


def _held(store: MemoryStore) -> dict[tuple[str, str], tuple[str, str | None]]:
    return {(str(ns), str(k)): (a.meta.digest, store.find_source(ns, a.meta.source_hash)
                                and str(store.find_source(ns, a.meta.source_hash)))
            for (ns, k), a in store._items.items()}


def _manifest_edit(raw: bytes, rnd: random.Random, replacement: Any) -> bytes:
    """The bundle with its manifest JSON mutated (the members left as they are)."""
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    manifest = mutate_json(json.loads(members[0][1]), rnd, replacement)
    text = json.dumps(manifest).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(members[0][0].name)
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
        for member, data in members[1:]:
            tar.addfile(member, io.BytesIO(data))
    return out.getvalue()


@given(seed=st.integers(0, 2**32), edits=st.integers(1, 8), structured=st.booleans(),
       replacement=JSONISH)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
def test_bundles_import_or_are_refused_leaving_the_store_alone(
        good_bundle: Path, seed: int, edits: int, structured: bool,
        replacement: Any) -> None:
    rnd = random.Random(seed)
    good = good_bundle.read_bytes()
    raw = _manifest_edit(good, rnd, replacement) if structured \
        else mutate_bytes(good, rnd, edits)
    target = MemoryStore()
    k_low = Lowered(source="__kernel void mine() {}", kernel_names=("mine",))
    mine = Key(id_hash="f" * 32, build_id="1" * 24)
    target.put(NS, Artifact.create(mine, "f", b"compiled here", k_low.source_hash),
               source=k_low)
    target.put(NS, Artifact.create(Key(id_hash=f"{0:032x}", build_id="1" * 24), "f",
                                   b"held already", "0" * 64))
    before = _held(target)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b.bundle"
        path.write_bytes(raw)
        try:
            report = import_bundle(path, target)
        except BundleError as exc:
            one_line(exc)
            assert _held(target) == before
            return
    after = _held(target)
    for key, value in before.items():  # nothing held was replaced...
        assert after[key][0] == value[0]
    # ...and the source index never moved off what this process computed
    assert target.find_source(NS, k_low.source_hash) == mine
    assert report.imported + report.skipped + report.refused >= 0
    for (ns, k), art in target._items.items():
        assert art.verify() and art.meta.key == k and isinstance(ns, Namespace)


# -- settings ----------------------------------------------------------------------------------
SETTING_NAMES = ["FARM_HOME", "FARM_ENVIRONMENT", "FARM_RECORDS_URL", "FARM_RECORDS_LEVEL",
                 "FARM_KEEP_SESSIONS", "FARM_RECORDS_TRANSPORT", "FARM_FAMILY_MODULES",
                 "FARM_DEVICE", "FARM_WORKERS", "FARM_REDIS_URL", "FARM_MINIO_ENDPOINT",
                 "FARM_MINIO_BUCKET", "FARM_MINIO_SECURE", "FARM_LEASE_TTL",
                 "FARM_COMPILE_SOFT_TIME_LIMIT", "FARM_VISIBILITY_TIMEOUT", "FARM_CHUNK_SIZE",
                 "FARM_VERIFY_KEY"]
SETTING_VALUES = TEXT | st.sampled_from(
    ["inf", "nan", "-1", "1e-9", "1e400", "0", "99999999999999999999", '[""]', "[1]",
     "{}", "true", "/dev/null", "/", "redis://h:x/0", "postgresql://u@h:p/d",
     "http://u:p@h:1", "sqlite:///x", "1" * 5000]) | st.integers().map(str)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("FARM_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(values)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("FARM_")]:
            del os.environ[k]
        os.environ.update(saved)


@given(values=st.dictionaries(st.sampled_from(SETTING_NAMES),
                              SETTING_VALUES.filter(lambda v: "\x00" not in v),
                              min_size=1, max_size=4))
def test_settings_are_usable_or_refused_in_one_line(values: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as home:
        values.setdefault("FARM_HOME", home)
        with environment(values):
            try:
                loaded = load_settings()
            except SettingsError as exc:
                one_line(exc)
                assert "FARM_" in str(exc)
                assert "p@h" not in str(exc)  # a credential is never echoed
                return
    # accepted: the environment folder is inside FARM_HOME/envs, timeouts are usable
    envs = (loaded.home / "envs").resolve()
    assert loaded.environment_dir.resolve().parent == envs
    for seconds in (loaded.lease_ttl, loaded.compile_soft_time_limit,
                    loaded.visibility_timeout):
        assert math.isfinite(seconds) and 1.0 <= seconds
    assert 0 <= loaded.workers <= 1024


# -- store files -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_store(tmp_path_factory: Any) -> Path:
    path = tmp_path_factory.mktemp("store") / "s.sqlite"
    store = SQLiteStore(path)
    for i in range(6):
        low = Lowered(source=f"k{i}", kernel_names=("k",))
        store.put(NS, Artifact.create(Key(id_hash=f"{i:032x}", build_id="1" * 24), "f",
                                      os.urandom(3000), low.source_hash), source=low)
    store.close()
    conn = sqlite3.connect(path)  # one file, no WAL beside it
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    return path


@given(seed=st.integers(0, 2**32), edits=st.integers(1, 6), wal=st.booleans())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_store_files_are_read_or_refused_in_one_line(good_store: Path, seed: int,
                                                     edits: int, wal: bool) -> None:
    rnd = random.Random(seed)
    raw = mutate_bytes(good_store.read_bytes(), rnd, edits)
    if wal and len(raw) > 20:  # as our own stores are: in WAL mode (bytes 18-19)
        raw = raw[:18] + b"\x02\x02" + raw[20:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store.sqlite"
        path.write_bytes(raw)
        try:
            store = SQLiteStore(path)
        except FarmError as exc:
            assert str(exc)  # the CLI prints it as one line
            assert path.read_bytes() == raw  # refused untouched
            return
        try:
            for ns in store.namespaces():
                for key in store.keys(ns):
                    got = store.get(ns, key)
                    assert got is None or (got.verify() and got.meta.key == key)
            low = Lowered(source="new", kernel_names=("k",))
            store.put(NS, Artifact.create(Key(id_hash="e" * 32, build_id="1" * 24), "f",
                                          b"new", low.source_hash), source=low)
        except FarmError as exc:
            assert str(exc)
        finally:
            store.close()


@given(seed=st.integers(0, 2**32), edits=st.integers(1, 6), replacement=JSONISH)
def test_minio_objects_decode_to_a_verified_artifact_or_a_miss(seed: int, edits: int,
                                                               replacement: Any) -> None:
    """An object in the bucket is input too (anyone with write access to the bucket):
    decoding is a whole, well-formed frame or ``None``, never an exception."""
    from farm.store.minio import MAGIC, decode_artifact, encode_artifact

    rnd = random.Random(seed)
    low = Lowered(source="k", kernel_names=("k",))
    good = encode_artifact(Artifact.create(Key(id_hash="a" * 32, build_id="1" * 24), "f",
                                           b"binary", low.source_hash))
    if rnd.random() < 0.5:
        raw = mutate_bytes(good, rnd, edits)
    else:  # a frame around hostile metadata
        meta = mutate_json(json.loads(good[12:12 + int.from_bytes(good[8:12], "big")]),
                           rnd, replacement)
        text = json.dumps(meta).encode()
        raw = MAGIC + len(text).to_bytes(4, "big") + text + b"binary"
    got = decode_artifact(raw)
    assert got is None or isinstance(got.verify(), bool)


# -- native containers (issue 19) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def pocl_binary() -> tuple[bytes, Any]:
    """A real binary of this machine's device (and the device), compiled once."""
    from farm.compilation.finalize import finalize
    from farm.core.device import DeviceContext, probe_devices, select_device

    device = select_device(probe_devices())
    ctx, cl_device = DeviceContext(device).get()
    family = REGISTRY.get("elementwise_unary")
    lowered = family.lower_id(family.artifact_id({"op": "neg"}), device)
    built = finalize(ctx, cl_device, lowered)
    assert built.ok, built.error
    return built.binary, device


@given(seed=st.integers(0, 2**32), edits=st.integers(1, 8), replacement=JSONISH,
       how=st.sampled_from(["bytes", "header", "sizes"]))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
def test_native_containers_unpack_or_are_refused_in_one_line(
        pocl_binary: tuple[bytes, Any], seed: int, edits: int, replacement: Any,
        how: str) -> None:
    """A ``KFNATIVE`` container comes from the store (a bundle, another prefix): it
    unpacks into parts that add up, or is a one-line :class:`LoadError`; what a part
    says it is for (its target) is read without an exception, whatever its bytes."""
    from farm.compilation.native import MAGIC, pack, unpack
    from farm.compilation.target import binary_target
    from farm.core.errors import LoadError

    rnd = random.Random(seed)
    binary, _ = pocl_binary
    good = pack("sm_90", binary[:200], binary)
    header_len = int.from_bytes(good[8:12], "little")
    if how == "bytes":
        raw = mutate_bytes(good, rnd, edits)
    else:
        header = json.loads(good[12:12 + header_len])
        if how == "sizes":
            key = rnd.choice(["native_size", "portable_size"])
            header[key] = rnd.choice([0, -1, 1, 2**31, 2**63, header[key] + 1])
        else:
            header = mutate_json(header, rnd, replacement)
        text = json.dumps(header).encode()
        raw = MAGIC + len(text).to_bytes(4, "little") + text + good[12 + header_len:]
    try:
        parts = unpack(raw)
    except LoadError as exc:
        one_line(exc)
        return
    assert parts is not None or not raw.startswith(MAGIC)
    for part in ([parts.native, parts.portable] if parts is not None else [raw]):
        target = binary_target(part)
        assert target is None or target.startswith(("pocl:", "nvidia:"))
    if parts is not None:
        assert len(parts.native) + len(parts.portable) <= len(raw)


@pytest.fixture(scope="module")
def validator(pocl_binary: tuple[bytes, Any]) -> Iterator[Any]:
    from farm.compilation.validate import IsolatedValidator

    with IsolatedValidator(pocl_binary[1], timeout_s=60) as child:
        yield child


#: a child process per crashing example costs most of a second: a tenth of the examples
FEWER = settings(max_examples=max(10, settings.default.max_examples // 10),
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow, HealthCheck.data_too_large])


@given(seed=st.integers(0, 2**32), edits=st.integers(1, 4), wrap=st.booleans())
@FEWER
def test_damaged_binaries_are_judged_in_the_child_never_here(
        validator: Any, pocl_binary: tuple[bytes, Any], seed: int, edits: int,
        wrap: bool) -> None:
    """Any bytes, plain or in a container, handed to the isolated validator: a verdict
    (a string), never an exception and never this process's crash."""
    from farm.compilation.native import pack

    rnd = random.Random(seed)
    binary = mutate_bytes(pocl_binary[0], rnd, edits)
    if wrap:
        binary = pack("fake_1", binary, binary)
    verdict = validator.validate(binary, ("unary_neg",))
    assert isinstance(verdict, str) and "\n" not in verdict


# -- plugin return values (issue 19) -------------------------------------------------------------
class _Plugged:
    """What a hostile plugin hands back, set per example (one family, many returns)."""

    returned: Any = None
    raises: BaseException | None = None


def _plugin_family() -> Any:
    from farm.families.base import KernelFamily, Params

    class P(Params):
        n: int = 1

    class Plugin(KernelFamily[P]):
        name = "property_plugin"
        params_model = P

        def lower(self, params: Any, launch: Any, device: Any) -> Any:
            if _Plugged.raises is not None:
                raise _Plugged.raises
            return _Plugged.returned

    return Plugin()


PLUGIN = _plugin_family()
LOWERED_FIELDS = st.fixed_dictionaries({}, optional={
    "source": JSONISH | st.binary(max_size=20), "options": JSONISH,
    "kernel_names": JSONISH | st.lists(TEXT, max_size=3).map(tuple)})
EXCEPTIONS = st.sampled_from([KeyError, AttributeError, RuntimeError, ValueError,
                              SystemExit, GeneratorExit, MemoryError, RecursionError,
                              UnicodeDecodeError, FarmError, ManifestError])


@given(returned=JSONISH | LOWERED_FIELDS, construct=st.booleans(),
       raises=st.none() | EXCEPTIONS, text=TEXT)
def test_whatever_a_plugin_returns_lowers_or_fails_its_kernel_in_one_line(
        returned: Any, construct: bool, raises: Any, text: str) -> None:
    from farm.core.device import probe_devices, select_device
    from farm.core.errors import PluginError

    if construct and isinstance(returned, dict):
        returned = Lowered.model_construct(**returned)
    _Plugged.returned = returned
    _Plugged.raises = None
    if raises is not None:
        _Plugged.raises = raises("x", b"", 0, 1, "bad") if raises is UnicodeDecodeError \
            else raises(text)
    device = _DEVICE.setdefault("d", select_device(probe_devices()))
    try:
        lowered = PLUGIN.lower_id(PLUGIN.artifact_id({}), device)
    except (PluginError, FarmError) as exc:
        one_line(exc)
        assert len(str(exc)) <= 800
        return
    assert isinstance(lowered, Lowered) and isinstance(lowered.source, str)
    assert lowered.kernel_names and all(isinstance(n, str) for n in lowered.kernel_names)


_DEVICE: dict[str, Any] = {}


# -- records the recorder makes (issue 19) --------------------------------------------------------
@given(source=st.none() | TEXT | st.integers(0, 6).map(lambda n: "s" * (n * 1024 * 1024)),
       options=st.none() | st.lists(TEXT | st.just("-D" + "1" * 5000), max_size=300),
       family=TEXT.filter(lambda t: 0 < len(t) <= 200 and "\x00" not in t))
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          max_examples=max(10, settings.default.max_examples // 5))
def test_every_record_the_recorder_makes_packs_and_reads_back(
        source: str | None, options: list[str] | None, family: str) -> None:
    """Whatever code a family generates, its Full record fits the record's bounds (cut,
    never refused) and travels in packs that decode to the same records."""
    from farm.core.outcomes import Outcome
    from farm.records import CompilationRecord, Stamp
    from farm.records.model import MAX_SOURCE, fit_code

    kept_source, kept_options = fit_code(source, options)
    record = CompilationRecord(stamp=Stamp(session=1, seq=1, offset_s=0.0), family=family,
                               key="0" * 32 + "." + "1" * 24, outcome=Outcome.COMPILED,
                               work_s=0.1, source=kept_source, options=kept_options)
    assert record.source is None or len(record.source) <= MAX_SOURCE
    if source is not None and len(source) <= MAX_SOURCE:
        assert record.source == source
    decoded_records = []
    for _, fields in encode_packs([record]):
        decoded = decode_records(fields)
        assert not decoded.bad
        decoded_records += decoded.records
    assert decoded_records == [record]
