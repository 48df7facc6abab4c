"""Alembic migrations of dracap's PostgreSQL schema (run through ``migrations.runner``).

Database functions live in ``functions/<name>/<revision>.sql``, one file per version,
in full (see :mod:`migrations.sqlfiles`): to change a function, add its new version
file and a migration that installs it; no migration patches another's text.
"""
