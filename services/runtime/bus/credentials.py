"""Who a process is on the bus: credential files, and who sent a request.

Credentials
-----------
Every user of the broker — each service kind, each node's agent, each operator and
each tenant user — has an NKey pair (Ed25519). The broker's configuration holds only
the public keys (:mod:`services.brokerauth` writes it); the seed lives in one
credential file per user, an **NKey seed file** (``<user>.nk``, mode 0600, never
logged): the seed alone, on one line, exactly what the ``nats`` CLI reads with
``--nkey FILE`` and nats-py with ``nats.connect(nkeys_seed=FILE)``. Nothing else is
needed to act as that user: who the user is follows from its public key (the public
:class:`Directory` names it), and the one inbox its permissions let it subscribe to is
named by the key too (:func:`inbox_of`: ``_INBOX_<public key>``), so a standard client
passes ``inbox_prefix`` (``--inbox-prefix``) and nothing of dracap's. Replies to one
user never reach another user of the same account.

Files of earlier versions (JSON named ``.creds``, a name that means NATS's decorated
JWT format everywhere else) are refused with one line saying to run ``dracap auth
init`` again, which keeps their keys and writes the ``.nk`` files.

Accounts
--------
Every kind of user lives in a broker account of its own (:attr:`Principal.account`;
:mod:`services.brokerauth` says what each account imports and exports). None of them
holds the JetStream: it lives in :data:`JETSTREAM_ACCOUNT`, which has no users, and an
account that uses JetStream imports exactly the API subjects its job needs, under the
local prefix :data:`JS_API_PREFIX` (a client's JetStream context uses that prefix:
:attr:`Credential.js_api_prefix`). So whatever a client names as the reply subject of
a request, JetStream's answer arrives in the client's own account, where nothing but
its own imports can take it further.

Who sent a request
------------------
Tenants, operators and node agents live in accounts of their own; the services'
accounts export the API subjects to them, and their imports are ``share: true``. For
every request that crosses such an import, nats-server writes a ``Nats-Request-Info``
header with the requester's account and NKey, replacing any header of that name the
client sent. :func:`principal_of` reads it: the NKey names the user in the public
:class:`Directory`, and the account must be that user's. :func:`caller_of` turns a
tenant or an operator into an actor. Nothing of the payload counts. Without a broker
that does this (``dracap up --insecure``) nobody is known: :func:`caller_of` answers
``None`` and the API records ``anonymous`` actors (:mod:`events.actors`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import msgspec

from events.actors import Actor
from events.subjects import node_token
from services.runtime.ground.errors import PermanentError

__all__ = [
    "ACCOUNTS",
    "AUTH_DIR",
    "JETSTREAM_ACCOUNT",
    "JS_API_PREFIX",
    "NODES_ACCOUNT",
    "OPERATORS_ACCOUNT",
    "REQUEST_INFO_HEADER",
    "SERVICES_ACCOUNT",
    "TENANT_ACCOUNT_PREFIX",
    "AuthDir",
    "Credential",
    "CredentialError",
    "Directory",
    "Principal",
    "caller_of",
    "file_stem",
    "inbox_of",
    "legacy_seed",
    "principal_of",
    "public_key_of",
    "read_credential",
    "read_directory",
    "write_private",
]

PrincipalKind = Literal["service", "agent", "operator", "tenant"]

#: The claims API's account: it exports the API and watch subjects to tenants and operators.
SERVICES_ACCOUNT: Final = "DRACAP"
#: The account holding the JetStream (the events stream and its consumers); no users.
JETSTREAM_ACCOUNT: Final = "JETSTREAM"
OPERATORS_ACCOUNT: Final = "OPERATORS"
NODES_ACCOUNT: Final = "NODES"
TENANT_ACCOUNT_PREFIX: Final = "TENANT_"
#: The account of each service user (by name); the claims API's is :data:`SERVICES_ACCOUNT`.
ACCOUNTS: Final = {
    "relay": "RELAY",
    "claims": SERVICES_ACCOUNT,
    "reservation": "RESERVATION",
    "ledger": "LEDGER",
    "enforcement": "ENFORCEMENT",
}
#: Where an account that uses JetStream finds the API subjects it imports (the server
#: answers ``$JS.API.>`` in every account itself, so an import must not keep that name).
JS_API_PREFIX: Final = "JS.API"
REQUEST_INFO_HEADER: Final = "Nats-Request-Info"
AUTH_DIR: Final = "auth"  #: under a data directory
ACCOUNTS_FILE: Final = "accounts.conf"
DIRECTORY_FILE: Final = "directory.json"
CREDS_DIR: Final = "creds"
#: The name ending of an NKey seed file.
SEED_SUFFIX: Final = ".nk"
#: The name ending of the JSON credential files of earlier versions (``auth init`` reads
#: their keys once and removes them).
LEGACY_SUFFIX: Final = ".creds"
_USER_SEED: Final = re.compile(r"SU[A-Z2-7]{56}")
DEFAULT_OPERATOR: Final = "operator"
_T = TypeVar("_T")


class CredentialError(PermanentError):
    """A credential or directory file that cannot be read or is not one."""


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """One user of the broker: public facts only."""

    name: str
    kind: PrincipalKind
    public_key: str
    namespace: str | None = None  #: a tenant's namespace
    node: str | None = None  #: an agent's node

    @property
    def account(self) -> str:
        """The broker account this user belongs to."""
        if self.kind == "tenant":
            assert self.namespace is not None
            return TENANT_ACCOUNT_PREFIX + self.namespace
        if self.kind == "operator":
            return OPERATORS_ACCOUNT
        if self.kind == "agent":
            return NODES_ACCOUNT
        return ACCOUNTS.get(self.name, SERVICES_ACCOUNT)

    @property
    def inbox_prefix(self) -> str:
        """The only inbox the user may subscribe to (:func:`inbox_of` its key)."""
        return inbox_of(self.public_key)


def inbox_of(public_key: str) -> str:
    """The inbox prefix of the user with ``public_key``: one subject token, unique per
    user, which anyone holding the user's seed can name (the key follows from it)."""
    return f"_INBOX_{public_key}"


def public_key_of(seed: str) -> str:
    """The public key of an NKey seed."""
    import nkeys  # (the CLI's start-up: only a command that logs in needs it)

    key: bytes = nkeys.from_seed(bytearray(seed.encode())).public_key
    return key.decode()


class Credential(msgspec.Struct, frozen=True, kw_only=True):
    """A user's secret seed (what one ``.nk`` file holds) and, where known, who it is."""

    seed: str
    #: the user's public facts, when the caller knows them (:class:`AuthDir` does)
    principal: Principal | None = None

    def __repr__(self) -> str:  # the seed must not reach a log line by accident
        who = self.principal
        return f"Credential({who.kind}:{who.name})" if who else f"Credential({self.public_key})"

    __str__ = __repr__

    @property
    def public_key(self) -> str:
        return public_key_of(self.seed)

    @property
    def inbox_prefix(self) -> str:
        """The one inbox this user's permissions let it subscribe to."""
        return inbox_of(self.public_key)

    def connect_options(self) -> dict[str, Any]:
        """What ``nats.connect`` needs to log in as this user."""
        return {"nkeys_seed_str": self.seed, "inbox_prefix": self.inbox_prefix}

    @property
    def js_api_prefix(self) -> str:
        """The JetStream API prefix of this user's account (see "Accounts" above)."""
        return JS_API_PREFIX


class Directory(msgspec.Struct, frozen=True):
    """Every principal of one installation, by public key (public, not secret)."""

    principals: list[Principal]

    def index(self) -> dict[str, Principal]:
        """Every principal by its public key (build it once, look up per request)."""
        return {p.public_key: p for p in self.principals}


class _RequestInfo(msgspec.Struct):
    """The part of nats-server's ``Nats-Request-Info`` header that says who asked."""

    acc: str = ""
    user: str = ""


_INFO: Final = msgspec.json.Decoder(_RequestInfo)


def _request_info(headers: dict[str, str] | None) -> _RequestInfo | None:
    raw = (headers or {}).get(REQUEST_INFO_HEADER)
    if not raw:
        return None
    try:
        info = _INFO.decode(raw)
    except msgspec.DecodeError:
        return None
    return info if info.user else None


def principal_of(
    headers: dict[str, str] | None, known: Mapping[str, Principal]
) -> Principal | None:
    """The user the broker says sent a request: its NKey is ``known`` (a
    :meth:`Directory.index`) and the account is that user's; None otherwise.

    A request a user's JetStream answer carries across an import (a reply subject
    pointed at an API subject) names no user of the requester's account: None.
    """
    info = _request_info(headers)
    if info is None:
        return None
    principal = known.get(info.user)
    return principal if principal is not None and principal.account == info.acc else None


def caller_of(headers: dict[str, str] | None, known: Mapping[str, Principal]) -> Actor | None:
    """Who sent a request, from the header the broker wrote; None when it says nothing.

    A tenant's namespace comes from its account alone; an NKey ``known`` (a
    :meth:`Directory.index`) does not hold is named by the key itself (still
    authenticated by the broker).
    """
    info = _request_info(headers)
    if info is None:
        return None
    principal = known.get(info.user)
    user = principal.name if principal is not None else info.user
    if info.acc == OPERATORS_ACCOUNT:
        return Actor.operator(user)
    if info.acc.startswith(TENANT_ACCOUNT_PREFIX) and len(info.acc) > len(TENANT_ACCOUNT_PREFIX):
        return Actor.tenant(user, info.acc.removeprefix(TENANT_ACCOUNT_PREFIX))
    return None


def file_stem(principal: Principal) -> str:
    """The name of a user's credential file, less its ending."""
    if principal.kind == "tenant":
        return f"tenant-{principal.namespace}-{principal.name}"
    if principal.kind == "agent":
        return f"agent-{node_token(principal.name)}"
    return f"{principal.kind}-{principal.name}"


class AuthDir:
    """The files of one auth directory, as :mod:`services.brokerauth` writes them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def accounts(self) -> Path:
        return self.path / ACCOUNTS_FILE

    @property
    def directory(self) -> Path:
        return self.path / DIRECTORY_FILE

    def exists(self) -> bool:
        return self.accounts.exists() and self.directory.exists()

    def creds_path(self, principal: Principal) -> Path:
        """The user's NKey seed file."""
        return self.path / CREDS_DIR / (file_stem(principal) + SEED_SUFFIX)

    def legacy_path(self, principal: Principal) -> Path:
        """The user's JSON credential file of an earlier version."""
        return self.path / CREDS_DIR / (file_stem(principal) + LEGACY_SUFFIX)

    def credential_of(self, principal: Principal) -> Credential:
        """``principal``'s credential (its key read from its seed file)."""
        return self._credential(principal)

    def _credential(self, principal: Principal) -> Credential:
        seed = read_credential(self.creds_path(principal)).seed
        return Credential(
            seed=seed, principal=msgspec.structs.replace(principal, public_key=public_key_of(seed))
        )

    def service(self, name: str) -> Credential:
        return self._credential(Principal(name=name, kind="service", public_key=""))

    def agent(self, node: str) -> Credential:
        return self._credential(Principal(name=node, kind="agent", public_key="", node=node))

    def operator(self, name: str = DEFAULT_OPERATOR) -> Credential:
        return self._credential(Principal(name=name, kind="operator", public_key=""))

    def operator_path(self, name: str = DEFAULT_OPERATOR) -> Path:
        return self.creds_path(Principal(name=name, kind="operator", public_key=""))

    def has_service(self, name: str) -> bool:
        return self.creds_path(Principal(name=name, kind="service", public_key="")).exists()

    def has_agent(self, node: str) -> bool:
        return self.creds_path(Principal(name=node, kind="agent", public_key="")).exists()

    def tenant(self, namespace: str, user: str) -> Credential:
        return self._credential(
            Principal(name=user, kind="tenant", public_key="", namespace=namespace)
        )


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``, readable by its owner only, replacing it atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(partial, path)


def read_credential(path: str | os.PathLike[str]) -> Credential:
    """The NKey seed file at ``path``, or :class:`CredentialError` saying why not."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("ascii", "replace").strip()
    except FileNotFoundError:
        raise CredentialError(f"{path}: no such credential file") from None
    except OSError as exc:
        raise CredentialError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if text.startswith("{"):
        raise CredentialError(
            f"{path}: a credential file of an earlier dracap (JSON): run `dracap auth init` "
            "again, which keeps its key and writes NKey seed files (.nk) to use instead"
        )
    if "BEGIN NATS USER JWT" in text:
        raise CredentialError(
            f"{path}: a decorated NATS .creds file (JWT): dracap's broker uses NKeys; "
            "pass the .nk file of `dracap auth init`"
        )
    if not _USER_SEED.fullmatch(text):
        raise CredentialError(f"{path}: not an NKey user seed file (SU..., of `dracap auth init`)")
    if not _checksum_holds(text):  # (nkeys does not check it; nats-server's tools do)
        raise CredentialError(f"{path}: not an NKey user seed file (bad checksum)")
    return Credential(seed=text)


def _checksum_holds(seed: str) -> bool:
    """Whether an NKey's CRC-16 (its last two bytes, little-endian) matches the rest."""
    import base64

    import nkeys

    raw = base64.b32decode(seed + "=" * (-len(seed) % 8))
    return bytes(nkeys.crc16_checksum(raw[:-2])) == raw[-2:]


def legacy_seed(path: Path) -> str | None:
    """The seed of an earlier version's JSON credential file at ``path``, if one is there."""
    try:
        seed = msgspec.json.decode(path.read_bytes(), type=_LegacyCredential).seed
    except (OSError, msgspec.DecodeError):
        return None
    return seed if _USER_SEED.fullmatch(seed) else None


class _LegacyCredential(msgspec.Struct):
    seed: str


def read_directory(path: str | os.PathLike[str]) -> Directory:
    """The public directory of principals at ``path``."""
    return _read(Path(path), Directory, "directory")


def _read(path: Path, typ: type[_T], what: str) -> _T:
    """A JSON file of ``typ``."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=typ)
    except FileNotFoundError:
        raise CredentialError(f"{path}: no such {what} file") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise CredentialError(f"{path}: not a dracap {what} file: {exc}") from None
