"""The farm's version, hashed into every build id."""

__version__ = "0.1.0"
