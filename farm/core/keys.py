"""Every name the farm gives to shared state: namespaces, object paths, Redis keys,
stream names and queue names. Nothing else in the code spells one out.

Namespace::

    <backend>/<store format version>/<device fingerprint>
    e.g. opencl/v1/pocl-pthread-intel-r-xeon-r-processor-6221550b06de

Object store (MinIO), one bucket (``FARM_MINIO_BUCKET``)::

    <namespace>/artifacts/<id hash>/<build id>     framed artifact: full metadata JSON, then
                                                  the binary; short fields also in headers
    <namespace>/sources/<source hash>              source index entry: the key (text)
    <namespace>/quarantine/<id hash>/<build id>/<digest>
                                                  an artifact proven bad on its own device,
                                                  moved aside: why and when (JSON), then
                                                  the artifact's frame (evidence)
    blobs/<sha256>                                 content-addressed bytes: an OpenCL
                                                  program's source or a header it
                                                  includes (farm.programs), shared by
                                                  every namespace (sources are not
                                                  device-specific); the name is the
                                                  SHA-256 of the body, checked on read

A namespace is ``NAMESPACE_LEVELS`` names deep, so the namespaces of a bucket are found
by listing that many levels of common prefixes (:func:`namespace_from_prefix`).

Embedded files, per environment (``<FARM_HOME>/envs/<name>/``): ``store.sqlite`` (the
artifact store), ``records.sqlite`` (the records storage).

SQLite store: table ``artifacts`` with columns (namespace, id_hash, build_id, ...),
``sources`` (namespace, source_hash, id_hash, build_id), ``quarantine`` (namespace,
id_hash, build_id, digest, reason, at, meta, binary): the namespace is a column; and
``blobs`` (digest, size, data): the content-addressed sources and headers of programs.

Programs (``farm.programs``: OpenCL programs an application builds from its own source)
are artifacts like any other, under ``<namespace>/artifacts/<program key>/<program build
id>`` with family :data:`PROGRAM_FAMILY`. On PoCL the work-group functions their launches
made are stored beside them as artifacts of family :data:`PROGRAM_FUNCTIONS_FAMILY`, in
the same namespace, slot by slot (:func:`program_functions_key`: 62 digits of a SHA-256
of the program's key, then the slot number in two). The
program key is a SHA-256 over the source's digest, the normalised build options and the
digests of every header the source can include (``farm.programs.spec``); the
fingerprint is in the namespace. ``blobs/`` sits one level above the namespaces, so a
namespace listing (three levels of prefixes) never mistakes it for one.

Tuning results (``farm.tuning``) are artifacts too, of family :data:`TUNING_FAMILY`, under
``<namespace>/artifacts/<tuning id>/<family build id>``: their bytes are the result's
JSON (every candidate's figures and the winner), digest-verified, signed where signing
is configured and bound to the device's namespace like any binary, carried by bundles.
The tuning id hashes the family, the problem (the parameters that are not tuning
choices), launch, variant and the digest of the candidate list
(:func:`farm.tuning.keys.TuningSpec.key`). Beside each, the problem's latest tuning
whatever its candidate list, under family :data:`TUNING_INDEX_FAMILY` and the problem's
own id (what ``KernelLoader.tuned(family, problem)`` reads). Neither is code: nothing
loads them on a device (:data:`DATA_FAMILIES`).

Host-wide lock files of measurement isolation (``farm.core.isolation``), in
``FARM_ISOLATION_DIR``: ``gate-<resource>.lock`` and ``use-<resource>.lock``, resource
``cpu`` or ``device-<fingerprint>-<platform>-<device>``.

Redis (broker and farm state)::

    farm:lease:<namespace>:<source hash>          in-flight compile lease (TTL, renewed)
    farm:workers:<fingerprint>                    hash host:pid -> worker description
    farm:records:<kind>                           records stream, e.g. farm:records:sessions,
                                                  farm:records:compilation,
                                                  farm:records:compilation_batch,
                                                  farm:records:tune
    farm:records:group                            consumer group name of the ingesters
    farm:records:dead                             records stream entries that do not validate
                                                  (kept for a person to read, never retried)
    farm:dead                                     list of task messages a worker refused as
                                                  malformed (JSON: reason, headers, body)
    farm:task:<task id>:deliveries                how often a compile task was started (TTL)
    farm:task:<task id>:kernel                    the kernel it is working on now and the
                                                  compile lease taken for it (id hash, lease
                                                  name, token; ``farm.cluster.lease``)
    farm:task:<task id>:crashes                   hash id hash -> times its compiling process
                                                  died; field ``status`` the last exit status
    farm:task:<task id>:holder                    the worker (host:pid) holding the task
    farm:task:<task id>:returns                   hash worker (host:pid) -> times it gave the
                                                  chunk back (infrastructure); ``why`` the last
                                                  reason (TTL)
    farm:build:<build token>:alive                a build client's heartbeat (TTL): a chunk of
                                                  a build without it is dropped, not compiled
    farm:build:<build token>:avoid                set of workers (host:pid) the client stopped
                                                  sending to (its circuit breaker; TTL)
    farm:build:<build token>:returns              hash worker -> chunks of the build it gave
                                                  back; ``why:<worker>`` its last reason (TTL)

A record of kind ``records/v<N>/<name>`` travels on ``farm:records:<name>``
(:func:`records_stream_for`): the stream has no version in its name, the entry carries
its kind, so a kind's later format version shares its stream (see docs/RECORDS.md).

Records stream entries (flat string fields; ``v`` is the envelope version,
``farm.records.stream``)::

    farm:records:sessions      v=1  session (JSON), keep_sessions (number or "")
    farm:records:<kind>        v=2  kind, records (JSON array of 1 to 4096 records of
                                    that kind, in seq order, at most 8 KB: a pack, one
                                    per kind per send)
                               v=1  kind, record (one JSON record: producers before
                                    packs; still read)
    farm:records:dead          the entry's fields as they came, plus dead:stream,
                               dead:id, dead:error (dead:newer="1" when a newer farm
                               may read it); a record set aside from a pack alone is a
                               v=1 entry plus dead:index, its place in the pack

Celery queues: ``farm.<fingerprint>`` (one per fingerprint), Redis lists of that name;
``farm.default`` (the app's default, consumed by nobody); ``unacked`` (kombu's hash of
delivered, unacknowledged messages). The tasks: ``farm.compile`` (a chunk of kernels)
and ``farm.tune`` (one tuning key, measured on the worker's device).

Records storage: kind ``records/v1/<kind>`` keyed by (session, seq).

Why the fingerprint is in the namespace and never a file path built from input: it is
what keeps a binary from ever reaching the wrong device, in a store or in a bundle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from farm.core.hashing import sha256_hex

#: typing.TYPE_CHECKING without importing typing: this module imports nothing of pydantic
#: (a served application's quick path names its objects with it; farm.programs.quick)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    from farm.core.model import Key

    class KeyLike(Protocol):
        """A :class:`~farm.core.model.Key`, or anything else naming one (the quick path's
        keys are plain tuples: :mod:`farm.programs.quick`)."""

        @property
        def id_hash(self) -> str: ...

        @property
        def build_id(self) -> str: ...

BACKEND = "opencl"
STORE_FORMAT = "v1"

#: ``fullmatch``: ``$`` with ``re.match`` would let a trailing newline through
_FINGERPRINT = re.compile(r"[a-z0-9][a-z0-9-]{0,99}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


_BACKEND = re.compile(r"[a-z0-9]{1,32}")
_FORMAT = re.compile(r"v[0-9]{1,6}")


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """Where artifacts for one device live; compared and hashed as a value. A dataclass
    checked when made, not a pydantic model, so that naming a stored object imports no
    pydantic (it never crosses a boundary as a model: it is text, parsed here)."""

    backend: str = BACKEND
    format: str = STORE_FORMAT
    fingerprint: str

    def __post_init__(self) -> None:
        for value, rule, what in ((self.backend, _BACKEND, "a backend name"),
                                  (self.format, _FORMAT, "a store format version"),
                                  (self.fingerprint, _FINGERPRINT, "a device fingerprint")):
            if not isinstance(value, str) or not rule.fullmatch(value):
                raise ValueError(f"not {what}: {value!r:.120}")

    def __str__(self) -> str:
        return f"{self.backend}/{self.format}/{self.fingerprint}"

    @classmethod
    def parse(cls, text: str) -> Namespace:
        if not isinstance(text, str):  # a damaged row, a JSON null
            raise ValueError(f"not a namespace: {text!r:.60}")
        parts = text.split("/")
        if len(parts) != 3:
            raise ValueError(f"not a namespace (backend/format/fingerprint): {text!r}")
        return cls(backend=parts[0], format=parts[1], fingerprint=parts[2])

    @classmethod
    def for_fingerprint(cls, fingerprint: str) -> Namespace:
        return cls(fingerprint=fingerprint)


# -- object store --------------------------------------------------------------------------
def namespace_prefix(ns: Namespace | None) -> str:
    """Everything of one namespace in the bucket (``<ns>/``), or of every namespace of
    this backend and store format (``opencl/v1/``) for ``None``: what a pool's MinIO
    policy lets it write (farm/cluster/access.py)."""
    return f"{ns}/" if ns is not None else f"{BACKEND}/{STORE_FORMAT}/"


def artifact_object(ns: Namespace, key: KeyLike) -> str:
    return f"{ns}/artifacts/{key.id_hash}/{key.build_id}"


def artifacts_prefix(ns: Namespace) -> str:
    return f"{ns}/artifacts/"


def source_object(ns: Namespace, source_hash: str) -> str:
    return f"{ns}/sources/{source_hash}"


def quarantine_object(ns: Namespace, key: Key, digest: str) -> str:
    """Where an artifact proven bad on its own device is kept (one per digest)."""
    return f"{ns}/quarantine/{key.id_hash}/{key.build_id}/{digest}"


def quarantine_prefix(ns: Namespace) -> str:
    return f"{ns}/quarantine/"


#: how many ``/``-separated names a namespace spans at the front of an object name
NAMESPACE_LEVELS = 3


def namespace_from_prefix(prefix: str) -> Namespace | None:
    """The namespace a listing prefix such as ``opencl/v1/<fingerprint>/`` names; ``None``
    for a prefix of another layout (a foreign object in the bucket is skipped, not fatal)."""
    text = prefix.removesuffix("/")
    if text.count("/") != NAMESPACE_LEVELS - 1:
        return None
    try:
        return Namespace.parse(text)
    except ValueError:
        return None


def key_from_artifact_object(ns: Namespace, name: str) -> Key | None:
    """Inverse of :func:`artifact_object`; ``None`` for a name of another layout."""
    prefix = artifacts_prefix(ns)
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix):].split("/")
    if len(parts) != 2:
        return None
    from farm.core.model import Key

    try:
        return Key(id_hash=parts[0], build_id=parts[1])
    except ValueError:
        return None


BLOBS_PREFIX = "blobs/"

#: the family name program artifacts are stored under (never a registered family's)
PROGRAM_FAMILY = "program"
#: the family name of a program's work-group function records (farm.programs.supplements)
PROGRAM_FUNCTIONS_FAMILY = "program-wg"
#: records a program may have (slots 0 to this - 1)
PROGRAM_FUNCTION_SLOTS = 32


def program_functions_key(program: Key, slot: int) -> Key:
    """The key of slot ``slot`` of ``program``'s work-group function records. It depends
    on the program's key alone, so a reader asks for the first slots while the program's
    own artifact is still on its way (each record names the binary it belongs to). Every
    slot of a program shares the first 62 digits: one listing of that prefix finds them."""
    from farm.core.model import Key

    return Key(id_hash=program_functions_id(str(program), slot), build_id=program.build_id)


def program_functions_id(program: str, slot: int) -> str:
    """The ``id`` of :func:`program_functions_key` (``program``: the key as text), without
    the key's model (a served application's quick path)."""
    if not 0 <= slot < PROGRAM_FUNCTION_SLOTS:
        raise ValueError(f"slot {slot} outside 0..{PROGRAM_FUNCTION_SLOTS - 1}")
    digest = sha256_hex(f"{PROGRAM_FUNCTIONS_FAMILY}\n{program}")
    return f"{digest[:62]}{slot:02x}"


#: the family name tuning results are stored under (farm.tuning; never a registered
#: family's): the JSON of one tuning key's measurement
TUNING_FAMILY = "tune"
#: the family name of a problem's latest tuning, whatever its candidate list
TUNING_INDEX_FAMILY = "tune-index"
#: the family of an application's plan: the programs it builds on a device fingerprint
#: (farm.programs.plan), in that fingerprint's namespace
PLAN_FAMILY = "program-plan"
#: stored families whose bytes are data, not a binary: never loaded on a device (a
#: bundle import does not validate them in a child), read and checked by their reader
DATA_FAMILIES = frozenset({TUNING_FAMILY, TUNING_INDEX_FAMILY, PLAN_FAMILY})


def blob_object(digest: str) -> str:
    """The object holding the bytes whose SHA-256 is ``digest`` (64 hex digits)."""
    if not _SHA256.fullmatch(digest):
        raise ValueError(f"not a SHA-256 digest: {digest!r:.80}")
    return f"{BLOBS_PREFIX}{digest}"


def digest_from_blob_object(name: str) -> str | None:
    """Inverse of :func:`blob_object`; ``None`` for a name of another layout."""
    digest = name.removeprefix(BLOBS_PREFIX)
    return digest if name.startswith(BLOBS_PREFIX) and _SHA256.fullmatch(digest) else None


# -- redis ---------------------------------------------------------------------------------
def lease_key(ns: Namespace, source_hash: str) -> str:
    return f"farm:lease:{ns}:{source_hash}"


def workers_key(fingerprint: str) -> str:
    return f"farm:workers:{fingerprint}"


WORKERS_PATTERN = "farm:workers:*"


def records_stream(kind: str) -> str:
    """Stream of one record kind (``sessions``, ``compilation``, ``compilation_batch``)."""
    return f"farm:records:{kind}"


RECORDS_GROUP = "farm:records:group"

RECORDS_SESSIONS_STREAM = records_stream("sessions")
"""Stream of the sessions (one entry when a session first changes something)."""

RECORDS_DEAD_STREAM = records_stream("dead")
"""Where the ingester sets aside stream entries that do not validate, so that one bad
entry neither blocks the others nor is retried for ever."""


def records_stream_for(kind: str) -> str:
    """Stream of a record kind given by its storage name (``records/v1/compilation``)."""
    return records_stream(kind.rsplit("/", 1)[-1])


DEAD_LETTERS = "farm:dead"
"""Task messages refused as malformed, newest first: one JSON object each with the
reason, the headers and the (cut) body, for a person to read; never retried."""

#: how long the per-task bookkeeping below lives (a day: far longer than any build)
TASK_STATE_TTL_S = 24 * 3600


def task_deliveries_key(task_id: str) -> str:
    return f"farm:task:{task_id}:deliveries"


def task_kernel_key(task_id: str) -> str:
    return f"farm:task:{task_id}:kernel"


def task_crashes_key(task_id: str) -> str:
    return f"farm:task:{task_id}:crashes"


#: the field of ``task_crashes_key``'s hash that holds the exit status of the last pool
#: process that died on the task (``signal 9 (SIGKILL)``); the other fields count crashes
#: by kernel
CRASHES_STATUS = "status"


def task_holder_key(task_id: str) -> str:
    return f"farm:task:{task_id}:holder"


def task_returns_key(task_id: str) -> str:
    return f"farm:task:{task_id}:returns"


#: the field of ``task_returns_key``'s hash that holds the last reason
RETURNS_WHY = "why"


def build_alive_key(build: str) -> str:
    return f"farm:build:{build}:alive"


def build_avoid_key(build: str) -> str:
    return f"farm:build:{build}:avoid"


def build_returns_key(build: str) -> str:
    return f"farm:build:{build}:returns"


def build_replies_key(build: str) -> str:
    """The build's reply stream: its client makes it (and keeps it alive like
    ``build_alive_key``), each worker appends a chunk's reply to it, only while it
    exists (``XADD ... NOMKSTREAM``); docs/DESIGN.md, "Replies"."""
    return f"farm:build:{build}:replies"


#: the value of ``build_alive_key`` once the build's client shut a worker out (its
#: circuit breaker): a worker then looks in ``build_avoid_key``; "1" otherwise
BUILD_AVOIDS = "avoid"


# -- embedded files and the bucket ------------------------------------------------------------
#: an environment's artifact store and records storage, in ``<FARM_HOME>/envs/<name>/``
STORE_FILE = "store.sqlite"
RECORDS_FILE = "records.sqlite"
#: the MinIO bucket when FARM_MINIO_BUCKET does not name one
DEFAULT_BUCKET = "kernel-farm"

#: FARM_ENVIRONMENT unless set
DEFAULT_ENVIRONMENT = "default"


# -- records ---------------------------------------------------------------------------------
def record_kind(name: str) -> str:
    """The storage name of a record kind, format version included (``records/v1/<name>``)."""
    return f"records/v1/{name}"


# -- celery ----------------------------------------------------------------------------------
QUEUE_PREFIX = "farm."
#: the app's default queue, which no worker consumes (every task names its fingerprint's)
DEFAULT_QUEUE = f"{QUEUE_PREFIX}default"
#: the compile task a worker runs; a message naming no task of the worker's is refused
#: as malformed
TASK_NAME = "farm.compile"
#: the tuning task: one tuning key, measured on the worker's device (farm.tuning)
TUNE_TASK_NAME = "farm.tune"


def queue_name(fingerprint: str) -> str:
    return f"{QUEUE_PREFIX}{fingerprint}"


def queue_fingerprint(queue: str) -> str | None:
    """Inverse of :func:`queue_name`; ``None`` for another queue (``farm.default``)."""
    if not queue.startswith(QUEUE_PREFIX):
        return None
    fp = queue[len(QUEUE_PREFIX):]
    return fp if _FINGERPRINT.match(fp) and fp != "default" else None


#: Redis keys of Celery's queues (kombu's Redis transport keeps each queue as a list
#: named after it, and a priority's messages in ``<queue>\x06\x16<priority>``)
QUEUE_PATTERN = f"{QUEUE_PREFIX}*"
QUEUE_PRIORITY_SEP = "\x06\x16"
#: kombu's hash of delivered, unacknowledged messages (late acks: chunks in flight)
CELERY_UNACKED = "unacked"

