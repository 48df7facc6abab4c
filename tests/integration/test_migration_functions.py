"""Every migration installs exactly the database functions it always installed.

The safety net of the "one file per function version" layout (``migrations/functions/``):
one fresh database is migrated up one revision at a time, then down one revision at a
time to the base; after each step the ``pg_get_functiondef`` of every ``dracap_*``
function but the generated payload checks is recorded and compared with
``tests/fixtures/function_defs/<revision>.json`` (keys ``upgrade``: the database
upgraded to that revision, ``downgrade``: downgraded to it from the next one). The
fixtures were produced by the migrations as they were before their functions moved into
files, so a refactor must reproduce them exactly; a new migration adds its revision's
file.

Regenerate (only when a migration's functions are meant to change, i.e. for a new
revision): ``DRACAP_REGENERATE_FUNCTION_DEFS=1 pytest`` on this file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import asyncpg
from alembic.config import Config
from alembic.script import ScriptDirectory

import migrations
from migrations import runner as migrating
from services.runtime.ground.settings import Settings
from services.runtime.store import payloadchecks
from tests.fixtures.services import APP_ROLE

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "function_defs"
REGENERATE = os.environ.get("DRACAP_REGENERATE_FUNCTION_DEFS") == "1"

_DEFINITIONS = """
SELECT p.oid::regprocedure::text AS signature, pg_get_functiondef(p.oid) AS definition
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE p.proname LIKE 'dracap%' AND n.nspname NOT IN ('pg_catalog', 'information_schema')
ORDER BY 1
"""


def _revisions() -> list[str]:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    script = ScriptDirectory.from_config(config)
    return [r.revision for r in reversed(list(script.walk_revisions()))]


#: The generated payload checks (``dracap_payload_checks.sql``) follow today's catalog at
#: 0011 and 0012 alike: ``tests/unit/test_payload_checks.py`` guards them, not this file.
_GENERATED = frozenset(name.split("(")[0] for name in payloadchecks.function_names())


async def _definitions(url: str) -> dict[str, str]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(_DEFINITIONS)
    finally:
        await connection.close()
    return {
        row["signature"]: row["definition"]
        for row in rows
        if row["signature"].split("(")[0] not in _GENERATED
    }


async def test_each_revision_installs_the_recorded_functions(empty_database_url: str) -> None:
    settings = Settings(database_url=empty_database_url, app_role=APP_ROLE)
    revisions = _revisions()
    recorded: dict[str, dict[str, dict[str, str]]] = {r: {} for r in revisions}
    for revision in revisions:
        assert await migrating.upgrade_async(settings, revision) == revision
        recorded[revision]["upgrade"] = await _definitions(empty_database_url)
    for revision in reversed(revisions[:-1]):
        assert await migrating.downgrade_async(settings) == revision
        recorded[revision]["downgrade"] = await _definitions(empty_database_url)
    recorded[revisions[-1]]["downgrade"] = recorded[revisions[-1]]["upgrade"]

    if REGENERATE:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        for revision, states in recorded.items():
            text = json.dumps(states, indent=1, sort_keys=True) + "\n"
            (FIXTURES / f"{revision}.json").write_text(text)
    missing = [r for r in revisions if not (FIXTURES / f"{r}.json").exists()]
    assert not missing, f"no recorded functions for {missing}: regenerate (see the docstring)"
    for revision in revisions:
        expected = json.loads((FIXTURES / f"{revision}.json").read_text())
        for state in ("upgrade", "downgrade"):
            got, want = recorded[revision][state], expected[state]
            assert sorted(got) == sorted(want), f"{revision} {state}: other functions"
            for signature in want:
                assert got[signature] == want[signature], f"{revision} {state}: {signature} differs"
