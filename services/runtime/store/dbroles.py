"""The database roles of migration 0006 as the runtime uses them: names and login users.

Migrations 0006-0011 create the *group* roles (``NOLOGIN``): ``dracap_owner``, one per
service kind (``dracap_claims``, ``dracap_reservation``, ``dracap_relay``,
``dracap_reclamation``, ``dracap_ledger``, ``dracap_snapshots``, ``dracap_enforcement``)
and ``dracap_readonly``; since 0011 the database lets each append only its kind's job
(``events/writers.py``). (``dracap_agent``, node agents' own group until they talked to
NATS only, has no right left since 0012.) A process never connects as a group role; it
connects as a *login* user that belongs to one and so has its rights (``INHERIT``, no
``role`` switch; :meth:`services.runtime.ground.settings.Settings.for_service`).
:func:`ensure_login` creates such a user, in one group, for a service kind (``dracap up``
makes one per kind on its embedded server, :mod:`services.runtime.store.provisioning`).

Passwords never travel in clear text to the server: the statement carries the SCRAM
verifier computed here (:func:`scram_verifier`, as ``psql``'s ``\\password`` does), so a
server log that records the statement shows no password. Creating roles needs a
superuser or ``CREATEROLE``; the connection passed in is an administrator's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Final
from urllib.parse import quote as url_quote
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from services.runtime.ground.settings import ServiceKind

__all__ = [
    "OWNER_ROLE",
    "ensure_login",
    "group_role",
    "login_user",
    "new_password",
    "scram_verifier",
    "url_as",
]

OWNER_ROLE: Final = "dracap_owner"
SCRAM_ITERATIONS: Final = 4096  # PostgreSQL's default (scram_iterations)


def group_role(kind: ServiceKind) -> str:
    """The group role of a service kind (migration 0006): ``dracap_<kind>``."""
    return f"dracap_{kind.value}"


def login_user(kind: ServiceKind) -> str:
    """The login user ``dracap up`` creates for a service kind: ``dracap_<kind>_login``."""
    return f"{group_role(kind)}_login"


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
