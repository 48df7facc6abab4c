"""Alembic migrations of dracap's PostgreSQL schema (run through ``services.runtime.migrating``)."""
