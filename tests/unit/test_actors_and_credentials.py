"""Actors (events.actors), who sent a request (credentials.caller_of), and auth init's files."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import nkeys
import pytest

from events.actors import Actor, ActorError, parse_actor
from events.subjects import BusNames
from services.brokerauth import (
    SERVICES,
    Installation,
    init_auth,
    installation_from,
    permissions_of,
)
from services.exitcodes import CommandError
from services.runtime.bus.credentials import (
    REQUEST_INFO_HEADER,
    AuthDir,
    CredentialError,
    Directory,
    Principal,
    caller_of,
    principal_of,
    read_credential,
)

ACTORS = [
    (Actor.tenant("alice", "tenant-a"), "tenant:alice@tenant-a"),
    (Actor.operator("operator"), "operator:operator"),
    (Actor.agent("ip-10-0-0-1.ec2.internal"), "agent:ip-10-0-0-1.ec2.internal"),
    (Actor.system("reservation-0"), "system:reservation-0"),
    (Actor.anonymous("tenant-a"), "anonymous:tenant-a"),
    (Actor.anonymous(None), "anonymous:-"),
]


@pytest.mark.parametrize(("actor", "text"), ACTORS)
def test_an_actor_is_written_and_read_back(actor: Actor, text: str) -> None:
    assert str(actor) == text
    assert parse_actor(text) == actor


@pytest.mark.parametrize(
    "text", ["claims-api", "consumer:x", "tenant:alice", "tenant:@ns", "operator:", "agent:a:b"]
)
def test_what_is_not_an_actor_is_refused(text: str) -> None:
    with pytest.raises(ActorError):
        parse_actor(text)


ALICE = Principal(name="alice", kind="tenant", public_key="UALICE", namespace="tenant-a")
OPS = Principal(name="root", kind="operator", public_key="UROOT")
AGENT_A = Principal(name="node-a", kind="agent", public_key="UNODEA", node="node-a")
DIRECTORY = Directory([ALICE, OPS, AGENT_A])


def _info(**fields: str) -> dict[str, str]:
    return {REQUEST_INFO_HEADER: json.dumps(fields)}


@pytest.mark.parametrize(
    ("headers", "caller"),
    [
        (_info(acc="TENANT_tenant-a", user="UALICE"), "tenant:alice@tenant-a"),
        (_info(acc="OPERATORS", user="UROOT"), "operator:root"),
        # an authenticated key the directory does not name: the key names it
        (_info(acc="TENANT_tenant-b", user="UNEW"), "tenant:UNEW@tenant-b"),
        (_info(acc="DRACAP", user="USERVICE"), None),  # services make no API requests
        (_info(acc="TENANT_", user="UALICE"), None),
        (_info(acc="OPERATORS"), None),
        ({REQUEST_INFO_HEADER: "not json"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_the_caller_comes_from_the_brokers_header(
    headers: dict[str, str] | None, caller: str | None
) -> None:
    found = caller_of(headers, DIRECTORY.index())
    assert (str(found) if found else None) == caller


@pytest.mark.parametrize(
    ("headers", "sender"),
    [
        (_info(acc="NODES", user="UNODEA"), AGENT_A),
        (_info(acc="OPERATORS", user="UROOT"), OPS),
        # a known key in another account than its user's: JetStream's own answer carried
        # across an import, or a header from elsewhere; nobody
        (_info(acc="JETSTREAM", user="UNODEA"), None),
        (_info(acc="NODES", user="UNEW"), None),  # a key the directory does not name
        (_info(acc="NODES"), None),
        ({REQUEST_INFO_HEADER: "[]"}, None),
        (None, None),
    ],
)
def test_the_sender_is_a_known_user_of_its_own_account(
    headers: dict[str, str] | None, sender: Principal | None
) -> None:
    assert principal_of(headers, DIRECTORY.index()) == sender


def test_every_kind_of_user_has_an_account_of_its_own() -> None:
    service = {name: Principal(name=name, kind="service", public_key="") for name in SERVICES}
    accounts = {
        "tenant": ALICE.account,
        "operator": OPS.account,
        "agent": AGENT_A.account,
        **{name: p.account for name, p in service.items()},
    }
    assert accounts == {
        "tenant": "TENANT_tenant-a",
        "operator": "OPERATORS",
        "agent": "NODES",
        "relay": "RELAY",
        "claims": "DRACAP",
        "reservation": "RESERVATION",
        "ledger": "LEDGER",
        "enforcement": "ENFORCEMENT",
    }


def test_init_writes_private_credentials_and_public_accounts(tmp_path: Path) -> None:
    auth = AuthDir(tmp_path / "auth")
    installation = Installation(namespaces={"tenant-a": ["alice"]}, nodes=["node-a"])
    principals = init_auth(auth, installation)
    assert {(p.kind, p.name) for p in principals} == {
        ("service", "relay"),
        ("service", "claims"),
        ("service", "reservation"),
        ("service", "ledger"),
        ("service", "enforcement"),
        ("agent", "node-a"),
        ("operator", "operator"),
        ("tenant", "alice"),
    }
    for principal in principals:
        path = auth.creds_path(principal)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert read_credential(path).public_key == principal.public_key
        assert auth.credential_of(principal).principal == principal
        assert read_credential(path).seed not in auth.accounts.read_text()
        assert principal.public_key in auth.accounts.read_text()
    assert "seed" not in auth.directory.read_text()
    credential = read_credential(auth.creds_path(principals[0]))
    # no part of the seed reaches the text (a public key may well contain "SU")
    assert credential.seed not in repr(credential)
    assert credential.seed[2:12] not in repr(credential)


def test_init_again_keeps_keys_adds_and_drops_users(tmp_path: Path) -> None:
    auth = AuthDir(tmp_path / "auth")
    first = init_auth(auth, Installation(namespaces={"a": ["alice"], "b": ["bob"]}))
    second = init_auth(auth, Installation(namespaces={"a": ["alice"], "c": ["carol"]}))
    keys = {p.name: p.public_key for p in first}
    again = {p.name: p.public_key for p in second}
    assert again["alice"] == keys["alice"] and again["relay"] == keys["relay"]
    assert "carol" in again and "bob" not in again
    with pytest.raises(CredentialError):
        auth.tenant("b", "bob")


def test_a_credential_file_is_an_nkey_seed_file(tmp_path: Path) -> None:
    """The seed alone on one line: what `nats --nkey` and nats-py's `nkeys_seed` read."""
    auth = AuthDir(tmp_path / "auth")
    (alice,) = [
        p for p in init_auth(auth, Installation(namespaces={"a": ["alice"]})) if p.name == "alice"
    ]
    path = auth.creds_path(alice)
    assert path.name == "tenant-a-alice.nk"
    text = path.read_text()
    assert re.fullmatch(r"SU[A-Z2-7]{56}\n", text)
    assert nkeys.from_seed(bytearray(text.strip().encode())).public_key.decode() == alice.public_key
    assert auth.tenant("a", "alice").inbox_prefix == f"_INBOX_{alice.public_key}"


def test_init_again_turns_an_earlier_versions_json_files_into_seed_files(tmp_path: Path) -> None:
    auth = AuthDir(tmp_path / "auth")
    (alice,) = [
        p for p in init_auth(auth, Installation(namespaces={"a": ["alice"]})) if p.name == "alice"
    ]
    seed = auth.creds_path(alice).read_text().strip()
    old = auth.legacy_path(alice)
    old.write_text(json.dumps({"principal": {"name": "alice"}, "seed": seed}))
    auth.creds_path(alice).unlink()
    with pytest.raises(CredentialError, match=r"earlier dracap .*dracap auth init"):
        read_credential(old)
    again = init_auth(auth, Installation(namespaces={"a": ["alice"]}))
    assert alice in again  # the same key: credentials handed out stay valid
    assert not old.exists() and auth.creds_path(alice).read_text().strip() == seed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n", "decorated"),
        ("SAABCDEF", "not an NKey user seed"),
        ("SU" + "A" * 56, "bad checksum"),
        ("", "not an NKey user seed"),
    ],
)
def test_a_file_that_is_no_seed_file_says_so(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "x.nk"
    path.write_text(text)
    with pytest.raises(CredentialError, match=message):
        read_credential(path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespaces": ["Bad_NS"]}, "namespace 'Bad_NS'"),
        ({"users": ["tenant-a"]}, "NAMESPACE/USER"),
        ({"users": ["tenant-a/Alice"]}, "user 'Alice'"),
    ],
)
def test_bad_names_are_refused_naming_them(kwargs: dict[str, list[str]], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        installation_from([], prefix="dracap", **kwargs)  # type: ignore[arg-type]


def test_a_tenant_may_publish_only_its_namespaces_api() -> None:
    names = BusNames("dracap")
    rules = permissions_of(ALICE, names)
    assert rules.publish == ["dracap.api.tenant-a.claims.>"]
    assert rules.subscribe == ["dracap.watch.tenant-a.>", f"_INBOX_{ALICE.public_key}.>"]


def test_an_agent_may_only_ask_for_its_node_and_pull_its_consumer() -> None:
    names = BusNames("dracap")
    agent = Principal(name="node.a", kind="agent", public_key="U", node="node.a")
    rules = permissions_of(agent, names)
    assert agent.account == "NODES"  # no JetStream there: only what is imported
    assert rules.publish == [
        "dracap.node.node%2Ea.>",
        "JS.API.CONSUMER.MSG.NEXT.DRACAP_EVENTS.agent-node_2Ea",
        "$JS.ACK.DRACAP_EVENTS.agent-node_2Ea.>",
    ]  # the enforcement service creates its consumer: no CONSUMER.CREATE, no INFO
    assert rules.subscribe == [f"{agent.inbox_prefix}.>"]
    assert not any(s.startswith("$JS.API.") for s in rules.publish)


def test_the_jetstream_lives_in_an_account_without_users(tmp_path: Path) -> None:
    auth = AuthDir(tmp_path / "auth")
    init_auth(auth, Installation(namespaces={"tenant-a": ["alice"]}, nodes=["node-a"]))
    accounts = json.loads(auth.accounts.read_text().split("accounts: ", 1)[1])
    with_jetstream = {name for name, a in accounts.items() if a.get("jetstream") == "enabled"}
    assert with_jetstream == {"JETSTREAM"}
    assert not accounts["JETSTREAM"].get("users")
    # every JetStream API import comes from the one export, under the local prefix
    api_imports = [
        i
        for a in accounts.values()
        for i in a.get("imports", [])
        if "service" in i and i["service"]["subject"].startswith("$JS.API.")
    ]
    assert api_imports and all(i["to"].startswith("JS.API.") for i in api_imports)
    exports = [e.get("service", "") for e in accounts["JETSTREAM"]["exports"]]
    assert [e for e in exports if e.startswith("$JS.API")] == ["$JS.API.>"]


def test_auth_init_that_cannot_write_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services import cli

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    code = cli.main(["auth", "init", "--namespace", "a", "--data-dir", str(blocked)])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: cannot write ") and err.count("\n") == 1
