"""The quota is exact across claims API replicas: ``dracap_expect_admissions``.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-13

Each claims API replica decides a namespace's quota on its own fold; two replicas racing
at the quota could each admit up to it. The premise of such a decision — no claim of the
namespace admitted after the fold's position but the ones it counted — now travels with
its append and is checked by ``dracap_expect_admissions``
(``functions/dracap_expect_admissions/0013.sql``) in the same statement, under the log's
head lock; a broken premise is a conflict (``DR001``) and the replica decides again
(docs/tenancy.md). The function is the owner's, ``SECURITY DEFINER`` (it reads the log
for its caller), and only ``dracap_claims`` (and the app role) may execute it
(docs/database-roles.md).

The downgrade drops the function: the replicas' appends then carry no premise (a release
before this one sends none).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote
from migrations.sqlfiles import install

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "dracap_owner"
CLAIMS = "dracap_claims"
EXPECT = "dracap_expect_admissions(bigint, jsonb)"


def upgrade() -> None:
    install("dracap_expect_admissions", revision)
    op.execute(f"ALTER FUNCTION {EXPECT} OWNER TO {OWNER}")
    op.execute(f"REVOKE EXECUTE ON FUNCTION {EXPECT} FROM PUBLIC")
    app = app_role()
    for role in (CLAIMS, *([app] if app else [])):
        op.execute(f"GRANT EXECUTE ON FUNCTION {EXPECT} TO {quote(role)}")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {EXPECT}")
