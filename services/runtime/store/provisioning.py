"""``dracap up``'s database users on its embedded PostgreSQL: one per service.

On the embedded server (:mod:`services.runtime.ops.embedded`) ``dracap up`` is the
administrator, so it sets up what an operator sets up by hand elsewhere
(``docs/database-roles.md``): after the migrations, :func:`provision` makes

* a login user per service kind in that kind's group role (:mod:`services.runtime.store.dbroles`):
  ``dracap_claims_login``, ``dracap_reservation_login``, ``dracap_relay_login`` and
  ``dracap_readonly_login`` (the live state's reads), ``dracap_ledger_login`` (the audit
  and billing subscribers), ``dracap_snapshots_login`` (the snapshot writer),
  ``dracap_enforcement_login`` (the enforcement service, which appends the node agents'
  reports: node agents themselves have no database user, migration 0011);

and returns the URL each one connects with, for
:attr:`~services.runtime.ground.settings.Settings.database_urls`. The server's ``pg_hba.conf``
makes these users give their passwords (SCRAM-SHA-256).

Passwords are generated once (:func:`~services.runtime.store.dbroles.new_password`) and kept in
``<data-dir>/database-users.json``, mode 0600, written atomically — and nowhere else:
the server gets SCRAM verifiers, never the passwords; they are not logged, not in
``connection.json`` (which keeps the superuser's URL for the CLI), not in any event. A
restart reads the file and sets the same passwords again (a file that was deleted
just means new passwords), so the file and the server always agree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import asyncpg
import msgspec

from services.runtime.ground.settings import ServiceKind
from services.runtime.store.dbroles import (
    ensure_login,
    group_role,
    login_user,
    new_password,
    url_as,
)

__all__ = [
    "USERS_FILE",
    "DatabaseUser",
    "DatabaseUsers",
    "load_users",
    "provision",
    "write_private",
]

USERS_FILE: Final = "database-users.json"
#: The kinds that get a user of their own (node agents have none: they talk to NATS only).
KINDS: Final = (
    ServiceKind.CLAIMS,
    ServiceKind.RESERVATION,
    ServiceKind.RELAY,
    ServiceKind.RECLAMATION,
    ServiceKind.READONLY,
    ServiceKind.LEDGER,
    ServiceKind.SNAPSHOTS,
    ServiceKind.ENFORCEMENT,
)


class DatabaseUser(msgspec.Struct, frozen=True, kw_only=True):
    """A login user and its password."""

    user: str
    password: str


class DatabaseUsers(msgspec.Struct, frozen=True, kw_only=True):
    """The contents of ``database-users.json``."""

    services: dict[str, DatabaseUser] = msgspec.field(default_factory=dict)


def load_users(data_dir: Path) -> DatabaseUsers:
    """The users of ``data_dir``, with new ones for the kinds it lacks (saved)."""
    path = data_dir / USERS_FILE
    try:
        users = msgspec.json.decode(path.read_bytes(), type=DatabaseUsers)
        path.chmod(0o600)
    except (FileNotFoundError, msgspec.DecodeError):
        users = DatabaseUsers()  # none yet, or unreadable: new passwords for everyone
    services = dict(users.services)
    for kind in KINDS:
        services.setdefault(kind.value, DatabaseUser(user=login_user(kind), password=""))
    # (the node agents' users of earlier versions, under "nodes", are left out: migration
    # 0012 dropped them)
    complete = DatabaseUsers(services={k: _with_password(u) for k, u in services.items()})
    if complete != users:
        write_private(path, msgspec.json.format(msgspec.json.encode(complete)) + b"\n")
    return complete


def _with_password(user: DatabaseUser) -> DatabaseUser:
    if user.password:
        return user
    return DatabaseUser(user=user.user, password=new_password())


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` atomically, readable by this user only (0600 from the start)."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    os.replace(partial, path)


async def provision(admin_url: str, users: DatabaseUsers) -> dict[str, str]:
    """Create (or update) the users of ``users``; returns each one's URL by service key.

    ``admin_url`` is the superuser's URL of the migrated dracap database.
    """
    urls: dict[str, str] = {}
    connection = await asyncpg.connect(admin_url)
    try:
        for kind in KINDS:
            login = users.services[kind.value]
            await ensure_login(connection, login.user, group_role(kind), login.password)
            urls[kind.value] = url_as(admin_url, login.user, login.password)
    finally:
        await connection.close()
    return urls
