"""Least privilege in the bucket: who may read and who may write what (MinIO policies).

Three kinds of credentials, none of them the MinIO root user:

* **a pool's** (``kernel-farm-pool-<fingerprint>``): read the whole bucket (its
  versions too), create objects only under its own namespace ``opencl/v1/<fingerprint>/``
  (artifacts, source index, quarantine), and delete nothing. A compromised or buggy
  worker of one device cannot write another device's binaries, and cannot remove any
  object, nor any version of one. A pool that names no fingerprint (a trial CPU pool)
  gets ``kernel-farm-pool-any``: every namespace, still no delete, no administration.
* **the repair role's** (``kernel-farm-repair``): read, write and delete every object
  and every version of the bucket. ``farm gc`` and an operator's repairs run with it
  (``FARM_MINIO_REPAIR_ACCESS_KEY``/``_SECRET_KEY``); no worker holds it.
* **a reader's** (``kernel-farm-read``): list and read the bucket. Loaders work with
  it: what they compile on a miss stays in their local tier (one line says so, see
  :mod:`farm.store.tiered`).
* **a build client's** (``kernel-farm-client``): a reader's, and create program sources
  (``blobs/``: content-addressed, each read checks its digest), which a ``farm build
  --cluster`` of programs hands the workers by digest. No artifact, no delete.
* **the administrator's** (root, or a user with ``kernel-farm-admin``): makes the
  bucket, the users and the policies (this module), imports bundles, collects garbage.

Write-once, and what MinIO can refuse (docs/SECURITY.md, "Write-once"): the set-up
turns versioning on, so that a write over an existing object keeps the original as an
older version, and no pool may delete an object or a version: nothing a pool wrote is
ever lost. MinIO cannot refuse the overwrite itself to a user who may create the name
(its policies know no ``s3:if-none-match`` condition, and object locking protects
versions, not names); the farm's own writes are conditional (``If-None-Match: *``),
and a reader verifies every artifact's digest (and signature, with a verify key).

Applied by the chart's set-up Job for the bundled MinIO (``python -m
farm.cluster.access``, reading what to apply from the environment, see :func:`main`),
and by an operator once for an external MinIO (docs/DEPLOY.md); the policy documents
are printed with ``--print`` for those who prefer ``mc admin policy create``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError

from farm.core.keys import BLOBS_PREFIX, Namespace, namespace_prefix

if TYPE_CHECKING:
    from minio import Minio
    from minio.minioadmin import MinioAdmin

READ_POLICY = "kernel-farm-read"
CLIENT_POLICY = "kernel-farm-client"
REPAIR_POLICY = "kernel-farm-repair"
ANY_POOL = "any"

PolicyDocument = dict[str, Any]


def pool_policy_name(fingerprint: str | None) -> str:
    """The policy of a pool: one per fingerprint (``any`` for a pool that names none)."""
    return f"kernel-farm-pool-{fingerprint or ANY_POOL}"


def _bucket_arn(bucket: str) -> str:
    return f"arn:aws:s3:::{bucket}"


def _read_statements(bucket: str) -> list[PolicyDocument]:
    return [
        {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket",
                                       "s3:ListBucketVersions"],
         "Resource": [_bucket_arn(bucket)]},
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
         "Resource": [f"{_bucket_arn(bucket)}/*"]},
    ]


def read_policy(bucket: str) -> PolicyDocument:
    """List and read the bucket; write nothing."""
    return {"Version": "2012-10-17", "Statement": _read_statements(bucket)}


def client_policy(bucket: str) -> PolicyDocument:
    """Read the bucket; create program sources (``blobs/``); nothing else."""
    return {"Version": "2012-10-17", "Statement": [
        *_read_statements(bucket),
        {"Effect": "Allow", "Action": ["s3:PutObject"],
         "Resource": [f"{_bucket_arn(bucket)}/{BLOBS_PREFIX}*"]},
    ]}


def pool_policy(bucket: str, fingerprint: str | None) -> PolicyDocument:
    """Read the bucket; create objects only under the namespace of ``fingerprint``
    (every namespace when ``None``); delete nothing (the store's own deletes become
    conditional writes of an empty object, see :mod:`farm.store.minio_removal`)."""
    if fingerprint:
        where = f"{_bucket_arn(bucket)}/{namespace_prefix(Namespace.for_fingerprint(fingerprint))}*"
    else:
        where = f"{_bucket_arn(bucket)}/{namespace_prefix(None)}*"
    return {"Version": "2012-10-17", "Statement": [
        *_read_statements(bucket),
        {"Effect": "Allow", "Action": ["s3:PutObject"], "Resource": [where]},
    ]}


def repair_policy(bucket: str) -> PolicyDocument:
    """Read, write and delete every object and version of the bucket (``farm gc``, an
    operator's repairs); no bucket administration."""
    return {"Version": "2012-10-17", "Statement": [
        *_read_statements(bucket),
        {"Effect": "Allow", "Action": ["s3:PutObject", "s3:DeleteObject",
                                       "s3:DeleteObjectVersion"],
         "Resource": [f"{_bucket_arn(bucket)}/*"]},
    ]}


class Grant(BaseModel):
    """One user to create (or update) and the policy it gets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    access_key: str = Field(min_length=3, max_length=128)
    secret_key: SecretStr = Field(min_length=8, max_length=128)
    #: the pool's fingerprint; ``None`` with ``reader``: the read-only user
    fingerprint: str | None = Field(default=None, max_length=100)
    reader: bool = False
    #: the repair role (``farm gc``, repairs): neither a pool nor a reader
    repair: bool = False
    #: a build client: a reader that may also create program sources
    client: bool = False

    @property
    def policy(self) -> str:
        """The name of the policy this user gets."""
        if self.repair:
            return REPAIR_POLICY
        if self.client:
            return CLIENT_POLICY
        return READ_POLICY if self.reader else pool_policy_name(self.fingerprint)


def policies_for(bucket: str, grants: Iterable[Grant]) -> dict[str, PolicyDocument]:
    """Every policy ``grants`` need, by name."""
    found: dict[str, PolicyDocument] = {}
    for grant in grants:
        if grant.repair:
            found[REPAIR_POLICY] = repair_policy(bucket)
        elif grant.client:
            found[CLIENT_POLICY] = client_policy(bucket)
        elif grant.reader:
            found[READ_POLICY] = read_policy(bucket)
        else:
            found[pool_policy_name(grant.fingerprint)] = pool_policy(bucket, grant.fingerprint)
    return found


def apply(admin: MinioAdmin, client: Minio, bucket: str, grants: list[Grant]) -> list[str]:
    """Make the bucket (versioned: an overwrite keeps the original), the policies and
    the users (idempotent: run again, the same state). ``admin`` is a
    ``minio.MinioAdmin``, ``client`` a ``minio.Minio``, both with administrator
    credentials. Returns one line per thing done, for the Job's log
    (never a secret)."""
    import tempfile

    from minio.versioningconfig import ENABLED, VersioningConfig

    done = []
    if not client.bucket_exists(bucket):
        client.make_bucket(bucket)
        done.append(f"bucket {bucket} made")
    if client.get_bucket_versioning(bucket).status != ENABLED:
        client.set_bucket_versioning(bucket, VersioningConfig(ENABLED))
        done.append(f"bucket {bucket}: versioning on")
    for name, document in policies_for(bucket, grants).items():
        with tempfile.NamedTemporaryFile("w", suffix=".json") as fh:
            json.dump(document, fh)
            fh.flush()
            admin.policy_add(name, fh.name)
        done.append(f"policy {name} set")
    for grant in grants:
        admin.user_add(grant.access_key, grant.secret_key.get_secret_value())
        _attach(admin, grant.policy, grant.access_key)
        done.append(f"user {grant.access_key}: {grant.policy}")
    return done


def _attach(admin: MinioAdmin, policy: str, user: str) -> None:
    """Attach ``policy`` to ``user``; attaching one already attached is not an error."""
    from minio.error import MinioAdminException

    try:
        admin.attach_policy([policy], user=user)
    except MinioAdminException as exc:
        if "already" not in str(exc).lower():
            raise


class GrantEntry(BaseModel):
    """One entry of ``FARM_ACCESS_GRANTS``: who (a pool's fingerprint, or a role) and the
    names of the environment variables holding its credentials, never the credentials."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    access_key_env: str = Field(min_length=1, max_length=200)
    secret_key_env: str = Field(min_length=1, max_length=200)
    fingerprint: str = Field(default="", max_length=100)
    reader: bool = False
    client: bool = False
    repair: bool = False
    #: left out, in one line, when both its variables are empty (the chart's repair
    #: user: a Secret made before the role existed does not hold its keys)
    optional: bool = False

    @property
    def role(self) -> str:
        """How this entry is named in a line: its role, or its pool's fingerprint."""
        for role in ("repair", "client", "reader"):
            if getattr(self, role):
                return role
        return f"pool {self.fingerprint or ANY_POOL}"


_ENTRIES = TypeAdapter(list[GrantEntry])
#: the grants made of the entries, by their index in ``FARM_ACCESS_GRANTS`` (an error
#: names the entry)
_GRANTS = TypeAdapter(dict[int, Grant])


def grants_from_env(environ: dict[str, str]) -> tuple[list[Grant], list[str]]:
    """``FARM_ACCESS_GRANTS``: a JSON list of :class:`GrantEntry`, naming the environment
    variables (filled from the Secret) that hold each user's credentials, so that no
    secret is ever in a value or an argument. Returns the grants, and one line for each
    ``optional`` entry left out because both its variables are empty; an entry that is
    not optional, or half given, is checked as any other. Raises ``ValidationError``
    (a malformed list or entry) whose location is the entry's index and the field."""
    entries = _ENTRIES.validate_json(environ.get("FARM_ACCESS_GRANTS", "[]"))
    given: dict[int, dict[str, Any]] = {}
    skipped = []
    for index, entry in enumerate(entries):
        access = environ.get(entry.access_key_env, "")
        secret = environ.get(entry.secret_key_env, "")
        if entry.optional and not access and not secret:
            skipped.append(f"{entry.role} user not made: {entry.access_key_env} and "
                           f"{entry.secret_key_env} are empty")
            continue
        given[index] = {"access_key": access, "secret_key": secret,
                        "fingerprint": entry.fingerprint or None, "reader": entry.reader,
                        "repair": entry.repair, "client": entry.client}
    grants = list(_GRANTS.validate_python(given).values())
    return grants, skipped


def main(argv: list[str] | None = None) -> int:
    """The set-up Job: apply ``FARM_ACCESS_GRANTS`` with the administrator credentials
    in ``FARM_MINIO_*``; ``--print BUCKET [FINGERPRINT...]`` prints the policies."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--print"] and len(args) >= 2:
        grants = [Grant(access_key="reader", secret_key=SecretStr("x" * 8), reader=True),
                  Grant(access_key="client", secret_key=SecretStr("x" * 8), client=True),
                  Grant(access_key="repair", secret_key=SecretStr("x" * 8), repair=True)]
        grants += [Grant(access_key=f"pool-{fp}", secret_key=SecretStr("x" * 8),
                         fingerprint=fp) for fp in args[2:]]
        print(json.dumps(policies_for(args[1], grants), indent=2))
        return 0
    from minio import Minio
    from minio.credentials import StaticProvider
    from minio.minioadmin import MinioAdmin

    from farm.core.errors import FarmError, SettingsError, one_line
    from farm.core.settings import load_settings
    from farm.store.minio import MinioStore
    from farm.store.open import open_store

    try:
        grants, skipped = grants_from_env(dict(os.environ))
    except ValidationError as exc:
        print(f"access: FARM_ACCESS_GRANTS: {one_line(exc)}", file=sys.stderr)
        return 2
    try:
        settings = load_settings()
        # validates the endpoint, makes the bucket
        store = open_store(settings, shared=True, signed=False)
        if not isinstance(store, MinioStore):
            store.close()
            raise SettingsError(f"access grants are MinIO's; the shared store is "
                                f"{store.location}")
    except FarmError as exc:
        print(f"access: {one_line(exc)}", file=sys.stderr)
        return 2
    access = settings.minio_access_key
    secret = settings.minio_secret_key
    assert access is not None and secret is not None  # the opening checked them
    admin = MinioAdmin(endpoint=store.endpoint, secure=store.secure,
                       credentials=StaticProvider(access.get_secret_value(),
                                                  secret.get_secret_value()))
    client = Minio(store.endpoint, access_key=access.get_secret_value(),
                   secret_key=secret.get_secret_value(), secure=store.secure)
    for line in [*apply(admin, client, settings.minio_bucket, grants), *skipped]:
        print(f"access: {line}")
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
