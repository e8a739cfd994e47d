"""An application's programs in a chunk: the task payload a worker takes.

The cluster's payload (:class:`farm.cluster.payloads.CompileRequest`) carries kernels;
a chunk can carry programs too, each as its :class:`~farm.programs.spec.ProgramSpec`
(digests and options, never the source, which the worker reads from the store by digest;
the worker computes the key itself). The programs build on the cluster's client (they
send such chunks: :mod:`farm.programs.prebuild`, :mod:`farm.programs.remote`), so the
payload that names them is theirs, and the cluster never imports the programs. A worker
parses every chunk as a :class:`ChunkRequest` (a kernels-only payload is one too).
"""

from __future__ import annotations

from pydantic import Field

from farm.cluster.payloads import CompileRequest
from farm.core.model import Frozen
from farm.programs.capture import MAX_PROGRAM_LAUNCHES
from farm.programs.spec import ProgramSpec
from farm.programs.supplements import Launched


class ProgramRequest(Frozen):
    spec: ProgramSpec
    #: the work-group functions a capture's launches needed on the chunk's device (PoCL):
    #: the worker makes those the program's records lack (``farm.programs.making``)
    launches: tuple[Launched, ...] = Field(default=(), max_length=MAX_PROGRAM_LAUNCHES)


class ChunkRequest(CompileRequest):
    """One chunk of kernels and programs for one fingerprint."""

    programs: list[ProgramRequest] = Field(default_factory=list, max_length=1024)

    def entries(self) -> int:
        return len(self.kernels) + len(self.programs)
