"""Where the servers are: one resolution, used by every command.

Each command that talks to a server (``dracap claim ...`` / ``devices``, ``db``,
``replay verify``, ``agent``, ``prove bandwidth --attach``) finds it here, in the same
order for each value:

========== ================== ========================= ===================================
value      flag               then the variable         then ``<data-dir>/connection.json``
========== ================== ========================= ===================================
PostgreSQL ``--database-url`` ``DRACAP_DATABASE_URL``   ``database_url``
NATS       ``--nats``         ``DRACAP_NATS_URL``       ``nats_url``
NATS login ``--creds``        ``DRACAP_NATS_CREDS``     ``creds`` (the operator's)
prefix     ``--prefix``       —                         ``prefix``, else ``dracap``
========== ================== ========================= ===================================

The NATS login is a credential file of ``dracap auth init``
(:mod:`services.runtime.bus.credentials`); without one a command connects anonymously,
which only an open server (``dracap up --insecure``) accepts. The saved login is used
only with the saved NATS URL, and only when the file is read for a server or prefix.
A command that runs one kind of service (``dracap serve relay``, ``dracap reclaim``;
``dracap replay verify``, which reads as ``readonly``) looks at that kind's
``DRACAP_DATABASE_URL_<KIND>`` right after the flag, then at its login file
``<data-dir>/database/<kind>.url`` of ``dracap db logins``
(:mod:`services.runtime.ground.loginfiles`): a URL found there logs in as its own user,
without the ``role`` switch of ``DRACAP_APP_ROLE`` (:meth:`Endpoints.settings`;
``docs/database-roles.md``).

``connection.json`` is what ``dracap up`` writes into its data directory
(``--data-dir``, default ``.dracap``), so a command run next to ``dracap up`` reaches
exactly its servers. There is no built-in address: a command that finds no URL for a
server it needs stops with :class:`NoEndpoint`, saying where it looked, rather than
trying ``127.0.0.1`` and perhaps reading another database than ``dracap up`` runs.
The file is read only when a value is not given otherwise.

Failures a user can meet are typed, so the CLI (:func:`services.cli.main`) prints them
as one line without a traceback: :class:`NoEndpoint` (nothing says where a server is),
:class:`ConnectionFileError` (``connection.json`` cannot be read or decoded) and
:class:`ServerUnavailable` (a server does not answer, refuses the login, or the
database or its schema is missing), which :func:`reaching` makes out of the driver's
exceptions, telling them apart by type.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final, Literal

import asyncpg
import msgspec
import nats.errors

from services.runtime.bus.credentials import Credential, read_credential
from services.runtime.ground.errors import PermanentError
from services.runtime.ground.loginfiles import read_login_url
from services.runtime.ground.outages import is_unreachable
from services.runtime.ground.settings import ServiceKind, Settings

__all__ = [
    "DEFAULT_DATA_DIR",
    "DEFAULT_PREFIX",
    "Connection",
    "ConnectionFileError",
    "EndpointError",
    "Endpoints",
    "NoEndpoint",
    "ServerUnavailable",
    "add_endpoint_arguments",
    "endpoints_from_args",
    "reaching",
    "read_connection",
    "redact",
    "resolve_endpoints",
]

DEFAULT_DATA_DIR: Final = ".dracap"
DEFAULT_PREFIX: Final = "dracap"
CONNECTION_FILE: Final = "connection.json"

Server = Literal["PostgreSQL", "NATS"]


class EndpointError(PermanentError):
    """A server cannot be found or reached; the message is one line for a person."""


class NoEndpoint(EndpointError):  # noqa: N818 (a condition, like NotFound)
    """Neither flag, variable nor ``connection.json`` says where a server is."""


class ConnectionFileError(EndpointError):
    """``connection.json`` exists but cannot be read or decoded."""


class ServerUnavailable(EndpointError):  # noqa: N818
    """A server does not answer, refuses the login, or lacks the database or schema."""


class Connection(msgspec.Struct, frozen=True, kw_only=True):
    """What ``dracap up`` writes to ``<data-dir>/connection.json``."""

    database_url: str
    nats_url: str
    prefix: str = DEFAULT_PREFIX
    creds: str | None = None  #: the operator's credential file (absent: an open server)


def read_connection(data_dir: Path) -> Connection | None:
    """The connection file of ``data_dir``, or None when there is none."""
    path = data_dir / CONNECTION_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=Connection)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        raise ConnectionFileError(f"{path}: cannot read it: {exc}") from exc


class Endpoints(msgspec.Struct, frozen=True, kw_only=True):
    """The servers one command uses; a URL is ``None`` when nothing named it."""

    data_dir: str
    database_url: str | None
    nats_url: str | None
    prefix: str
    creds: str | None = None

    def credential(self) -> Credential | None:
        """The NATS login to use, or None (anonymous)."""
        return read_credential(self.creds) if self.creds else None

    #: ``database_url`` came from ``DRACAP_DATABASE_URL_<KIND>`` or the kind's login file:
    #: act as its user
    own_user: bool = False
    service: ServiceKind | None = None  #: the kind of service the command runs

    def database(self) -> str:
        """The PostgreSQL URL, or :class:`NoEndpoint`."""
        return self.database_url or self._missing("PostgreSQL", "--database-url", "DATABASE")

    def nats(self) -> str:
        """The NATS URL, or :class:`NoEndpoint`."""
        return self.nats_url or self._missing("NATS", "--nats", "NATS")

    def settings(self, base: Settings) -> Settings:
        """``base`` connecting to these servers (each one that is known)."""
        return msgspec.structs.replace(
            base,
            database_url=self.database_url or base.database_url,
            nats_url=self.nats_url or base.nats_url,
            app_role="" if self.own_user else base.app_role,
        )

    def _missing(self, server: Server, flag: str, variable: str) -> str:
        where = Path(self.data_dir) / CONNECTION_FILE
        logins = ""
        if server == "PostgreSQL" and self.service is not None:
            logins = f", `dracap db logins --data-dir {self.data_dir}` (its own login)"
        raise NoEndpoint(
            f"no {server} URL: pass {flag}, set DRACAP_{variable}_URL{logins} or run "
            f"`dracap up` (which writes {where}; --data-dir names another data directory)"
        )


def resolve_endpoints(
    data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR,
    *,
    database_url: str | None = None,
    nats_url: str | None = None,
    prefix: str | None = None,
    creds: str | None = None,
    env: Mapping[str, str] | None = None,
    saved: bool = True,
    service: ServiceKind | None = None,
) -> Endpoints:
    """The servers named by flags (the arguments), else ``env``, else ``connection.json``.

    ``saved=False`` skips ``connection.json``: for a command that starts the servers it
    does not find (``dracap prove bandwidth`` without ``--attach``). ``service``: the
    kind of service the command runs, whose ``DRACAP_DATABASE_URL_<KIND>`` comes right
    after the flag.
    """
    env = os.environ if env is None else env
    own = None
    if service is not None and not database_url:
        own = env.get(f"DRACAP_DATABASE_URL_{service.name}") or read_login_url(
            data_dir, service.value
        )
    own_user = not database_url and bool(own)
    database_url = database_url or own or env.get("DRACAP_DATABASE_URL") or None
    nats_url = nats_url or env.get("DRACAP_NATS_URL") or None
    creds = creds or env.get("DRACAP_NATS_CREDS") or None
    connection = None
    if saved and not (database_url and nats_url and prefix):  # the login alone: not read
        connection = read_connection(Path(data_dir))
    if connection is not None:
        database_url = database_url or connection.database_url
        # the saved login belongs to the saved server: not to a URL named otherwise
        if nats_url is None or nats_url == connection.nats_url:
            creds = creds or connection.creds
        nats_url = nats_url or connection.nats_url
        prefix = prefix or connection.prefix
    return Endpoints(
        data_dir=str(data_dir),
        database_url=database_url,
        nats_url=nats_url,
        prefix=prefix or DEFAULT_PREFIX,
        creds=creds,
        own_user=own_user,
        service=service,
    )


def add_endpoint_arguments(
    parser: argparse.ArgumentParser, *, database: bool = False, nats: bool = False
) -> None:
    """``--data-dir``, ``--prefix`` and the URL flags of the servers a command uses."""
    if database:
        parser.add_argument(
            "--database-url",
            metavar="URL",
            help="PostgreSQL URL (default: DRACAP_DATABASE_URL, else <data-dir>/connection.json)",
        )
    if nats:
        parser.add_argument(
            "--nats",
            metavar="URL",
            help="NATS URL (default: DRACAP_NATS_URL, else <data-dir>/connection.json)",
        )
        parser.add_argument(
            "--prefix", help="subject prefix (default: connection.json's, else dracap)"
        )
        parser.add_argument(
            "--creds",
            metavar="FILE",
            help="NATS credential file of `dracap auth init` (default: DRACAP_NATS_CREDS, "
            "else connection.json's: the operator's)",
        )
    parser.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        metavar="DIR",
        help="where `dracap up` keeps connection.json (default: .dracap)",
    )


def endpoints_from_args(
    args: argparse.Namespace, *, service: ServiceKind | None = None
) -> Endpoints:
    """:func:`resolve_endpoints` with the flags of :func:`add_endpoint_arguments`."""
    return resolve_endpoints(
        getattr(args, "data_dir", None) or DEFAULT_DATA_DIR,
        database_url=getattr(args, "database_url", None),
        nats_url=getattr(args, "nats", None),
        prefix=getattr(args, "prefix", None),
        creds=getattr(args, "creds", None),
        service=service,
    )


def redact(url: str) -> str:
    """``url`` without its password."""
    head, at, tail = url.rpartition("@")
    if not at or ":" not in head.split("//", 1)[-1]:
        return url
    scheme, _, user = head.partition("//")
    return f"{scheme}//{user.split(':', 1)[0]}:***@{tail}"


#: Besides what :func:`~services.runtime.ground.outages.is_unreachable` recognises: an unknown
#: host (a plain ``OSError``), a server out of connections.
_NOT_USABLE: Final[tuple[type[BaseException], ...]] = (
    OSError,
    asyncpg.TooManyConnectionsError,
    nats.errors.TimeoutError,
)
_UNREACHABLE_HINT: Final = "is it running? (`dracap up` starts one)"
#: Driver exceptions that mean "the server cannot be used", and what to tell the user.
_HINTS: Final[tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...]] = (
    (asyncpg.InvalidCatalogNameError, "create it, or point at the database `dracap up` runs"),
    (asyncpg.UndefinedTableError, "the database has no dracap schema: run `dracap db upgrade`"),
    (
        (asyncpg.InvalidAuthorizationSpecificationError, nats.errors.AuthorizationError),
        "check the user and password of the URL",
    ),
    (
        (nats.errors.SecureConnRequiredError, nats.errors.SecureConnWantedError),
        "the server and the URL disagree on TLS",
    ),
    (_NOT_USABLE, _UNREACHABLE_HINT),
)


@contextlib.contextmanager
def reaching(server: Server, url: str) -> Iterator[None]:
    """Turn the driver's "cannot use this server" exceptions into :class:`ServerUnavailable`.

    Everything else (a bug, a violated constraint) passes through unchanged.
    """
    try:
        yield
    except EndpointError:
        raise
    except Exception as exc:
        hint = next((text for types, text in _HINTS if isinstance(exc, types)), None)
        if hint is None and is_unreachable(exc):
            hint = _UNREACHABLE_HINT
        if hint is None:
            raise
        detail = " ".join(str(exc).split()) or type(exc).__name__  # one line
        raise ServerUnavailable(f"{server} at {redact(url)}: {detail}; {hint}") from exc
