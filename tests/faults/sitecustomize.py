"""Arms the fault-injection family in every process started with this folder on
``PYTHONPATH`` and ``FARM_FAULT_INJECT=1`` (see ``faultfam``)."""

import os

if os.environ.get("FARM_FAULT_INJECT") == "1":
    import faultfam

    faultfam.arm()
