"""The application role the revisions grant to (``dracap_app`` unless settings say
otherwise), and the SQL that creates a group role once per cluster."""

from __future__ import annotations

from alembic import context


def app_role() -> str:
    """The role's name, from the settings ``migrations.runner`` passes in."""
    settings = context.config.attributes.get("settings")
    role = getattr(settings, "app_role", None)
    if role is None:
        from services.runtime.ground.settings import load_settings

        role = load_settings().app_role
    return str(role)


def quote(identifier: str) -> str:
    """``identifier`` as a quoted SQL identifier."""
    return '"' + identifier.replace('"', '""') + '"'


def ensure_group_role_sql(role: str) -> str:
    """SQL that creates the group role ``role`` (``NOLOGIN``) unless it exists.

    Roles are the cluster's: another database's migration may have created it, or be
    creating it right now (the second ``CREATE ROLE`` is caught).
    """
    literal = "'" + role.replace("'", "''") + "'"
    return f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {literal}) THEN
        BEGIN
            CREATE ROLE {quote(role)} NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$
"""
