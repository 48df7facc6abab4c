"""Subject names: every event has a valid subject; node filters see only their node."""

from __future__ import annotations

import re

import msgspec
import pytest

from events import catalog as c
from events.envelopes import Envelope, new_envelope
from events.subjects import (
    EVERY_EVENT,
    NODE_EVENTS,
    NODE_REPORTS,
    BusNames,
    Carried,
    SubjectError,
    node_of,
    node_token,
    subject_matches,
)
from tests.unit.test_catalog import every_event

EVENTS = every_event()
IDS = [c.tag_of(e) for e in EVENTS]
NAMES = BusNames(prefix="dracap")
_TOKEN = re.compile(r"[^\s.*>]+")


def _env(event: c.Event) -> Envelope:
    return new_envelope(event, stream_version=1, actor="test")


def _with_node(event: c.Event, node: str | None) -> c.Event:
    return msgspec.structs.replace(event, node=node)


@pytest.mark.parametrize("event", EVENTS, ids=IDS)
def test_every_event_has_a_valid_subject_in_the_stream(event: c.Event) -> None:
    subject = NAMES.event_subject(_env(event))
    tokens = subject.split(".")
    assert all(_TOKEN.fullmatch(t) for t in tokens), subject
    tag = c.tag_of(event)
    assert tokens[:3] == ["dracap", "ev", tag.split(".")[0]]
    assert subject.endswith("." + tag)
    assert subject_matches(NAMES.events_subjects, subject)
    assert subject_matches(NAMES.category_filter(tag.split(".")[0]), subject)
    assert subject_matches(NAMES.tag_filter(tag), subject)
    other = next(t for t in c.EVENT_TYPES if t != tag)
    assert not subject_matches(NAMES.tag_filter(other), subject)


def test_every_event_with_a_node_field_is_addressed_or_a_report() -> None:
    with_node = {cls for cls in c.EVENT_TYPES.values() if "node" in cls.__struct_fields__}
    assert set(NODE_EVENTS) | set(NODE_REPORTS) == with_node
    assert not set(NODE_EVENTS) & set(NODE_REPORTS)
    # what an agent acts on is addressed to its node; what it reports is not
    assert {c.AllocationBound, c.ReleaseRequested} <= set(NODE_EVENTS)
    assert {c.CapacityReserved, c.LimitApplied, c.LimitRemoved} <= set(NODE_REPORTS)


@pytest.mark.parametrize("event", [e for e in EVENTS if isinstance(e, NODE_REPORTS)], ids=str)
def test_node_reports_travel_under_the_placeholder(event: c.Event) -> None:
    subject = NAMES.event_subject(_env(_with_node(event, "node-a")))
    assert subject.split(".")[3] == "_"
    assert not subject_matches(NAMES.node_filter("node-a"), subject)


@pytest.mark.parametrize("event", [e for e in EVENTS if isinstance(e, NODE_EVENTS)], ids=str)
def test_node_events_carry_the_node_token(event: c.Event) -> None:
    for node in ("node-a", "ip-10-0-0-1.ec2.internal"):
        subject = NAMES.event_subject(_env(_with_node(event, node)))
        assert subject.split(".")[3] == node_token(node)
        assert subject_matches(NAMES.node_filter(node), subject)


def test_events_without_node_use_the_placeholder() -> None:
    unbound = c.ReleaseRequested(namespace="team-a", name="train", allocation_version=1)
    assert NAMES.event_subject(_env(unbound)).split(".")[3] == "_"
    admitted = c.ClaimAdmitted(namespace="team-a", name="train")
    assert NAMES.event_subject(_env(admitted)) == "dracap.ev.claims._.claims.admitted"


def test_node_filter_matches_only_its_node() -> None:
    nodes = ["node-a", "node-b", "node-a.zone", "node", "_"]
    for event in EVENTS:
        for owner in nodes:
            env = _env(_with_node(event, owner) if isinstance(event, NODE_EVENTS) else event)
            subject = NAMES.event_subject(env)
            for reader in nodes:
                expected = node_of(env.event) == reader
                assert subject_matches(NAMES.node_filter(reader), subject) is expected, (
                    reader,
                    subject,
                )


def test_node_tokens_are_injective_and_single_tokens() -> None:
    names = ["a.b", "a_b", "a%2Eb", "a-b", "_", "A", "a", "ü", "a b", "a*", "a>"]
    tokens = [node_token(n) for n in names]
    assert len(set(tokens)) == len(names)
    assert all(_TOKEN.fullmatch(t) and t != "_" for t in tokens)
    assert node_token("ip-10-0-0-1.ec2.internal") == "ip-10-0-0-1%2Eec2%2Einternal"
    with pytest.raises(SubjectError):
        node_token("")


def test_prefix_scopes_everything() -> None:
    names = BusNames(prefix="t1234abcd")
    assert names.stream == "T1234ABCD_EVENTS"
    assert names.events_subjects == "t1234abcd.ev.>"
    env = _env(EVENTS[0])
    assert not subject_matches(NAMES.events_subjects, names.event_subject(env))
    assert BusNames().stream == "DRACAP_EVENTS"


@pytest.mark.parametrize("prefix", ["", "a.b", "a b", "a*", "a>", "ä"])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(SubjectError):
        BusNames(prefix=prefix)


def test_api_and_admin_subjects() -> None:
    assert NAMES.api("team-a", "apply") == "dracap.api.team-a.claims.apply"
    assert NAMES.api("*", "get") == "dracap.api.*.claims.get"
    assert subject_matches(NAMES.api("*", "get"), NAMES.api("team-a", "get"))
    assert NAMES.admin("slices.apply") == "dracap.admin.slices.apply"
    assert NAMES.admin(">") == "dracap.admin.>"
    for bad in ("team.a", "", "a b", "a*"):
        with pytest.raises(SubjectError):
            NAMES.api(bad, "apply")
    with pytest.raises(SubjectError):
        NAMES.admin("a..b")
    with pytest.raises(SubjectError):
        NAMES.category_filter("a.b")


def test_reservation_feeds_read_their_triggers() -> None:
    from services.reservation.service import FEEDS, TRIGGERS

    subjects = [NAMES.event_subject(_env(e)) for e in EVENTS if isinstance(e, TRIGGERS)]
    filters = [
        NAMES.tag_filter(source) if "." in source else NAMES.category_filter(source)
        for source in FEEDS.values()
    ]
    for subject in subjects:
        assert any(subject_matches(f, subject) for f in filters), subject


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.b.c", "a.b", False),
        ("a.b", "a.b.c", False),
        ("a.*.c", "a.x.c", True),
        ("a.*.c", "a.x.y.c", False),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c.d", True),
        ("a.>", "a", False),
        ("a.*.>", "a.b", False),
        ("x.>", "a.b", False),
    ],
)
def test_a_pattern_matches_subjects_as_nats_does(pattern: str, subject: str, matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


def test_the_bus_carries_events_addressed_to_a_node_and_the_tags_it_names() -> None:
    carried = Carried(frozenset({"claims.admitted"}))
    assert carried("claims.admitted", None)
    assert carried("reservation.allocation_bound", "node-a")  # its agent reads it
    assert not carried("reservation.allocation_bound", None)
    assert not carried("claims.submitted", None)
    assert EVERY_EVENT("claims.submitted", None)
