"""The application role the revisions grant to (``dracap_app`` unless settings say otherwise)."""

from __future__ import annotations

from alembic import context


def app_role() -> str:
    """The role's name, from the settings ``services.runtime.migrating`` passes in."""
    settings = context.config.attributes.get("settings")
    role = getattr(settings, "app_role", None)
    if role is None:
        from services.runtime.settings import load_settings

        role = load_settings().app_role
    return str(role)


def quote(identifier: str) -> str:
    """``identifier`` as a quoted SQL identifier."""
    return '"' + identifier.replace('"', '""') + '"'
