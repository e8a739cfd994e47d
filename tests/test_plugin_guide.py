"""docs/PLUGINS.md tells a plugin author what the code does: the family names already
taken, every field of ``Example`` (tolerances included) and of ``DeviceInfo``. A field
added to either, or a built-in family added, fails here until the guide says so."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from farm.core.device import DeviceInfo
from farm.families.base import Example
from farm.families.builtin import FAMILIES

GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "PLUGINS.md").read_text()


def _table_after(heading: str) -> set[str]:
    """The backquoted names in the first column of the table that follows ``heading``."""
    rest = GUIDE.split(heading, 1)[1]
    rows = [line for line in rest.split("\n\n")[1].splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


def test_the_guide_lists_the_family_names_taken() -> None:
    section = GUIDE.split("Names already taken", 1)[1].split("\n\n", 2)[1]
    assert set(re.findall(r"`([a-z_0-9]+)`", section)) == {f.name for f in FAMILIES}


def test_the_guide_documents_every_field_of_an_example() -> None:
    fields = {f.name for f in dataclasses.fields(Example)}
    assert _table_after("`farm.Example` has these fields:") == fields
    assert "`1e-4`, `1e-5`" in GUIDE  # the tolerances' defaults, as the code has them
    assert (Example.rtol, Example.atol) == (1e-4, 1e-5)
    assert "LocalMem(nbytes)" in GUIDE


def test_the_guide_documents_every_field_of_a_device() -> None:
    assert _table_after("is a `farm.DeviceInfo`") == set(DeviceInfo.model_fields)


def test_the_guide_says_what_launch_is() -> None:
    assert "`launch` a `farm.LaunchSettings`" in GUIDE
