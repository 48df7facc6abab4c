"""The snapshot writer's role ``dracap_snapshots``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-09

The snapshot writer (``dracap replay snapshot``, and the one inside ``dracap up``;
``services/runtime/store/snapshots.py``) folds the log and stores the fold in ``snapshots``,
then prunes all but the newest few. No role of 0006 or 0009 may write that table (they
read it), so until now the writer ran as the database's administrator. ``dracap_snapshots``
reads the log and may ``SELECT, INSERT, UPDATE, DELETE`` on ``snapshots`` (``UPDATE``: a
second snapshot at the same position replaces the first, ``INSERT ... ON CONFLICT DO
UPDATE``; ``DELETE``: the pruning) — and nothing else: no guard table, no consumer table,
no append. A wrong snapshot can only make a start slower, never wrong: every start checks
the one it loads against the log (``verify_snapshot``) and falls back to an older one.
No table changes; the app role of 0001 has had DML on ``snapshots`` all along.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import ensure_group_role_sql, quote

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SNAPSHOTS = "dracap_snapshots"
GRANTS = (
    ("SELECT", "events"),
    ("SELECT", "event_log_head"),
    ("SELECT, INSERT, UPDATE, DELETE", "snapshots"),
)


def upgrade() -> None:
    op.execute(ensure_group_role_sql(SNAPSHOTS))
    q = quote(SNAPSHOTS)
    op.execute(f"GRANT USAGE ON SCHEMA public TO {q}")
    for privileges, table in GRANTS:
        op.execute(f"GRANT {privileges} ON {table} TO {q}")


def downgrade() -> None:
    # roles are the cluster's, grants this database's: revoke, keep the role (as 0006).
    # The role exists: PostgreSQL refuses to drop one that holds these grants.
    q = quote(SNAPSHOTS)
    op.execute(f"REVOKE ALL ON {', '.join(table for _, table in GRANTS)} FROM {q}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {q}")
