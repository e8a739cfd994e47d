"""``farm keygen``: a key pair for signed artifacts (see ``farm.store.signing``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from farm.cli.console import out
from farm.core.errors import InputError


def keygen(out_file: Annotated[Path, typer.Argument(
        metavar="OUT_FILE",
        help="where to write the private key (mode 0600); give it to writers only")]) -> None:
    """Write an Ed25519 signing key and print its public key.

    Writers (workers, build clients) get FARM_SIGNING_KEY from that file (through a
    secret); loaders get FARM_VERIFY_KEY=<the printed public key>.
    """
    from farm.store.signing import generate_keypair

    if out_file.exists():
        raise InputError(f"{out_file}: exists; refusing to overwrite a key")
    private, public = generate_keypair()
    fd = os.open(out_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(private + "\n")
    out.print(f"private key written to {out_file} (mode 0600): FARM_SIGNING_KEY for writers",
              markup=False, soft_wrap=True)
    out.print(f"FARM_VERIFY_KEY={public}", markup=False, soft_wrap=True)
