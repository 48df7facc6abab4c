"""The database roles of migration 0006 as the runtime uses them: names, login users,
node-bound agent users.

Migrations 0006-0011 create the *group* roles (``NOLOGIN``): ``dracap_owner``, one per
service kind (``dracap_claims``, ``dracap_reservation``, ``dracap_relay``,
``dracap_reclamation``, ``dracap_agent``, ``dracap_ledger``, ``dracap_snapshots``,
``dracap_enforcement``) and ``dracap_readonly``; since 0011 the database lets each
append only its kind's job (``events/writers.py``). A process never connects as a group role; it
connects as a *login* user that belongs to one and so has its rights (``INHERIT``, no
``role`` switch; :meth:`services.runtime.settings.Settings.for_service`). This module
creates such users:

* :func:`ensure_login` — a user in one group, for a service kind (``dracap up`` makes
  one per kind on its embedded server, :mod:`services.runtime.provisioning`);
* :func:`ensure_node_role` — a node agent's user, in ``dracap_agent`` and *bound* to one
  node in ``dracap_node_roles``: ``dracap_append_guarded`` then refuses any report of
  another node (SQLSTATE ``DR004``, :class:`~services.runtime.errors.NodeScopeViolation`)
  and any event that is no node agent's (``DR005``,
  :class:`~services.runtime.errors.AppendForbidden`). ``dracap db node-role NODE``
  and ``dracap up`` use it.

Passwords never travel in clear text to the server: the statement carries the SCRAM
verifier computed here (:func:`scram_verifier`, as ``psql``'s ``\\password`` does), so a
server log that records the statement shows no password. Creating roles needs a
superuser or ``CREATEROLE``; the connection passed in is an administrator's.

Roles are cluster-wide while the binding is a row of one database: the same user may act
for its node in several dracap databases of one cluster, each binding it on its own.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from typing import Final
from urllib.parse import quote as url_quote
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from services.runtime.settings import ServiceKind

__all__ = [
    "OWNER_ROLE",
    "bind_node",
    "bound_node",
    "ensure_login",
    "ensure_node_role",
    "group_role",
    "login_user",
    "new_password",
    "node_role",
    "scram_verifier",
    "url_as",
]

OWNER_ROLE: Final = "dracap_owner"
NODE_ROLE_PREFIX: Final = "dracap_node_"
SCRAM_ITERATIONS: Final = 4096  # PostgreSQL's default (scram_iterations)
_UNSAFE: Final = re.compile(r"[^a-z0-9_]+")


def group_role(kind: ServiceKind) -> str:
    """The group role of a service kind (migration 0006): ``dracap_<kind>``."""
    return f"dracap_{kind.value}"


def login_user(kind: ServiceKind) -> str:
    """The login user ``dracap up`` creates for a service kind: ``dracap_<kind>_login``."""
    return f"{group_role(kind)}_login"


def node_role(node: str) -> str:
    """The login user of ``node``'s agent: readable, unique and at most 63 bytes.

    ``dracap_node_`` + the node name made an identifier (lower case, runs of other
    characters as ``_``, cut at 32) + ``_`` + 8 hex digits of the name's SHA-256, so two
    nodes whose names differ only in what was replaced or cut still get two users.
    """
    readable = _UNSAFE.sub("_", node.lower())[:32]
    digest = hashlib.sha256(node.encode()).hexdigest()[:8]
    return f"{NODE_ROLE_PREFIX}{readable}_{digest}"


def new_password() -> str:
    """A fresh random password (URL-safe characters: it goes into a URL as is)."""
    return secrets.token_urlsafe(32)


def scram_verifier(
    password: str, *, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS
) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802, 7677).

    ``CREATE ROLE ... PASSWORD '<verifier>'`` stores it as it is, so the clear password
    never reaches the server. ``password`` is used as it is: SASLprep changes nothing
    in the printable ASCII of :func:`new_password`.
    """
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def url_as(url: str, user: str, password: str | None) -> str:
    """``url`` logging in as ``user`` (with ``password``) instead of its own user."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    login = url_quote(user, safe="")
    if password is not None:
        login += ":" + url_quote(password, safe="")
    return urlunsplit(parts._replace(netloc=f"{login}@{host}"))


def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


async def ensure_login(
    connection: asyncpg.Connection, user: str, group: str, password: str | None
) -> None:
    """Make ``user`` a login user in ``group`` with ``password``.

    Creates the user, or updates an existing one: its password (the files of ``dracap
    up`` and the server's catalogue must agree; ``None`` leaves it as it is, and a new
    user without one) and the membership. Nothing else: the user's rights are the group's.
    """
    options = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE INHERIT"
    if password is not None:
        options += f" PASSWORD {_literal(scram_verifier(password))}"
    exists = await connection.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", user)
    verb = "ALTER" if exists else "CREATE"
    await connection.execute(f"{verb} ROLE {_identifier(user)} {options}")
    await connection.execute(f"GRANT {_identifier(group)} TO {_identifier(user)}")


async def bind_node(connection: asyncpg.Connection, role: str, node: str) -> None:
    """Bind ``role`` to ``node`` in this database (``dracap_node_roles``)."""
    await connection.execute(
        "INSERT INTO dracap_node_roles (role, node) VALUES ($1, $2) "
        "ON CONFLICT (role) DO UPDATE SET node = EXCLUDED.node",
        role,
        node,
    )


async def bound_node(connection: asyncpg.Connection | asyncpg.Pool) -> str | None:
    """The node the session's user acts for; None when it is bound to none (or the
    database predates migration 0006, where nobody is)."""
    try:
        node: str | None = await connection.fetchval("SELECT dracap_bound_node()")
    except asyncpg.UndefinedFunctionError:
        return None
    return node


async def ensure_node_role(connection: asyncpg.Connection, node: str, password: str | None) -> str:
    """The login user of ``node``'s agent, created (or updated) and bound; returns its name."""
    role = node_role(node)
    async with connection.transaction():
        await ensure_login(connection, role, group_role(ServiceKind.AGENT), password)
        await bind_node(connection, role, node)
    return role
