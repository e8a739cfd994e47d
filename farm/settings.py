"""Configuration: one pydantic-settings model read from ``FARM_*`` environment variables.

Every process (CLI, worker, ingester, loader) builds one ``Settings`` and passes it
explicitly; nothing reads the environment elsewhere. Secrets are ``SecretStr`` so they
never show up in logs or reprs. The cluster is configuration: setting
``FARM_REDIS_URL`` and ``FARM_MINIO_ENDPOINT`` switches the same commands from the
embedded default to the cluster.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from farm.errors import SettingsError
from farm.records.model import RecordLevel


def _default_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kernel-farm"


class Settings(BaseSettings):
    """All knobs, with the environment variable that sets each (prefix ``FARM_``)."""

    model_config = SettingsConfigDict(env_prefix="FARM_", extra="ignore")

    #: where embedded environments live (FARM_HOME)
    home: Path = Field(default_factory=_default_home)
    #: named environment: one store plus one records storage (FARM_ENVIRONMENT)
    environment: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    #: records storage URL; default SQLite beside the store (FARM_RECORDS_URL)
    records_url: str | None = None
    records_level: RecordLevel = RecordLevel.BASIC
    keep_sessions: int | None = Field(default=None, ge=0)
    #: where records go (FARM_RECORDS_TRANSPORT): ``auto`` = Redis streams when
    #: FARM_REDIS_URL is set, else straight into storage; ``storage`` / ``stream`` force
    #: one (see farm/records/open.py and docs/RECORDS.md)
    records_transport: Literal["auto", "storage", "stream"] = "auto"
    #: extra modules providing kernel families (FARM_FAMILY_MODULES='["pkg.mod"]')
    family_modules: list[str] = Field(default_factory=list)
    #: OpenCL device: fingerprint, prefix or name substring (FARM_DEVICE)
    device: str | None = None
    #: local compile processes (FARM_WORKERS); default: one per core
    workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=0)

    #: Ed25519 private key (base64) that signs every stored artifact; writers only
    signing_key: SecretStr | None = None
    #: Ed25519 public key (base64): refuse artifacts not signed by its private key
    verify_key: str | None = None

    # -- cluster -------------------------------------------------------------------------
    redis_url: str | None = None
    minio_endpoint: str | None = None
    minio_access_key: SecretStr | None = None
    minio_secret_key: SecretStr | None = None
    minio_bucket: str = Field(default="kernel-farm", pattern=r"^[a-z0-9][a-z0-9.-]{2,62}$")
    minio_secure: bool = False
    #: seconds a compile may take before a soft / hard time limit stops it
    compile_soft_time_limit: float = Field(default=300.0, gt=0)
    compile_hard_time_limit: float = Field(default=360.0, gt=0)
    #: Redis broker visibility timeout; must exceed the hard time limit (see cluster docs)
    visibility_timeout: float = Field(default=900.0, gt=0)
    #: seconds a compile lease lives without renewal (a dead worker's lease expires)
    lease_ttl: float = Field(default=30.0, gt=0)
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
    #: Prometheus Pushgateway URL where ``farm build`` pushes its summary (optional)
    metrics_pushgateway: str | None = None
    #: folder of the health files the chart's probes read (``ready``, ``alive``)
    health_dir: Path | None = None

    @property
    def environment_dir(self) -> Path:
        return self.home / "envs" / self.environment

    @property
    def store_path(self) -> Path:
        return self.environment_dir / "store.sqlite"

    @property
    def effective_records_url(self) -> str:
        return self.records_url or f"sqlite:///{self.environment_dir / 'records.sqlite'}"

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
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise SettingsError(f"setting FARM_{field.upper()}: {err['msg']}") from None


def _env_name(message: str) -> str:
    """``error parsing value for field "family_modules" ...`` -> FARM_FAMILY_MODULES."""
    import re

    found = re.search(r'field "([a-z_]+)"', message)
    return f"FARM_{found.group(1).upper()}" if found else "FARM_*"
