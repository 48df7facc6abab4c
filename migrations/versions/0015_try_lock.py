"""A lone reservation worker keeps the planner lock between rounds: ``dracap_try_lock``.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-15

The reservation consumer took the planner lock (``dracap_lock``) for every message group
and gave it back as soon as it was idle: at low rates, where each claim is a group of its
own, two statements a claim and a round trip on its path. It now keeps the lock while
idle until someone asks for it. ``dracap_try_lock(key)`` (``functions/dracap_try_lock/
0015.sql``) is how one asks: it takes a free lock and returns the log's head as of the
grant (as ``dracap_lock`` does), and for a taken one announces on ``dracap_lock_wanted``
that this session waits, returning NULL; the caller then waits in ``dracap_lock``
(docs/services.md). Owned by ``dracap_owner``, executed by ``dracap_reservation`` (and the
app role) only, like ``dracap_lock``; not ``SECURITY DEFINER`` (it reads the head with its
caller's right).

The downgrade drops it: a release before this one never calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote
from migrations.sqlfiles import install

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "dracap_owner"
RESERVATION = "dracap_reservation"
TRY_LOCK = "dracap_try_lock(bigint)"


def upgrade() -> None:
    install("dracap_try_lock", revision)
    op.execute(f"ALTER FUNCTION {TRY_LOCK} OWNER TO {OWNER}")
    op.execute(f"REVOKE EXECUTE ON FUNCTION {TRY_LOCK} FROM PUBLIC")
    app = app_role()
    for role in (RESERVATION, *([app] if app else [])):
        op.execute(f"GRANT EXECUTE ON FUNCTION {TRY_LOCK} TO {quote(role)}")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {TRY_LOCK}")
