"""Two more node-agent reports inside the node scope: device health and share use.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07

``reclamation.device_health_changed`` (a device of the node failing, or well again) and
``enforcement.share_used`` (traffic went through a share's limit: the claim started) are
written by node agents, for their own node (their ``node`` field), like the other
enforcement reports. The node scope of 0006/0007 (``dracap_node_of``,
``dracap_check_node_scope``) learns them. And a report about a live share
(``LimitApplied``, ``LimitFailed``, ``LimitRemoved``, ``ShareConfirmed``, ``ShareUsed``)
now speaks for the node that holds the share in ``held_shares``, not only for the node
its payload names: an agent cannot report on another node's share (and a share that
holds nothing, admin access or released, is judged by the payload's node, as before).
The new versions are ``migrations/functions/dracap_node_of/0008.sql`` and
``dracap_check_node_scope/0008.sql``; the downgrade installs 0007's.
"""

from __future__ import annotations

from collections.abc import Sequence

from migrations.sqlfiles import install

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    install("dracap_node_of", revision)
    install("dracap_check_node_scope", revision)


def downgrade() -> None:
    install("dracap_node_of", "0007")
    install("dracap_check_node_scope", "0007")
