"""The broker's accounts, users and permissions (what ``dracap auth init`` writes).

nats-server enforces every boundary of the bus; this module says what it enforces. It
reads the namespaces and nodes of an installation and writes, under an auth directory
(``<data-dir>/auth`` by default):

* ``accounts.conf``: the ``accounts`` block for nats-server (public keys only; start a
  server with ``-c accounts.conf`` or ``include`` it from the server's own file);
* ``directory.json``: every user's public facts, from which a service names the
  sender of a request (:func:`services.runtime.bus.credentials.caller_of`,
  :func:`~services.runtime.bus.credentials.principal_of`);
* ``creds/<user>.nk``: one NKey seed file per user, mode 0600 — the seed alone, as the
  ``nats`` CLI (``--nkey``) and nats-py (``nkeys_seed=``) read it
  (:mod:`services.runtime.bus.credentials`).

Accounts
--------
Subjects never cross accounts except where an account exports them and another imports
them; a user reaches only its own account's subjects, and only those its permissions
allow.

* ``JETSTREAM`` holds the JetStream — the events stream and its durable consumers —
  and **no user at all**. JetStream answers a request in the account it lives in; were
  a user to live there, a request whose reply subject names a JetStream API subject
  (``$JS.API.STREAM.PURGE.…``) would have JetStream's own answer (a pull request's
  status, an ack's confirmation, a publish acknowledgement) delete or purge whatever
  that subject names. It exports ``$JS.API.>`` (one export), ``$JS.ACK.<stream>.>`` and
  ``{p}.ev.>`` to the accounts below, and each of them imports exactly the subjects its
  users' jobs need — the API subjects under the local prefix
  :data:`~services.runtime.bus.credentials.JS_API_PREFIX`, because nats-server answers
  ``$JS.API.>`` in every account itself. An answer to a request made across an import
  comes back into the requester's account, on the reply subject it named: there,
  nothing but that account's own imports exists, and nats-server does not let a
  message that came in through one import leave through another import of the same
  export. So a user's credential reaches no JetStream operation beyond its account's
  imports, whatever reply subject it names.
* ``RELAY`` (the relay), ``RESERVATION`` (the reservation workers), ``ENFORCEMENT``
  (the enforcement service): one account per service kind, each importing its own
  JetStream subjects. ``LEDGER`` (the audit and billing subscribers) has no JetStream
  subject at all: they read the log, not the bus (:mod:`services.runtime.delivery.projecting`);
  it only answers their queries.
* ``DRACAP`` holds the claims API: it exports the API and watch subjects to the
  tenants' and operators' accounts, and imports the ledger's query subjects from
  ``LEDGER`` (``share: true``), so a tenant's audit or usage query crosses two imports
  and the ledger still sees who asked. It has no JetStream subject at all.
* ``NODES`` holds every node agent; it imports ``{p}.node.*.>`` from ``ENFORCEMENT``
  (``share: true``: the enforcement service learns which agent sent each request) and
  the consumers' next-message and ack subjects, each once for every node (a wildcard);
  each agent's permissions name its own node's only. ``ENFORCEMENT`` imports the creation
  and reading of any node's durable likewise (:func:`_agents_imports`).
* ``TENANT_<namespace>`` per namespace and ``OPERATORS``: the API and watch subjects
  their users may use, from ``DRACAP``.

===================================== ========================= ===========================
exported by                           to                        imported as
===================================== ========================= ===========================
JETSTREAM service ``{p}.ev.>``        RELAY                     the same subjects
JETSTREAM service ``$JS.API.>``       RELAY, RESERVATION,       per account, its own
                                      ENFORCEMENT, NODES        operations, under
                                                                ``JS.API.…``
JETSTREAM service ``$JS.ACK.<s>.>``   RESERVATION, NODES        its own durables' acks
LEDGER service ``{p}.api.*.claims.    DRACAP                    ``share: true``
audit|usage``, ``{p}.admin.audit|
usage.list``
ENFORCEMENT service ``{p}.node.*.>``  NODES                     ``share: true``
DRACAP service ``{p}.api.<ns>.        TENANT_<ns>               ``share: true``
claims.>``
DRACAP service ``{p}.api.*.claims.>`` OPERATORS                 ``share: true``
DRACAP service ``{p}.admin.>``        OPERATORS                 ``share: true``
DRACAP stream ``{p}.watch.<ns>.>``    TENANT_<ns>
DRACAP stream ``{p}.watch.>``         OPERATORS
===================================== ========================= ===========================

The service exports answer with ``response_type: stream``: a large reply comes in
several messages (:mod:`services.runtime.bus.replies`), a pull request in many.

Users and their permissions
---------------------------
On top of the accounts, every user may publish and subscribe only to what its work
needs (:func:`permissions_of`); anything else is refused by the server with a
permissions violation. docs/security.md has the table, and a test tries every
JetStream operation and subject class with every kind of credential against it.
Which service owns (creates) each durable consumer is :mod:`services.durables`'s.

"Replies" are up to :data:`~services.runtime.bus.replies.MAX_REPLY_PARTS` messages to the
reply subject of each request received, within
:data:`~services.runtime.bus.replies.REPLY_WINDOW_S` of its arrival (``allow_responses``
with ``max`` and ``expires``: without ``expires`` the server keeps a record of every
request a service ever received; replies.py says why). "Its inbox" is a prefix of
the user's own (:attr:`Principal.inbox_prefix`), so a reply or a pulled message meant for
one user never reaches another. An agent can neither publish to the event subjects nor
pull another node's consumer.

The node agents' durables are the enforcement service's (:mod:`services.durables`): it
creates each when its agent takes a lease, and again when the agent finds it missing;
an agent creates none and reads none of the API's consumer information.

Keys are kept
-------------
Running ``init`` again keeps every existing user's key — credentials already handed
out stay valid —, adds the users of new namespaces and nodes, and drops the others.
The JSON ``.creds`` files of earlier versions are read once for their keys, replaced by
``.nk`` files and removed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import nkeys

from events.model import Namespace, ResourceSlice
from events.subjects import BusNames, node_token
from services import durables
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.credentials import (
    ACCOUNTS,
    CREDS_DIR,
    DEFAULT_OPERATOR,
    JETSTREAM_ACCOUNT,
    JS_API_PREFIX,
    LEGACY_SUFFIX,
    NODES_ACCOUNT,
    OPERATORS_ACCOUNT,
    SEED_SUFFIX,
    SERVICES_ACCOUNT,
    AuthDir,
    CredentialError,
    Directory,
    Principal,
    legacy_seed,
    public_key_of,
    read_credential,
    write_private,
)
from services.runtime.bus.jetstream import Durable
from services.runtime.bus.replies import MAX_REPLY_PARTS, REPLY_WINDOW_S
from services.runtime.delivery.pulling import MAX_EXPIRES_S

__all__ = [
    "SERVICES",
    "Installation",
    "accounts_config",
    "init_auth",
    "permissions_of",
]

#: The service kinds with a user each (``dracap up`` connects each with its own).
SERVICES: Final = ("relay", "claims", "reservation", "ledger", "enforcement")
#: How long the broker keeps the way back for the answers to one JetStream request after
#: the last one: longer than any pull request waits (a service's expires within a
#: second, a node agent's within :data:`~services.runtime.delivery.pulling.MAX_EXPIRES_S`), with
#: room to spare. A request that outlived it (an agent's 20 s ones under "10s", once)
#: stayed at the server with nobody to answer: the messages it was given were lost until
#: the ack wait brought them back, 30 s later, and its end status never came.
JS_RESPONSE_THRESHOLD: Final = f"{round(MAX_EXPIRES_S + 10)}s"
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
            seed = legacy_seed(auth.legacy_path(wanted)) or _new_seed()
        principal = msgspec.structs.replace(wanted, public_key=public_key_of(seed))
        write_private(path, seed.encode() + b"\n")
        principals.append(principal)
        keep.add(path)
    for suffix in (SEED_SUFFIX, LEGACY_SUFFIX):
        for old in (auth.path / CREDS_DIR).glob("*" + suffix):
            if old not in keep:
                old.unlink()
    names = BusNames(prefix=installation.prefix)
    config = accounts_config(principals, names, list(installation.namespaces), installation.nodes)
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
        if self.allow_responses:  # a reply may come in parts, within a window (replies.py)
            config["allow_responses"] = {"max": MAX_REPLY_PARTS, "expires": f"{REPLY_WINDOW_S}s"}
        return config


def _api(operation: str) -> str:
    """A JetStream API subject as its importing account names it."""
    return f"{JS_API_PREFIX}.{operation}"


def _created(stream: str, durable: Durable) -> list[str]:
    """The API operations of a durable's owner: create it (its filter in the subject, which
    nats-server checks against the configuration's) and read it."""
    return [
        f"CONSUMER.CREATE.{stream}.{durable.name}.{durable.filter_subject}",
        f"CONSUMER.INFO.{stream}.{durable.name}",
    ]


def _pulled(stream: str, durable: Durable) -> list[str]:
    """The subjects of a durable's reader: the API's next-message request, then its acks."""
    return [
        _api(f"CONSUMER.MSG.NEXT.{stream}.{durable.name}"),
        f"$JS.ACK.{stream}.{durable.name}.>",
    ]


def _relay_operations(names: BusNames) -> list[str]:
    """The stream's operations and the relay's durables' (it owns them)."""
    stream = names.stream
    operations = [f"STREAM.{verb}.{stream}" for verb in ("INFO", "CREATE", "UPDATE", "MSG.GET")]
    for durable in durables.relay_owned(names):
        operations += _created(stream, durable)
    return operations


def _agents_created(names: BusNames, nodes: Iterable[str]) -> list[str]:
    """The operations of the owner of these nodes' agents' durables."""
    return [op for node in nodes for op in _created(names.stream, durables.agent(names, node))]


def _ledger_queries(names: BusNames) -> list[str]:
    """The subjects the audit and billing subscribers answer."""
    subjects = [names.api("*", "audit"), names.api("*", "usage")]
    return [*subjects, names.admin("audit.list"), names.admin("usage.list")]


def node_subjects(names: BusNames, node: str) -> str:
    """Where ``node``'s agent sends its requests to the enforcement service."""
    return f"{names.prefix}.node.{node_token(node)}.>"


def permissions_of(principal: Principal, names: BusNames, nodes: Sequence[str] = ()) -> Permissions:
    """What ``principal`` may publish and subscribe to (see the module docstring);
    ``nodes``: the installation's, whose durables the enforcement service creates."""
    p, stream = names.prefix, names.stream
    inbox = f"{principal.inbox_prefix}.>"
    if principal.kind == "tenant":
        ns = principal.namespace
        assert ns is not None
        return Permissions([names.api(ns, ">")], [f"{p}.watch.{ns}.>", inbox])
    if principal.kind == "operator":
        return Permissions([names.api("*", ">"), names.admin(">")], [f"{p}.watch.>", inbox])
    if principal.kind == "agent":
        node = principal.node or principal.name
        publish = [node_subjects(names, node), *_pulled(stream, durables.agent(names, node))]
        return Permissions(publish, [inbox])
    if principal.name == "relay":
        publish = [names.events_subjects, *(_api(op) for op in _relay_operations(names))]
        return Permissions(publish, [inbox])
    if principal.name == "claims":
        subscribe = [names.api("*", ">"), names.admin(">"), "$SRV.>", inbox]
        return Permissions([f"{p}.watch.>"], subscribe, allow_responses=True)
    if principal.name == "reservation":
        publish = [s for d in durables.reservation(names) for s in _pulled(stream, d)]
        return Permissions(publish, [inbox])
    if principal.name == "ledger":  # the audit and billing queries (they read the log)
        subscribe = [*_ledger_queries(names), "$SRV.>", inbox]
        return Permissions([], subscribe, allow_responses=True)
    if principal.name == "enforcement":
        publish = [_api(op) for op in _agents_created(names, sorted(nodes))]
        subscribe = [f"{p}.node.*.>", "$SRV.>", inbox]
        return Permissions(publish, subscribe, allow_responses=True)
    raise CommandError(f"no permissions defined for service {principal.name!r}", ExitCode.ERROR)


# --- the accounts ------------------------------------------------------------------------------


def _js_imports(operations: Iterable[str]) -> list[dict[str, Any]]:
    """Imports of JetStream API operations, each under the local API prefix."""
    return [
        {"service": {"account": JETSTREAM_ACCOUNT, "subject": f"$JS.API.{op}"}, "to": _api(op)}
        for op in operations
    ]


def _pull_imports(names: BusNames, readable: Iterable[Durable]) -> list[dict[str, Any]]:
    """Imports of what the reader of each durable needs: next-message requests, acks."""
    stream = names.stream
    imports: list[dict[str, Any]] = []
    for durable in readable:
        imports += _js_imports([f"CONSUMER.MSG.NEXT.{stream}.{durable.name}"])
        ack = f"$JS.ACK.{stream}.{durable.name}.>"
        imports.append({"service": {"account": JETSTREAM_ACCOUNT, "subject": ack}})
    return imports


def _jetstream_account(names: BusNames) -> dict[str, Any]:
    """The stream's account: no users; one export of the whole API (so that an answer
    that came in through one API import cannot leave through another), the acks of the
    stream's consumers, and the event subjects for the relay."""
    pulling = [ACCOUNTS["reservation"], NODES_ACCOUNT]
    api_users = [ACCOUNTS["relay"], *pulling, ACCOUNTS["enforcement"]]
    return {
        "jetstream": "enabled",
        "exports": [
            {"service": names.events_subjects, "accounts": [ACCOUNTS["relay"]]},
            {
                "service": "$JS.API.>",
                "accounts": api_users,
                "response_type": "stream",
                "response_threshold": JS_RESPONSE_THRESHOLD,
            },
            {"service": f"$JS.ACK.{names.stream}.>", "accounts": pulling},
        ],
    }


def _agents_imports(names: BusNames) -> list[dict[str, Any]]:
    """What the owner of the node agents' durables (the enforcement service) imports to
    create and read them, for every node at once: one wildcard import per operation (an
    import per node makes nats-server's start quadratic in the fleet: 4.4 s at 5,000
    nodes). Its permissions name each node's durable and filter."""
    stream = names.stream
    filters = f"{names.prefix}.ev.*.*.>"  # a node's filter, whichever node
    return [
        {"service": {"account": JETSTREAM_ACCOUNT, "subject": f"$JS.API.{op}"}, "to": _api(op)}
        for op in (f"CONSUMER.CREATE.{stream}.*.{filters}", f"CONSUMER.INFO.{stream}.*")
    ]


def _service_accounts(
    names: BusNames, users: Callable[[str], list[dict[str, Any]]]
) -> dict[str, Any]:
    """The accounts of the services and the node agents (module docstring)."""
    p, stream = names.prefix, names.stream
    relay, ledger, enforcement = ACCOUNTS["relay"], ACCOUNTS["ledger"], ACCOUNTS["enforcement"]
    nodes_imports = [
        _service_import(f"{p}.node.*.>", enforcement),
        *_js_imports([f"CONSUMER.MSG.NEXT.{stream}.*"]),
        {"service": {"account": JETSTREAM_ACCOUNT, "subject": f"$JS.ACK.{stream}.>"}},
    ]
    events = {"service": {"account": JETSTREAM_ACCOUNT, "subject": names.events_subjects}}
    return {
        JETSTREAM_ACCOUNT: _jetstream_account(names),
        relay: {"users": users(relay), "imports": [events, *_js_imports(_relay_operations(names))]},
        ACCOUNTS["reservation"]: {
            "users": users(ACCOUNTS["reservation"]),
            "imports": _pull_imports(names, durables.reservation(names)),
        },
        ledger: {
            "users": users(ledger),
            "exports": [_service_export(s, SERVICES_ACCOUNT) for s in _ledger_queries(names)],
        },
        enforcement: {
            "users": users(enforcement),
            "imports": _agents_imports(names),
            "exports": [_service_export(f"{p}.node.*.>", NODES_ACCOUNT)],
        },
        NODES_ACCOUNT: {"users": users(NODES_ACCOUNT), "imports": nodes_imports},
    }


def accounts_config(
    principals: Sequence[Principal],
    names: BusNames,
    namespaces: Iterable[str],
    nodes: Sequence[str] = (),
) -> str:
    """The ``accounts`` block of nats-server's configuration (JSON values)."""
    p = names.prefix
    by_account: dict[str, list[Principal]] = {}
    for principal in principals:
        by_account.setdefault(principal.account, []).append(principal)

    def users(account: str) -> list[dict[str, Any]]:
        return [_user(u, names, nodes) for u in by_account.get(account, [])]

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
        **_service_accounts(names, users),
        SERVICES_ACCOUNT: {
            "users": users(SERVICES_ACCOUNT),
            "exports": exports,
            "imports": [_service_import(s, ACCOUNTS["ledger"]) for s in _ledger_queries(names)],
        },
        OPERATORS_ACCOUNT: {
            "users": users(OPERATORS_ACCOUNT),
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
            "users": users(account),
            "imports": [
                _service_import(names.api(ns, ">")),
                {"stream": {"account": SERVICES_ACCOUNT, "subject": f"{p}.watch.{ns}.>"}},
            ],
        }
    body = msgspec.json.format(msgspec.json.encode(accounts)).decode()
    return f"# written by `dracap auth init`: public keys only\naccounts: {body}\n"


def _user(principal: Principal, names: BusNames, nodes: Sequence[str]) -> dict[str, Any]:
    return {
        "nkey": principal.public_key,
        "permissions": permissions_of(principal, names, nodes).as_config(),
    }


def _service_export(subject: str, account: str) -> dict[str, Any]:
    """A service ``subject`` exported to ``account``; a reply may come in parts, so the
    export lets several messages answer one request (``response_type: stream``)."""
    return {"service": subject, "accounts": [account], "response_type": "stream"}


def _service_import(subject: str, account: str = SERVICES_ACCOUNT) -> dict[str, Any]:
    """A service ``subject`` of ``account``; the server stamps who asks (``share``)."""
    return {"service": {"account": account, "subject": subject}, "share": True}


# --- the installation that dracap auth init and dracap up write accounts for ---------------------


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
