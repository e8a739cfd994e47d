"""The compile path: lower, source, finalize, load, store; one kernel or a batch.

:mod:`.batch` obtains many kernels (Loaded, Rekeyed or Compiled); :mod:`.finalize` is the
only caller of the platform compiler; :mod:`.load` makes programs from binaries;
:mod:`.native` and :mod:`.cuda` turn NVIDIA's PTX into cubins; :mod:`.pool` and
:mod:`.compiler` run finalize on a crash-safe process pool; :mod:`.rekey` is the rule for
reusing a source stored under another key; :mod:`.local` wires the embedded default. The
cluster's client side (:mod:`farm.cluster`) and the workers build on this package, never
the other way round.
"""
