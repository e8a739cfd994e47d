"""``python -m farm`` is the ``farm`` command."""

from farm.cli.entry import main

main()
