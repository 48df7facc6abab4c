"""``dracap db logins``: each service kind's own database login, created or rotated.

On a PostgreSQL that the operator runs (compose's, a managed one), the per-service
logins of ``docs/database-roles.md`` are made by one command, not by hand-written SQL:
with an administrator's URL (``--database-url`` / ``DRACAP_DATABASE_URL``: a superuser
or a user with ``CREATEROLE``, the one that ran ``dracap db upgrade``),
:func:`ensure_logins` makes for every service kind of
:data:`~services.runtime.store.provisioning.KINDS` a login user in that kind's group role
(``<prefix>_<kind>_login``, ``dracap_claims_login`` by default: the names ``dracap up``
uses on its embedded server) and writes the URL it connects with to
``<data-dir>/database/<kind>.url`` (mode 0600, written atomically;
:mod:`services.runtime.ground.loginfiles`), where the services of that kind find it.

Run again, it keeps each password its file holds and sets it on the server again (the
file and the server agree, as :mod:`services.runtime.store.provisioning` keeps them for
``dracap up``), and makes what is missing; ``--rotate`` gives every login (or the kinds
named) a new password: restart those services afterwards (a running one keeps its
connections, a new connection needs the new file). The server gets SCRAM verifiers only
(:func:`~services.runtime.store.dbroles.ensure_login`), never a password.

The URLs name the server as the administrator's URL does, unless ``--url-host HOST:PORT``
names it as the services reach it (an administrator behind a port forward). Roles are
the server's, not one database's: ``--prefix`` names the logins of a second
installation on the same server apart (and its URLs name its own database).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final
from urllib.parse import unquote, urlsplit, urlunsplit

import asyncpg
import msgspec

from services.exitcodes import CommandError, ExitCode
from services.runtime.ground.loginfiles import LoginFileError, login_file, read_login_url
from services.runtime.ground.settings import ServiceKind
from services.runtime.store.dbroles import ensure_login, group_role, new_password, url_as
from services.runtime.store.provisioning import KINDS, write_private

__all__ = ["DEFAULT_PREFIX", "Login", "ensure_logins", "login_name", "rotated_kinds"]

DEFAULT_PREFIX: Final = "dracap"
_PREFIX: Final = re.compile(r"[a-z_][a-z0-9_]{0,40}")


class Login(msgspec.Struct, frozen=True, kw_only=True):
    """One kind's login as :func:`ensure_logins` left it."""

    kind: str
    user: str
    path: str  #: its URL file
    change: str  #: ``created``, ``kept`` or ``rotated``


def login_name(prefix: str, kind: ServiceKind) -> str:
    """The login user of ``kind``: ``<prefix>_<kind>_login``."""
    if not _PREFIX.fullmatch(prefix):
        raise CommandError(
            f"--prefix {prefix!r}: must be lower-case letters, digits and '_' "
            "(not starting with a digit), at most 41",
            ExitCode.BAD_INPUT,
        )
    return f"{prefix}_{kind.value}_login"


def _with_host(url: str, host: str) -> str:
    """``url`` with ``host`` (``HOST[:PORT]``) as its server."""
    if not host or any(c in host for c in "/@?#"):
        raise CommandError(f"--url-host {host!r}: write HOST or HOST:PORT", ExitCode.BAD_INPUT)
    parts = urlsplit(url)
    login, at, _ = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{login}{at}{host}"))


def _kept_password(data_dir: Path, kind: ServiceKind, user: str) -> str | None:
    """The password the kind's file holds for ``user``, or None (no file, another user)."""
    try:
        url = read_login_url(data_dir, kind.value)
    except LoginFileError:
        return None
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.username is None or unquote(parts.username) != user or not parts.password:
        return None
    return unquote(parts.password)


async def _check_migrated(connection: asyncpg.Connection) -> None:
    """:class:`CommandError` unless the database has dracap's schema and group roles."""
    missing = [] if await connection.fetchval("SELECT to_regclass('events')") else ["events"]
    for kind in KINDS:
        role = group_role(kind)
        if not await connection.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
            missing.append(role)
    if missing:
        raise CommandError(
            f"the database has no {missing[0]} (not migrated): run `dracap db upgrade` first",
            ExitCode.BAD_INPUT,
        )


async def ensure_logins(
    admin_url: str,
    data_dir: Path,
    *,
    prefix: str = DEFAULT_PREFIX,
    rotate: frozenset[ServiceKind] = frozenset(),
    url_host: str | None = None,
) -> list[Login]:
    """Create, keep or rotate every kind's login and write its URL file (module docstring);
    ``url_host`` (``HOST[:PORT]``): the server as the services reach it, when not as the
    administrator does (a port forward)."""
    services_url = admin_url if url_host is None else _with_host(admin_url, url_host)
    done: list[Login] = []
    connection = await asyncpg.connect(admin_url)
    try:
        await _check_migrated(connection)
        for kind in KINDS:
            user = login_name(prefix, kind)
            kept = None if kind in rotate else _kept_password(data_dir, kind, user)
            exists = await connection.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", user)
            password = kept or new_password()
            try:
                await ensure_login(connection, user, group_role(kind), password)
            except asyncpg.InsufficientPrivilegeError as exc:
                raise CommandError(
                    f"cannot create or alter the login {user}: {exc}; connect as a superuser "
                    "or a user with CREATEROLE (the one that ran `dracap db upgrade`)",
                    ExitCode.ERROR,
                ) from None
            path = login_file(data_dir, kind.value)
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_private(path, url_as(services_url, user, password).encode())
            change = "created" if not exists else ("kept" if kept else "rotated")
            done.append(Login(kind=kind.value, user=user, path=str(path), change=change))
    finally:
        await connection.close()
    return done


def rotated_kinds(words: list[str] | None) -> frozenset[ServiceKind]:
    """The kinds ``--rotate`` names: none (flag absent), all (no word), or those named."""
    if words is None:
        return frozenset()
    if not words:
        return frozenset(KINDS)
    known = {kind.value: kind for kind in KINDS}
    for word in words:
        if word not in known:
            raise CommandError(
                f"--rotate {word!r}: not a service kind (one of {', '.join(known)})",
                ExitCode.BAD_INPUT,
            )
    return frozenset(known[word] for word in words)
