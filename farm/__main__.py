"""``python -m farm`` is the ``farm`` command."""

from farm.cli.main import main

main()
