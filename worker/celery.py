"""The module-level Celery app, for Celery's own command line and for Flower.

``celery -A worker <command>`` finds this module (Celery looks for ``<package>.celery``)
and its ``app``, configured from the ``FARM_*`` settings like every farm process::

    celery -A worker inspect ping
    celery -A worker inspect active
    celery -A worker events
    celery -A worker flower        # pip install flower (or the 'test' extra)

Everything else gets its app from :func:`farm.cluster.celery_app.make_app` with settings passed
explicitly; this module exists only for those command lines, and reads the environment
once, when Celery imports it.
"""

from __future__ import annotations

from farm.cluster.celery_app import make_app
from farm.core.settings import load_settings

app = make_app(load_settings())
