"""Idempotency records of the bus consumers.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

Design: a consumer (:mod:`services.runtime.delivery.consuming`) inserts ``(consumer,
event_id)`` into ``processed_messages`` in the same transaction as the events its
handler appends and its checkpoint. The primary key makes a redelivered message a
conflict ("already done"), so JetStream's at-least-once delivery becomes
effectively-once processing. ``processed_at`` (indexed) lets an operator prune rows
older than anything JetStream could still redeliver.

The application role gets the same DML as on the other projection tables; like 0001,
the helpers are copied rather than imported, so this revision stays as it is when
later ones change.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "processed_messages"


def upgrade() -> None:
    op.execute(
        f"""
CREATE TABLE {TABLE} (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
)
        """
    )
    op.execute(f"CREATE INDEX {TABLE}_processed_at_idx ON {TABLE} (processed_at)")
    role = app_role()
    if role:  # 0001 created the role and granted schema usage
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {TABLE} TO {quote(role)}")


def downgrade() -> None:
    role = app_role()
    if role:
        op.execute(
            f"DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = "
            f"'{role.replace(chr(39), chr(39) * 2)}') THEN "
            f"REVOKE ALL ON {TABLE} FROM {quote(role)}; END IF; END $$;"
        )
    op.execute(f"DROP TABLE IF EXISTS {TABLE}")
