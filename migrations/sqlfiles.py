"""The database functions' SQL, one file per version: ``functions/<name>/<revision>.sql``.

Every version of every function a migration installs, on its way up or down, lives in
full in the file of the revision that introduced it (``<name>`` is the function, or
the small family of functions that always change together, e.g. ``dracap_quantity``);
each file is one ``CREATE OR REPLACE FUNCTION`` statement list. A migration installs a
named version (:func:`install`); no migration builds a function from another
migration's text. To change a function: add ``<name>/<new revision>.sql`` holding the
whole new text and a migration that installs it (its downgrade installs the previous
version's file). Files are never edited once a release has them: a database migrated
earlier ran their text (``tests/integration/test_migration_functions.py`` holds every
revision's installed definitions). No percent signs in the SQL: the migration driver
treats them as placeholders.

The one exception is ``functions/dracap_payload_checks.sql``, generated from the event
catalog by ``services.runtime.store.payloadchecks`` (its own test guards it).
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

FUNCTIONS = Path(__file__).resolve().parent / "functions"


def function_sql(name: str, revision: str) -> str:
    """The text of ``functions/<name>/<revision>.sql``, as one statement list."""
    path = FUNCTIONS / name / f"{revision}.sql"
    return path.read_text().rstrip().rstrip(";")


def install(name: str, revision: str) -> None:
    """Run version ``revision`` of ``name`` (its ``CREATE OR REPLACE FUNCTION``)."""
    op.execute(function_sql(name, revision))


def generated_sql(name: str) -> str:
    """The text of a generated file ``functions/<name>.sql`` (the payload checks)."""
    return (FUNCTIONS / f"{name}.sql").read_text().rstrip().rstrip(";")
