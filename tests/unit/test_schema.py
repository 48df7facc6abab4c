"""The schema revision a service needs at its start (``services/runtime/store/schema.py``)."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory

import migrations
from services.runtime.store.schema import SCHEMA_REVISION, behind


def _script() -> ScriptDirectory:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return ScriptDirectory.from_config(config)


def test_the_release_needs_the_newest_migration() -> None:
    assert _script().get_current_head() == SCHEMA_REVISION


def test_revisions_are_numbered_in_one_line() -> None:
    """What lets :func:`behind` compare revisions as numbers."""
    revisions = list(reversed(list(_script().walk_revisions())))
    assert [r.revision for r in revisions] == [f"{n:04d}" for n in range(1, len(revisions) + 1)]
    assert [r.down_revision for r in revisions] == [None, *(r.revision for r in revisions[:-1])]


def test_an_older_schema_is_refused_and_a_newer_one_served() -> None:
    older = f"{int(SCHEMA_REVISION) - 1:04d}"
    why = behind(older)
    assert why is not None
    assert f"at revision {older}, this release needs {SCHEMA_REVISION}" in why
    assert "dracap db upgrade" in why
    assert behind(SCHEMA_REVISION) is None
    assert behind(f"{int(SCHEMA_REVISION) + 1:04d}") is None  # a rolling upgrade: migrated first
    empty = behind(None)
    assert empty is not None and "no dracap schema" in empty
    foreign = behind("ae1027a6acf")
    assert foreign is not None and "'ae1027a6acf' is not one of dracap's" in foreign
