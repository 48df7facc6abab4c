"""Every admission rule is exact across claims API replicas, not only the quota.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-14

0013 checks a quota decision's premise where the replicas meet. The other rules that
depend on the log — the namespace's access record (its classes, adminAccess, opaque
configuration, requests per claim, and its quota) and the modes and existence of the
DeviceClasses a claim names — were decided on each replica's fold alone: a replica that
had not folded an administrator's revocation yet could admit a claim the revocation
forbids, after the administrator was told it took effect. Now every admission carries
its premise, and ``dracap_expect_admissions`` (``functions/dracap_expect_admissions/
0014.sql``, in full) refuses the append when such an event was appended after the
decision's position; the replica decides again on the whole log (docs/tenancy.md).
Same signature, owner and grants as 0013: only ``dracap_claims`` (and the app role)
execute it.

The downgrade installs 0013's version (which counts admissions for every premise).
"""

from __future__ import annotations

from collections.abc import Sequence

from migrations.sqlfiles import install

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    install("dracap_expect_admissions", revision)


def downgrade() -> None:
    install("dracap_expect_admissions", "0013")
