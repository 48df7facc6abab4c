"""The schema revision this release needs, checked when a service opens the log.

Upgrades go "migrate first, then the services" (docs/operations.md). A service of a
newer release started against a database its migrations have not reached yet used to
run until its first call of something missing (a reservation worker of 0015 on a
database at 0014 would call ``dracap_try_lock``, not there, in every round). Every
service process now reads the database's revision (alembic's ``alembic_version``, which
every service login may read since migration 0016) right after it opens the log
(:func:`services.runtime.hosting.storehosting.serving`) and refuses to start below
:data:`SCHEMA_REVISION`, in one line naming both revisions and the command to run.

A revision *above* this release's is accepted: during a rolling upgrade the database is
migrated first, and the services of the release before keep serving on it until each is
restarted — every migration keeps what the release before it calls. Revisions are
numbered ``0001``, ``0002``, … in one line of history (``tests/unit/test_schema.py``
holds :data:`SCHEMA_REVISION` to alembic's head), so older and newer compare as numbers;
a revision that is not a number is none of this project's and is refused.
"""

from __future__ import annotations

from typing import Final

import asyncpg

from services.runtime.ground.errors import PermanentError

__all__ = ["SCHEMA_REVISION", "SchemaBehind", "require_schema"]

#: The newest migration this release's code relies on: alembic's head.
SCHEMA_REVISION: Final = "0016"

_UPGRADE: Final = "run `dracap db upgrade` (as the database's owner) first"


class SchemaBehind(PermanentError):  # noqa: N818 (a condition, like NotFound)
    """The database's schema is older than this release needs (or not dracap's)."""


def behind(revision: str | None) -> str | None:
    """Why a database at ``revision`` cannot serve this release (``None``: it can)."""
    if revision is None:
        return f"the database has no dracap schema; {_UPGRADE}"
    if not revision.isdigit():
        return f"the database's schema revision {revision!r} is not one of dracap's"
    if int(revision) < int(SCHEMA_REVISION):
        return (
            f"the database's schema is at revision {revision}, this release needs "
            f"{SCHEMA_REVISION}; {_UPGRADE}"
        )
    return None


async def require_schema(pool: asyncpg.Pool) -> None:
    """Raise :class:`SchemaBehind` unless the database is at :data:`SCHEMA_REVISION` or
    later (asyncpg's errors for a database that cannot be reached pass through)."""
    try:
        revision: str | None = await pool.fetchval("SELECT version_num FROM alembic_version")
    except asyncpg.UndefinedTableError:
        revision = None
    except asyncpg.InsufficientPrivilegeError:  # granted by 0016: a schema before it
        raise SchemaBehind(
            f"the database's schema is older than revision {SCHEMA_REVISION} (this login "
            f"may not read its revision); {_UPGRADE}"
        ) from None
    why = behind(revision)
    if why is not None:
        raise SchemaBehind(why)
