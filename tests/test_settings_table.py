"""The README's settings table names every setting, and only settings that exist.

The table is what a newcomer reads to configure the farm; a setting added to
``farm.core.settings.Settings`` without a row (six were missing once) is invisible, and a
row for a setting that was renamed or removed sends people to a variable nothing reads.
"""

from __future__ import annotations

import re
from pathlib import Path

from farm.core.settings import Settings

README = Path(__file__).resolve().parents[1] / "README.md"
#: a table row's first cell: one or more `FARM_X` names, separated by commas
ROW = re.compile(r"^\|\s*((?:`FARM_[A-Z0-9_]+`(?:,\s*)?)+)\s*\|")


def table_variables(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        found = ROW.match(line)
        if found:
            names.update(re.findall(r"`(FARM_[A-Z0-9_]+)`", found.group(1)))
    return names


def settings_variables() -> set[str]:
    prefix = str(Settings.model_config.get("env_prefix", ""))
    return {f"{prefix}{name}".upper() for name in Settings.model_fields}


def test_the_readme_table_names_every_setting_and_no_other() -> None:
    table = table_variables(README.read_text())
    model = settings_variables()
    assert not model - table, f"settings missing from README.md's table: {sorted(model - table)}"
    assert not table - model, f"rows for settings that do not exist: {sorted(table - model)}"


def test_the_table_parser_reads_single_and_shared_rows() -> None:
    """Rows like `` `FARM_A`, `FARM_B` `` name both; prose is not a row."""
    text = ("| `FARM_HOME` | x | y |\n| `FARM_A`, `FARM_B` | | z |\n"
            "The `FARM_C` setting, in prose.\n")
    assert table_variables(text) == {"FARM_HOME", "FARM_A", "FARM_B"}
