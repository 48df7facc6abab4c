"""Node agents have no database login: the node-bound users of 0006 and their rights go.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-12

Node agents talk only to NATS (docs/agent.md): the enforcement service appends their
reports as ``dracap_enforcement`` (0011) and renews their leases in one statement
(``dracap_renew_leases``). Nothing of dracap connects as a node agent's database user any
more, so this revision takes away what such a user could do (docs/database-roles.md):

* **the node-bound login users go**: every user bound in ``dracap_node_roles`` (``dracap
  db node-role`` made them, ``dracap up`` of earlier versions too) is dropped, then the
  binding table and ``dracap_bound_node()``. Roles are the cluster's: a user another
  dracap database of the same server still binds (one not upgraded yet) is dropped as
  well; a user that still owns objects, or holds rights, somewhere else is kept and only
  leaves ``dracap_agent`` (a notice says so);
* **``dracap_agent`` keeps nothing**: every right 0006-0011 gave it in this database is
  revoked (reading the log, the agents' consumer rows, the leases, ``EXECUTE`` on the
  append function and on 0007's ``dracap_renew_lease``, which goes too). The group role
  itself stays, as 0009 and 0010 keep theirs: roles are the cluster's;
* **the append function** no longer looks up a binding (``dracap_append_guarded/0012.sql``,
  in full), and **the jobs** no longer name ``agent``: the payload checks and writers
  are installed again from ``migrations/functions/dracap_payload_checks.sql``
  (:data:`CATALOG`).

The downgrade restores 0011's schema, functions and grants: the binding table (empty),
``dracap_bound_node()``, ``dracap_renew_lease``, ``dracap_agent``'s rights, 0011's
append function and jobs. The users it dropped are not made again (their passwords are
gone): a 0011 release's ``dracap db node-role`` makes them.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

from alembic import op

from migrations.roles import app_role, quote
from migrations.sqlfiles import generated_sql, install

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The digest of the catalog checks this revision installs (``dracap_catalog_digest()``).
CATALOG = "e7751293af63d8489d667c230d6d22e9e7d164b281c16a121e55a79278bbfcb6"

OWNER = "dracap_owner"
AGENT = "dracap_agent"
READONLY = "dracap_readonly"
BOUND_NODE = "dracap_bound_node()"
RENEW = "dracap_renew_lease(text, bigint)"
#: What ``dracap_agent`` could do at 0011 (0006, 0007 and 0011 granted it).
AGENT_TABLES = (
    ("SELECT", "events"),
    ("SELECT", "event_log_head"),
    ("SELECT", "snapshots"),
    ("SELECT, INSERT", "processed_messages"),
    ("SELECT, INSERT, UPDATE", "consumer_checkpoints"),
    ("SELECT", "node_leases"),
    ("SELECT", "node_epochs"),
)

# Each user bound here leaves: dropped, or (still needed elsewhere) out of dracap_agent.
# (No percent signs in the SQL: the migration driver reads them as placeholders.)
DROP_NODE_USERS = """
DO $$
DECLARE
    v_role text;
BEGIN
    FOR v_role IN SELECT r.role FROM dracap_node_roles r
                   WHERE EXISTS (SELECT FROM pg_roles g WHERE g.rolname = r.role)
                   ORDER BY r.role LOOP
        BEGIN
            EXECUTE 'DROP ROLE ' || quote_ident(v_role);
        EXCEPTION WHEN dependent_objects_still_exist THEN
            EXECUTE 'REVOKE dracap_agent FROM ' || quote_ident(v_role);
            RAISE NOTICE USING MESSAGE = 'database user ' || v_role || ' is kept (it has '
                || 'rights or objects elsewhere) and is no member of dracap_agent any more';
        END;
    END LOOP;
END
$$
"""


def _revision(name: str) -> ModuleType:
    return importlib.import_module(f"migrations.versions.{name}")


def _login_jobs() -> ModuleType:
    return _revision("0011_login_jobs")


def _agent_rights(verb: str) -> None:
    """GRANT (or REVOKE) ``dracap_agent``'s rights of 0011 in this database."""
    append = _login_jobs().APPEND_GUARDED
    to = "TO" if verb == "GRANT" else "FROM"
    q = quote(AGENT)
    for privileges, table in AGENT_TABLES:
        op.execute(f"{verb} {privileges} ON {table} {to} {q}")
    op.execute(f"{verb} EXECUTE ON FUNCTION {append} {to} {q}")
    op.execute(f"{verb} USAGE ON SCHEMA public {to} {q}")


def upgrade() -> None:
    op.execute(DROP_NODE_USERS)
    _agent_rights("REVOKE")
    op.execute(f"DROP FUNCTION {RENEW}")
    install("dracap_append_guarded", revision)  # no binding to look up
    op.execute(f"DROP FUNCTION {BOUND_NODE}")
    op.execute("DROP TABLE dracap_node_roles")
    op.execute(generated_sql("dracap_payload_checks"))  # jobs without ``agent``


def downgrade() -> None:
    jobs, roles = _login_jobs(), _revision("0006_roles")
    op.execute(roles.NODE_ROLES)
    op.execute(f"ALTER TABLE dracap_node_roles OWNER TO {OWNER}")
    op.execute(f"GRANT SELECT ON dracap_node_roles TO {quote(READONLY)}")
    install("dracap_bound_node", "0006")  # PUBLIC may ask it (0006)
    op.execute(f"ALTER FUNCTION {BOUND_NODE} OWNER TO {OWNER}")
    install("dracap_append_guarded", "0011")
    op.execute(jobs.payload_checks_sql())
    install("dracap_renew_lease", "0007")
    op.execute(f"ALTER FUNCTION {RENEW} OWNER TO {OWNER}")
    op.execute(f"REVOKE EXECUTE ON FUNCTION {RENEW} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {RENEW} TO {quote(AGENT)}")
    app = app_role()
    if app:
        op.execute(f"GRANT EXECUTE ON FUNCTION {RENEW} TO {quote(app)}")
    _agent_rights("GRANT")
