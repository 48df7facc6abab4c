"""Every service login may read the schema's revision: ``SELECT`` on ``alembic_version``.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-16

Each release calls what its own migrations made (0015's ``dracap_try_lock``, for one),
and the upgrade order is "migrate first, then the services". A service started against a
database one migration behind used to run until its first call of something missing
(0015's reservation worker on a database at 0014: ``dracap_try_lock`` in every round). A
service now reads the revision when it opens the log and refuses to start on an older
schema, in one line that says to run ``dracap db upgrade``
(``services/runtime/store/schema.py``). To read it, its login needs ``SELECT`` on
alembic's one-row table; the node agents' group, which has no login (0012), gets
nothing. The revision names no data: it is what ``dracap db current`` prints.

The downgrade revokes it: a release before this one never reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Every group role a service logs in with (0006, 0007, 0009, 0010, 0011).
READERS = (
    "dracap_claims",
    "dracap_reservation",
    "dracap_relay",
    "dracap_readonly",
    "dracap_reclamation",
    "dracap_ledger",
    "dracap_snapshots",
    "dracap_enforcement",
)


def _roles() -> str:
    app = app_role()
    return ", ".join(quote(role) for role in (*READERS, *([app] if app else [])))


def upgrade() -> None:
    op.execute(f"GRANT SELECT ON alembic_version TO {_roles()}")


def downgrade() -> None:
    op.execute(f"REVOKE SELECT ON alembic_version FROM {_roles()}")
