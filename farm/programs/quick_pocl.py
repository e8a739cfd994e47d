"""The quick path on PoCL's CPU drivers: a program's work-group function records read,
held to the trust rule and merged into its binary, and what its launches make harvested,
without the program server.

Each record slot is read as the server reads it (:mod:`farm.programs.rows`: key,
family, size, digest; :func:`farm.programs.exactly.record_exactly`: the program, the
binary, the device, each function's kernel, specialisation, bytes and ELF symbol) and is
merged only when the node's proof book holds a good verdict for that record merged into
that program (:class:`~farm.compilation.proofs.Claim`, kind ``functions``), as the server
would have noted it. A record of another binary of the program is skipped (its slot
stays taken), as the server skips it. Anything else (a record refused, one the node has
not proven, a binary that does not walk) is the server's: the quick path declines the
build, and the server proves, or quarantines and says so. Only the harvest's store loads
the records' models, the server's store and the MinIO SDK, and only when a harvest has
something to store.
"""

from __future__ import annotations

from collections import namedtuple

from farm.compilation.poclbin import PoclBinaryError, build_hash, kernel_files
from farm.compilation.proofs import Claim, ProofBook
from farm.core.keys import (
    PROGRAM_FUNCTION_SLOTS,
    PROGRAM_FUNCTIONS_FAMILY,
    program_functions_id,
)
from farm.programs.exactly import record_exactly
from farm.programs.headers import StaleRecord, SupplementError
from farm.programs.prepared import merge
from farm.programs.program_key import PROGRAM_BUILD_ID
from farm.programs.rows import Unchecked

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from farm.programs.harvest import Harvester
    from farm.programs.prepared import Prepared
    from farm.programs.rows import Rows
    from farm.store.base import ArtifactStore

    #: the node's verdict on a claim, waited for where the prover ahead proves ``key``
    Verdict = Callable[[Claim, str], "str | None"]

#: a record to merge (:func:`farm.programs.prepared.merge`): its tier (1: MinIO, kept in
#: the local tier once its program loaded), (its key id, its row), its functions
_Record = namedtuple("_Record", "tier art functions")


class Records:
    """The records side of the quick path in one process (thread-safe where it must be:
    the harvester is)."""

    def __init__(self, rows: Rows, harvest_store: Callable[[], ArtifactStore],
                 warn: Callable[[str], None], book: ProofBook) -> None:
        self._rows = rows
        self._book = book
        self._harvest_store = harvest_store
        self._warn = warn
        self._harvester: Harvester | None = None

    def prepare(self, fingerprint: str, key: str, binary: bytes, digest: str,
                verdict: Verdict) -> Prepared | None:
        """``binary`` (``key``'s stored program, of artifact digest ``digest``) with its
        proven records merged; ``None`` to decline (see the module docstring)."""
        try:
            base = build_hash(binary)
            kernels = frozenset(kernel_files(binary))
        except PoclBinaryError:
            return None
        program = f"{key}.{PROGRAM_BUILD_ID}"
        proven: list[_Record] = []
        next_slot = 0
        for slot in range(PROGRAM_FUNCTION_SLOTS):
            rec_id = program_functions_id(program, slot)
            try:
                found = self._rows.read(fingerprint, rec_id, PROGRAM_BUILD_ID,
                                        PROGRAM_FUNCTIONS_FAMILY)
            except Unchecked:
                return None  # the server's to read (and refuse)
            if found is None:
                break
            row, meta = found
            next_slot = slot + 1
            try:
                functions = record_exactly(row.binary, program, base, fingerprint, kernels)
            except StaleRecord:
                continue
            except SupplementError:
                return None  # the server quarantines it and says so
            claim = Claim("functions", fingerprint, str(meta["digest"]), merged=(digest,))
            if verdict(claim, key) != "":
                return None
            proven.append(_Record(1 if row.remote else 0, (rec_id, row), functions))
        try:
            return merge(binary, base, proven, next_slot)
        except PoclBinaryError:
            return None

    def watch(self, fingerprint: str, key: str, prep: Prepared, source_hash: str,
              digest: str, handle: object) -> None:
        """Harvest what ``handle``'s launches make (see :mod:`farm.programs.harvest`);
        ``digest``: the program artifact's."""
        from farm.core.keys import Namespace

        if self._harvester is None:
            from farm.programs.harvest import Harvester

            self._harvester = Harvester(self._harvest_store, self._warn, book=self._book)
        self._harvester.watch(Namespace.for_fingerprint(fingerprint),
                              f"{key}.{PROGRAM_BUILD_ID}", prep, source_hash, handle, digest)

    def close(self) -> None:
        """The last harvest (the process ends)."""
        harvester, self._harvester = self._harvester, None
        if harvester is not None:
            harvester.close()

