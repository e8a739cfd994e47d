"""Configuration: one pydantic-settings model read from ``FARM_*`` environment variables.

Every process (CLI, worker, ingester, loader) builds one ``Settings`` and passes it
explicitly; nothing reads the environment elsewhere. Secrets are ``SecretStr`` so they
never show up in logs or reprs. The cluster is configuration: setting
``FARM_REDIS_URL`` and ``FARM_MINIO_ENDPOINT`` switches the same commands from the
embedded default to the cluster.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from farm.core.errors import SettingsError, first_error
from farm.core.keys import DEFAULT_BUCKET, DEFAULT_ENVIRONMENT, RECORDS_FILE, STORE_FILE
from farm.core.model import INT64_MAX, RecordLevel
from farm.core.runenv import default_home

#: a dotted Python module name (FARM_FAMILY_MODULES entries)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
#: a day: no compile, lease or visibility timeout is longer, and none is shorter than
#: a second (a lease of 1e-9 s expires before it is renewed: every compile fails)
_MAX_SECONDS = 86_400.0


def _default_home() -> Path:
    return Path(default_home(os.environ))


class Settings(BaseSettings):
    """All knobs, with the environment variable that sets each (prefix ``FARM_``)."""

    model_config = SettingsConfigDict(env_prefix="FARM_", extra="ignore",
                                      allow_inf_nan=False)

    #: where embedded environments live (FARM_HOME)
    home: Path = Field(default_factory=_default_home)
    #: named environment: one store plus one records storage (FARM_ENVIRONMENT); a
    #: folder name under FARM_HOME/envs, so never ``.`` or ``..``
    environment: str = Field(default=DEFAULT_ENVIRONMENT,
                             pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    #: the artifact store's URL, its scheme naming the backend (FARM_STORE_URL):
    #: ``sqlite:///<file>``, ``memory://``, ``minio://host:port/bucket``,
    #: ``tiered:<url>|<url>``; default the environment's SQLite file, in front of MinIO
    #: with FARM_MINIO_ENDPOINT (farm/store/open.py)
    store_url: str | None = Field(default=None, max_length=4000)
    #: records storage URL; default SQLite beside the store (FARM_RECORDS_URL)
    records_url: str | None = Field(default=None, max_length=2000)
    records_level: RecordLevel = RecordLevel.BASIC
    keep_sessions: int | None = Field(default=None, ge=0, le=INT64_MAX)
    #: where records go (FARM_RECORDS_TRANSPORT): ``auto`` = Redis streams when
    #: FARM_REDIS_URL is set, else straight into storage; ``storage`` / ``stream`` force
    #: one (see farm/records/open.py and docs/RECORDS.md)
    records_transport: Literal["auto", "storage", "stream"] = "auto"
    #: extra modules providing kernel families (FARM_FAMILY_MODULES='["pkg.mod"]')
    family_modules: list[str] = Field(default_factory=list, max_length=256)
    #: OpenCL device: fingerprint, prefix or name substring (FARM_DEVICE); unset: the
    #: first device whose compiler works (farm.core.device.select_device)
    device: str | None = Field(default=None, max_length=200)
    #: where each device's probe build outcome is kept, a file per fingerprint
    #: (FARM_DEVICE_PROBES); shared by every FARM_HOME: it describes the machine's
    #: drivers (farm/core/device_probe.py)
    device_probes: Path = Field(default_factory=lambda: _default_home() / "device-probes")
    #: benchmarks only: a module that simulates a worker's devices (FARM_DEVICE_BACKEND,
    #: e.g. ``simdevice`` from bench/); unset: the OpenCL devices (farm/compilation/backend.py)
    device_backend: str | None = Field(default=None, max_length=200)
    #: local compile processes (FARM_WORKERS); default: one per core
    workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=0, le=1024)

    #: store the device's machine code beside its portable binary where the device allows
    #: it (NVIDIA: a cubin linked from the PTX by the CUDA driver; farm/compilation/native.py), so a
    #: load is a copy, not a JIT (FARM_NATIVE_BINARIES)
    native_binaries: bool = True
    #: where an application's program (``farm run``, farm.programs) that no store tier
    #: holds is compiled: ``compile`` here, on the application's device; ``farm`` on the
    #: cluster's pool for its fingerprint (FARM_REDIS_URL), here when no worker serves it
    #: (FARM_PROGRAMS_ON_MISS)
    programs_on_miss: Literal["compile", "farm"] = "compile"
    #: on PoCL's CPU drivers, take each kernel's binary after one launch of its declared
    #: geometry, so it carries that launch's machine code and a load's first launch
    #: compiles nothing (farm/compilation/ready.py; FARM_POCL_READY)
    pocl_ready: bool = True
    #: the host-wide folder of the measurement isolation locks (FARM_ISOLATION_DIR;
    #: farm/core/isolation.py, which reads this variable itself: every compile takes a
    #: slot there, also where no settings are passed). Unset: a folder of this user's
    #: in the temporary folder. Every farm process of a host must see the same one.
    isolation_dir: Path | None = None
    #: what ``KernelLoader.tuned`` does for a problem never tuned on this device
    #: (FARM_TUNE_ON_MISS): ``first`` launches the first candidate (one warning),
    #: ``tune`` measures the candidates here and stores the winner, ``fail`` raises
    tune_on_miss: Literal["first", "tune", "fail"] = "first"

    #: Ed25519 private key (base64) that signs every stored artifact; writers only
    signing_key: SecretStr | None = Field(default=None, max_length=200)
    #: Ed25519 public key (base64): refuse artifacts not signed by its private key
    verify_key: str | None = Field(default=None, max_length=200)
    #: whose generated code (pyopencl's and loopy's cached Python, pickles: code that
    #: runs in the application) a served application takes from the store
    #: (FARM_GENERATED_CODE; farm/programs/generated.py, docs/SECURITY.md): ``signed``
    #: only from a store this node verifies, stored only by a signing writer; ``any``
    #: also unsigned (every writer of the store may run Python in every served
    #: application); ``off`` never
    generated_code: Literal["signed", "any", "off"] = "signed"

    # -- cluster -------------------------------------------------------------------------
    redis_url: str | None = Field(default=None, max_length=2000)
    minio_endpoint: str | None = Field(default=None, max_length=2000)
    minio_access_key: SecretStr | None = None
    minio_secret_key: SecretStr | None = None
    minio_bucket: str = Field(default=DEFAULT_BUCKET, pattern=r"^[a-z0-9][a-z0-9.-]{2,62}$")
    minio_secure: bool = False
    #: the repair role's MinIO credentials (FARM_MINIO_REPAIR_ACCESS_KEY and
    #: FARM_MINIO_REPAIR_SECRET_KEY): ``farm gc`` and an operator's repairs delete every
    #: version of an object with them; never a worker's (docs/SECURITY.md, "Write-once")
    minio_repair_access_key: SecretStr | None = None
    minio_repair_secret_key: SecretStr | None = None
    #: the region requests to MinIO are signed for (FARM_MINIO_REGION): MinIO's own
    #: ``us-east-1`` unless its ``MINIO_SITE_REGION`` says otherwise; given, no process
    #: asks the server for it (a request every process and bucket); "" asks
    minio_region: str = Field(default="us-east-1", pattern=r"^([a-z0-9][a-z0-9-]{0,62})?$")
    #: seconds a compile may take before a soft / hard time limit stops it
    compile_soft_time_limit: float = Field(default=300.0, ge=1.0, le=_MAX_SECONDS)
    compile_hard_time_limit: float = Field(default=360.0, ge=1.0, le=_MAX_SECONDS)
    #: Redis broker visibility timeout; must exceed the hard time limit (see cluster docs)
    visibility_timeout: float = Field(default=900.0, ge=1.0, le=7 * _MAX_SECONDS)
    #: seconds a compile lease lives without renewal (a dead worker's lease expires)
    lease_ttl: float = Field(default=30.0, ge=1.0, le=_MAX_SECONDS)
    #: kernels per Celery task (amortises per-task overhead against compile time)
    chunk_size: int = Field(default=4, ge=1, le=256)

    # -- operations (see docs/OPERATIONS.md) ---------------------------------------------
    #: Celery task events (task-sent/-started/-succeeded...) for Flower and
    #: ``celery events`` (FARM_WORKER_EVENTS)
    worker_events: bool = True
    #: Celery worker heartbeats (worker-online/-heartbeat events; Flower's worker status,
    #: and the liveness file below) (FARM_WORKER_HEARTBEAT)
    worker_heartbeat: bool = True
    #: port of the Prometheus ``/metrics`` endpoint of a worker or ingester; unset: none
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    #: address that endpoint listens on (FARM_METRICS_ADDRESS): loopback by default, so a
    #: worker on a shared host shows its metrics to that host only; the chart sets
    #: 0.0.0.0 (Prometheus scrapes the pod's address; NetworkPolicies say who may)
    metrics_address: str = Field(default="127.0.0.1", max_length=64)
    #: Prometheus Pushgateway URL where ``farm build`` pushes its summary (optional)
    metrics_pushgateway: str | None = None
    #: folder of the health files the chart's probes read (``ready``, ``alive``)
    health_dir: Path | None = None

    # -- faults (see docs/RELIABILITY.md) --------------------------------------------------
    #: seconds a Redis or MinIO outage is waited out (with backoff) before a process gives
    #: up with one error line (FARM_OUTAGE_LIMIT)
    outage_limit: float = Field(default=60.0, ge=1.0, le=_MAX_SECONDS)
    #: times a kernel may kill its compiling process before it fails as ``crashed``
    #: (FARM_CRASH_LIMIT)
    crash_limit: int = Field(default=2, ge=1, le=100)
    #: seconds between a worker's heartbeats (FARM_HEARTBEAT_INTERVAL); a tenth of a
    #: second at least (more often is a busy loop on Redis), an hour at most
    heartbeat_interval: float = Field(default=3.0, ge=0.1, le=3600.0)
    #: seconds without a heartbeat after which a worker is dead: clients re-send the
    #: chunks it held, listings drop it (FARM_DEAD_WORKER_GRACE); longer than the
    #: heartbeat interval, or every worker is dead between two of its beats
    dead_worker_grace: float = Field(default=20.0, ge=0.1, le=_MAX_SECONDS)
    #: seconds one Redis or MinIO request may block before its peer counts as unreachable:
    #: how fast a frozen peer is noticed (FARM_SOCKET_TIMEOUT)
    socket_timeout: float = Field(default=5.0, ge=0.1, le=300.0)

    # -- validation: every value refused here, in one line, never later by a traceback --
    @field_validator("home", "device_probes")
    @classmethod
    def _usable_home(cls, value: Path) -> Path:
        if str(value) in ("", "."):
            raise ValueError("must name a folder (an empty value would mean the current "
                             "folder)")
        try:
            if value.exists() and not value.is_dir():
                raise ValueError("exists and is not a folder")
        except OSError as exc:  # a name too long, a component that is a file...
            raise ValueError(f"cannot be used as a folder ({exc.strerror})") from None
        return value

    @field_validator("dead_worker_grace")
    @classmethod
    def _longer_than_a_beat(cls, value: float, info: ValidationInfo) -> float:
        beat = info.data.get("heartbeat_interval")
        if beat is not None and value <= beat:
            raise ValueError(f"must exceed FARM_HEARTBEAT_INTERVAL ({beat:g} s): a worker "
                             "would be dead between two of its heartbeats")
        return value

    @field_validator("metrics_address")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        import ipaddress

        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError("must be an IP address to listen on (127.0.0.1, 0.0.0.0, "
                             "::)") from None
        return value

    @field_validator("family_modules")
    @classmethod
    def _module_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not isinstance(name, str) or len(name) > 200 or not _MODULE.fullmatch(name):
                raise ValueError(f"{str(name)[:60]!r} is not a Python module name")
        return value

    @field_validator("device_backend")
    @classmethod
    def _backend_module(cls, value: str | None) -> str | None:
        if value is not None and not _MODULE.fullmatch(value):
            raise ValueError(f"{value[:60]!r} is not a Python module name")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if not value:
            return value
        try:
            url = urlsplit(value)
            url.port  # noqa: B018 - parses the port, raising ValueError when it is not one
        except ValueError:
            raise ValueError("not a URL with a numeric port (redis://host:port/db)") from None
        if url.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must start with redis://, rediss:// or unix://")
        if url.scheme != "unix" and not url.hostname:
            raise ValueError("names no host (redis://host:port/db)")
        return value

    @field_validator("records_url")
    @classmethod
    def _records_url(cls, value: str | None) -> str | None:
        if not value:
            return value
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(value)
            url.port  # noqa: B018
        except (ArgumentError, ValueError):
            raise ValueError("not a database URL (sqlite:///<file> or "
                             "postgresql+psycopg://user@host:port/db, numeric port)") from None
        if url.get_backend_name() not in ("sqlite", "postgresql"):
            raise ValueError("use sqlite:///<file> or postgresql+psycopg://...")
        return value

    @field_validator("minio_endpoint")
    @classmethod
    def _no_credentials_in_endpoint(cls, value: str | None) -> str | None:
        if value and "@" in value.split("/", 3)[2 if "://" in value else 0]:
            # never echo it: the part before @ is a secret
            raise ValueError("must not carry credentials (user:password@); set "
                             "FARM_MINIO_ACCESS_KEY and FARM_MINIO_SECRET_KEY")
        return value

    @property
    def environment_dir(self) -> Path:
        return self.home / "envs" / self.environment

    @property
    def store_path(self) -> Path:
        return self.environment_dir / STORE_FILE

    @property
    def effective_records_url(self) -> str:
        return self.records_url or f"sqlite:///{self.records_path}"

    @property
    def records_path(self) -> Path:
        """The embedded records file (used unless FARM_RECORDS_URL names another)."""
        return self.environment_dir / RECORDS_FILE

    @property
    def cluster(self) -> bool:
        return bool(self.redis_url)


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment plus explicit overrides, as one line on error."""
    from pydantic_settings import SettingsError as SourceError

    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except SourceError as exc:  # a complex value (a list) that is not valid JSON
        raise SettingsError(f"setting {_env_name(str(exc))}: not valid JSON") from None
    except ValidationError as exc:
        field, msg = first_error(exc)
        raise SettingsError(f"setting FARM_{field.upper()}: {msg}") from None


def _env_name(message: str) -> str:
    """``error parsing value for field "family_modules" ...`` -> FARM_FAMILY_MODULES."""
    import re

    found = re.search(r'field "([a-z_]+)"', message)
    return f"FARM_{found.group(1).upper()}" if found else "FARM_*"
