"""The ``farm`` command line (typer). ``main`` turns every FarmError into one line."""
