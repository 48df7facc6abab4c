"""The broker's accounts, users and permissions: ``dracap auth init``.

nats-server enforces the tenant boundary; this module says what it enforces. It reads
the namespaces and nodes of an installation and writes, under an auth directory
(``<data-dir>/auth`` by default):

* ``accounts.conf``: the ``accounts`` block for nats-server (public keys only; start a
  server with ``-c accounts.conf`` or ``include`` it from the server's own file);
* ``directory.json``: every user's public facts, from which the claims API names the
  actor of a request (:func:`services.runtime.credentials.caller_of`);
* ``creds/<file>.creds``: one credential file per user (its NKey seed), mode 0600.

Accounts
--------
``DRACAP`` holds the services and the node agents, and the only JetStream. Each
tenant namespace is an account ``TENANT_<namespace>``, the operators one account
``OPERATORS``. Subjects never cross accounts except where ``DRACAP`` exports them:

===================================== ========================= ===========================
exported by DRACAP                    to                        imported as
===================================== ========================= ===========================
service ``{p}.api.<ns>.claims.>``     ``TENANT_<ns>``           ``share: true``
service ``{p}.api.*.claims.>``        ``OPERATORS``             ``share: true``
service ``{p}.admin.>``               ``OPERATORS``             ``share: true``
stream ``{p}.watch.<ns>.>``           ``TENANT_<ns>``
stream ``{p}.watch.>``                ``OPERATORS``
===================================== ========================= ===========================

The service exports answer with ``response_type: stream``: a large reply comes in
several messages (:mod:`services.runtime.replies`).

So a tenant cannot even name another namespace's subjects, the event stream or the
JetStream API: they do not exist in its account. ``share: true`` makes the server
stamp each request with the requester's account and key (``Nats-Request-Info``).

Users and their permissions
---------------------------
On top of the accounts, every user may publish and subscribe only to what its work
needs; anything else is refused by the server with a permissions violation:

=============== ================================================ ==========================
user            publish                                          subscribe
=============== ================================================ ==========================
relay           ``{p}.ev.>``; stream info/create/update          its inbox
claims          ``{p}.watch.>``; replies to its requests         ``{p}.api.*.claims.>``,
                                                                 ``{p}.admin.>``, ``$SRV.>``
reservation     its durable consumers: create, info, next, ack   its inbox
ledger          the ``audit`` and ``billing`` consumers (filter  ``{p}.api.*.claims.audit``
                ``{p}.ev.>``): create, info, next, ack; replies  and ``.usage``,
                                                                 ``{p}.admin.audit.list``,
                                                                 ``{p}.admin.usage.list``,
                                                                 ``$SRV.>``, its inbox
agent-<node>    its node's consumer only: create with the        its inbox
                filter ``{p}.ev.*.<node>.>``, info, next, ack
operator        ``{p}.api.*.claims.>``, ``{p}.admin.>``          ``{p}.watch.>``, its inbox
tenant user     ``{p}.api.<ns>.claims.>``                        ``{p}.watch.<ns>.>``, its inbox
=============== ================================================ ==========================

"Replies" are up to :data:`~services.runtime.replies.MAX_REPLY_PARTS` messages to the
reply subject of each request received (``allow_responses``): a large reply comes in
parts. "Its inbox" is a prefix of the user's own (:attr:`Principal.inbox_prefix`), so a reply
or a pulled message meant for one user never reaches another. An agent can neither
publish to the event subjects nor open a consumer on another node's filter; a consumer
created with the filter in its subject is checked by the server against the filter of
its configuration.

Keys are kept
-------------
Running ``init`` again keeps every existing user's key — credentials already handed
out stay valid —, adds the users of new namespaces and nodes, and drops the others.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import nkeys

from events.model import Namespace, ResourceSlice
from events.subjects import BusNames, node_token
from services.enforcement.agent import consumer_name
from services.exitcodes import CommandError, ExitCode
from services.reservation.service import FEEDS
from services.runtime.credentials import (
    AUTH_DIR,
    CREDS_DIR,
    DEFAULT_OPERATOR,
    OPERATORS_ACCOUNT,
    SERVICES_ACCOUNT,
    AuthDir,
    Credential,
    CredentialError,
    Directory,
    Principal,
    read_credential,
    write_private,
)
from services.runtime.replies import MAX_REPLY_PARTS

__all__ = [
    "SERVICES",
    "Installation",
    "accounts_config",
    "init_auth",
    "permissions_of",
]

#: The service kinds with a user each (``dracap up`` connects each with its own).
SERVICES: Final = ("relay", "claims", "reservation", "ledger")
_NAME: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class Installation(msgspec.Struct, frozen=True, kw_only=True):
    """What the broker must know: namespaces with their users, nodes, operators."""

    prefix: str = "dracap"
    namespaces: dict[str, list[str]] = msgspec.field(default_factory=dict)
    nodes: list[str] = msgspec.field(default_factory=list)
    operators: list[str] = msgspec.field(default_factory=lambda: [DEFAULT_OPERATOR])

    def __post_init__(self) -> None:
        for what, names in (
            ("namespace", list(self.namespaces)),
            ("user", [u for users in self.namespaces.values() for u in users]),
            ("operator", self.operators),
        ):
            for name in names:
                if not _NAME.fullmatch(name):
                    raise CommandError(
                        f"{what} {name!r}: must be a DNS label (lower-case letters, digits, '-')",
                        ExitCode.BAD_INPUT,
                    )
        for node in self.nodes:
            node_token(node)  # rejects an empty name


def _principals(installation: Installation) -> list[Principal]:
    wanted = [Principal(name=s, kind="service", public_key="") for s in SERVICES]
    wanted += [
        Principal(name=n, kind="agent", public_key="", node=n) for n in sorted(installation.nodes)
    ]
    wanted += [
        Principal(name=o, kind="operator", public_key="") for o in sorted(installation.operators)
    ]
    wanted += [
        Principal(name=user, kind="tenant", public_key="", namespace=ns)
        for ns, users in sorted(installation.namespaces.items())
        for user in sorted(set(users))
    ]
    return wanted


def _new_seed() -> str:
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode()


def _public_key(seed: str) -> str:
    key: bytes = nkeys.from_seed(bytearray(seed.encode())).public_key
    return key.decode()


def init_auth(auth: AuthDir, installation: Installation) -> list[Principal]:
    """Write the auth directory for ``installation``; returns every principal.

    Existing credential files keep their keys; credential files of principals that
    are no longer wanted are removed.
    """
    principals: list[Principal] = []
    keep: set[Path] = set()
    for wanted in _principals(installation):
        path = auth.creds_path(wanted)
        try:
            seed = read_credential(path).seed
        except CredentialError:
            seed = _new_seed()
        principal = msgspec.structs.replace(wanted, public_key=_public_key(seed))
        write_private(path, msgspec.json.encode(Credential(principal=principal, seed=seed)))
        principals.append(principal)
        keep.add(path)
    for old in (auth.path / CREDS_DIR).glob("*.creds"):
        if old not in keep:
            old.unlink()
    names = BusNames(prefix=installation.prefix)
    config = accounts_config(principals, names, list(installation.namespaces))
    write_private(auth.accounts, config.encode())
    write_private(auth.directory, msgspec.json.format(msgspec.json.encode(Directory(principals))))
    return principals


# --- what each user may do -------------------------------------------------------------------


class Permissions(msgspec.Struct, frozen=True):
    """Subjects one user may publish and subscribe to."""

    publish: list[str]
    subscribe: list[str]
    allow_responses: bool = False

    def as_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "publish": {"allow": self.publish},
            "subscribe": {"allow": self.subscribe},
        }
        if self.allow_responses:  # a reply may come in parts (services.runtime.replies)
            config["allow_responses"] = {"max": MAX_REPLY_PARTS}
        return config


def _consumer(stream: str, durable: str, filter_subject: str) -> list[str]:
    """Publish permissions to run one durable pull consumer with one filter."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{filter_subject}",
        f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def permissions_of(principal: Principal, names: BusNames) -> Permissions:
    """What ``principal`` may publish and subscribe to (see the module docstring)."""
    p, stream = names.prefix, names.stream
    inbox = f"{principal.inbox_prefix}.>"
    stream_info = f"$JS.API.STREAM.INFO.{stream}"
    if principal.kind == "tenant":
        ns = principal.namespace
        assert ns is not None
        return Permissions([names.api(ns, ">")], [f"{p}.watch.{ns}.>", inbox])
    if principal.kind == "operator":
        return Permissions([names.api("*", ">"), names.admin(">")], [f"{p}.watch.>", inbox])
    if principal.kind == "agent":
        node = principal.node or principal.name
        publish = [stream_info, *_consumer(stream, consumer_name(node), names.node_filter(node))]
        return Permissions(publish, [inbox])
    if principal.name == "relay":
        publish = [
            names.events_subjects,
            stream_info,
            f"$JS.API.STREAM.CREATE.{stream}",
            f"$JS.API.STREAM.UPDATE.{stream}",
        ]
        return Permissions(publish, [inbox])
    if principal.name == "claims":
        subscribe = [names.api("*", ">"), names.admin(">"), "$SRV.>", inbox]
        return Permissions([f"{p}.watch.>"], subscribe, allow_responses=True)
    if principal.name == "reservation":
        publish = [stream_info]
        for feed in FEEDS:
            publish += _consumer(stream, f"reservation-{feed}", ">")
        return Permissions(publish, [inbox])
    if principal.name == "ledger":  # the audit and billing subscribers, and their queries
        publish = [stream_info]
        for durable in ("audit", "billing"):
            publish += _consumer(stream, durable, names.events_subjects)
        queries = [names.api("*", "audit"), names.api("*", "usage")]
        queries += [names.admin("audit.list"), names.admin("usage.list"), "$SRV.>"]
        return Permissions(publish, [*queries, inbox], allow_responses=True)
    raise CommandError(f"no permissions defined for service {principal.name!r}", ExitCode.ERROR)


def _user(principal: Principal, names: BusNames) -> dict[str, Any]:
    return {
        "nkey": principal.public_key,
        "permissions": permissions_of(principal, names).as_config(),
    }


def accounts_config(
    principals: Sequence[Principal], names: BusNames, namespaces: Iterable[str]
) -> str:
    """The ``accounts`` block of nats-server's configuration (JSON values)."""
    p = names.prefix
    by_account: dict[str, list[Principal]] = {}
    for principal in principals:
        by_account.setdefault(principal.account, []).append(principal)
    tenants = sorted(set(namespaces))
    exports: list[dict[str, Any]] = []
    for ns in tenants:
        account = f"TENANT_{ns}"
        exports.append(_service_export(names.api(ns, ">"), account))
        exports.append({"stream": f"{p}.watch.{ns}.>", "accounts": [account]})
    exports += [
        _service_export(names.api("*", ">"), OPERATORS_ACCOUNT),
        _service_export(names.admin(">"), OPERATORS_ACCOUNT),
        {"stream": f"{p}.watch.>", "accounts": [OPERATORS_ACCOUNT]},
    ]
    accounts: dict[str, Any] = {
        SERVICES_ACCOUNT: {
            "jetstream": "enabled",
            "users": [_user(u, names) for u in by_account.get(SERVICES_ACCOUNT, [])],
            "exports": exports,
        },
        OPERATORS_ACCOUNT: {
            "users": [_user(u, names) for u in by_account.get(OPERATORS_ACCOUNT, [])],
            "imports": [
                _service_import(names.api("*", ">")),
                _service_import(names.admin(">")),
                {"stream": {"account": SERVICES_ACCOUNT, "subject": f"{p}.watch.>"}},
            ],
        },
    }
    for ns in tenants:
        account = f"TENANT_{ns}"
        accounts[account] = {
            "users": [_user(u, names) for u in by_account.get(account, [])],
            "imports": [
                _service_import(names.api(ns, ">")),
                {"stream": {"account": SERVICES_ACCOUNT, "subject": f"{p}.watch.{ns}.>"}},
            ],
        }
    body = msgspec.json.format(msgspec.json.encode(accounts)).decode()
    return f"# written by `dracap auth init`: public keys only\naccounts: {body}\n"


def _service_export(subject: str, account: str) -> dict[str, Any]:
    """A service ``subject`` exported to ``account``; a reply may come in parts, so the
    export lets several messages answer one request (``response_type: stream``)."""
    return {"service": subject, "accounts": [account], "response_type": "stream"}


def _service_import(subject: str) -> dict[str, Any]:
    return {"service": {"account": SERVICES_ACCOUNT, "subject": subject}, "share": True}


# --- dracap auth init --------------------------------------------------------------------------


def installation_from(
    objects: Iterable[object],
    *,
    prefix: str,
    namespaces: Sequence[str] = (),
    nodes: Sequence[str] = (),
    users: Sequence[str] = (),
    operators: Sequence[str] = (),
) -> Installation:
    """The installation named by manifests (Namespaces, ResourceSlices) and flags.

    Every namespace gets a user of its own name unless ``users`` (``NS/USER``) name
    some for it.
    """
    wanted: dict[str, list[str]] = {}
    node_names = set(nodes)
    for obj in objects:
        if isinstance(obj, Namespace):
            wanted.setdefault(obj.metadata.name, [])
        elif isinstance(obj, ResourceSlice) and obj.spec.node_name:
            node_names.add(obj.spec.node_name)
    for ns in namespaces:
        wanted.setdefault(ns, [])
    for pair in users:
        ns, slash, user = pair.partition("/")
        if not slash or not ns or not user:
            raise CommandError(f"--user {pair!r}: write NAMESPACE/USER", ExitCode.BAD_INPUT)
        wanted.setdefault(ns, []).append(user)
    return Installation(
        prefix=prefix,
        namespaces={ns: users or [ns] for ns, users in wanted.items()},
        nodes=sorted(node_names),
        operators=list(operators) or [DEFAULT_OPERATOR],
    )


def run(args: argparse.Namespace) -> int:
    from events.manifests import ManifestError, load_paths

    try:
        objects = [obj for _, obj in load_paths(args.inventory)] if args.inventory else []
    except ManifestError as exc:
        raise CommandError(str(exc), ExitCode.BAD_INPUT) from None
    installation = installation_from(
        objects,
        prefix=args.prefix,
        namespaces=args.namespace,
        nodes=args.node,
        users=args.user,
        operators=args.operator,
    )
    auth = AuthDir(args.auth_dir or Path(args.data_dir) / AUTH_DIR)
    try:
        principals = init_auth(auth, installation)
    except OSError as exc:
        raise CommandError(
            f"cannot write {auth.path}: {exc.strerror or exc}", ExitCode.ERROR
        ) from None
    counts: dict[str, int] = {}
    for principal in principals:
        counts[principal.kind] = counts.get(principal.kind, 0) + 1
    summary = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    print(f"wrote {auth.accounts} and {auth.directory}")
    print(f"credentials for {summary} in {auth.path / CREDS_DIR} (mode 0600)")
    return ExitCode.OK


def register(sub: Any) -> None:
    parser = sub.add_parser("auth", help="broker accounts, users and credentials")
    actions = parser.add_subparsers(dest="action", required=True)
    init = actions.add_parser(
        "init",
        help="write the broker's accounts and every user's credentials",
        description="Write nats-server accounts (public keys) and one credential file "
        "per user: services, node agents, operators, tenant users.",
    )
    init.add_argument(
        "--inventory",
        nargs="*",
        default=[],
        metavar="PATH",
        help="manifests naming Namespaces and ResourceSlices (their nodes)",
    )
    init.add_argument("--namespace", action="append", default=[], metavar="NS")
    init.add_argument("--node", action="append", default=[], metavar="NODE")
    init.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="NS/USER",
        help="a tenant user (default: one user named like its namespace)",
    )
    init.add_argument("--operator", action="append", default=[], metavar="NAME")
    init.add_argument("--prefix", default="dracap", help="subject prefix (default: dracap)")
    init.add_argument("--data-dir", default=".dracap", metavar="DIR")
    init.add_argument("--auth-dir", metavar="DIR", help="default: <data-dir>/auth")
    init.set_defaults(func=run)
