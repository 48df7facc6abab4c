"""The database's payload checks and writers come from the catalog, and cannot fall behind.

* the generated file ``migrations/functions/dracap_payload_checks.sql`` is exactly what
  :mod:`services.runtime.store.payloadchecks` makes of today's catalog and writers: a change of
  either that was not regenerated fails here;
* the newest migration that installs it names that file's digest: a regenerated file
  needs a migration that installs it again;
* every event type of the catalog has writers and a check function, and one more event
  type (a catalog that grew) changes the file — it cannot be forgotten;
* every writer's actor pattern reads the actors of :mod:`events.actors` as expected.

``tests/integration/test_payload_checks.py`` compares the database's verdicts with msgspec's.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from events import catalog, writers
from events.actors import Actor
from migrations import sqlfiles
from services.runtime.store import payloadchecks

ROOT = Path(__file__).resolve().parents[2]


def test_the_generated_file_is_todays_catalog() -> None:
    committed = (ROOT / payloadchecks.FILE).read_text()
    assert committed == payloadchecks.generate(), (
        "the catalog or events/writers.py changed: run `python -m"
        " services.runtime.store.payloadchecks`"
        " and add a migration that installs the file again"
    )


def test_the_newest_installing_migration_names_the_files_digest() -> None:
    versions = sorted((ROOT / "migrations" / "versions").glob("0*.py"))
    installing = [
        v
        for v in versions
        if "dracap_payload_checks.sql" in v.read_text() and "CATALOG" in v.read_text()
    ]
    assert installing, "no migration installs the payload checks"
    newest = importlib.import_module(f"migrations.versions.{installing[-1].stem}")
    assert payloadchecks.digest() == newest.CATALOG, (
        f"{installing[-1].name} installs checks of another catalog: add a migration that "
        "installs the regenerated file and names its digest"
    )


def test_every_event_type_has_writers_and_a_check() -> None:
    assert set(writers.WRITERS) == set(catalog.EVENT_TYPES)
    text = payloadchecks.generate()
    for tag in catalog.EVENT_TYPES:
        assert f"FUNCTION {payloadchecks.function_name(tag)}(p jsonb)" in text
        assert f"WHEN '{tag}' THEN" in text  # the dispatcher knows it
    assert all(w for t, w in writers.WRITERS.items() if t != "reclamation.append_refused")


class _NewEvent(catalog._EventBase, frozen=True, kw_only=True, tag="test.new_event"):
    """An event type a later change might add."""

    node: str
    amount: int = 0


def test_a_new_event_type_changes_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    before = payloadchecks.digest()
    monkeypatch.setitem(catalog.EVENT_TYPES, "test.new_event", _NewEvent)  # type: ignore[index]
    assert payloadchecks.digest() != before
    assert "dracap_check_test_new_event" in payloadchecks.generate()
    assert "test.new_event" not in writers.WRITERS  # ... and the coverage test above fails


class _Bounded(catalog._EventBase, frozen=True, kw_only=True, tag="test.bounded"):
    count: Annotated[int, msgspec.Meta(ge=0)] = 0


class _Either(catalog._EventBase, frozen=True, kw_only=True, tag="test.either"):
    value: int | str = 0


def test_an_unknown_construct_is_refused_not_skipped() -> None:
    """A type the translation does not know fails the generation, never passes unchecked."""
    with pytest.raises(payloadchecks.UnsupportedTypeError, match="integer constraints"):
        payloadchecks.check_function("test.bounded", _Bounded)  # type: ignore[arg-type]
    with pytest.raises(payloadchecks.UnsupportedTypeError, match="union"):
        payloadchecks.check_function("test.either", _Either)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("actor", "writer"),
    [
        (Actor.tenant("bob", "team-a"), "tenant"),
        (Actor.anonymous("team-a"), "tenant"),
        (Actor.anonymous(None), "operator"),
        (Actor.operator("alice"), "operator"),
        (Actor.system("kubernetes-bridge"), "bridge"),
        (Actor.system("reservation-0"), "reservation"),
        (Actor.system("reservation-claims"), "reservation"),
        (Actor.system("reclamation-7"), "reclamation"),
        (Actor.system("fence-hook"), "reclamation"),
        (Actor.agent("node-a", 3), "agent"),
        (Actor.agent("node-a"), None),  # a report without a lease: nobody's job
        (Actor.system("relay"), None),
        (Actor.system("audit"), None),
    ],
)
def test_actors_speak_as_their_writer(actor: Actor, writer: str | None) -> None:
    assert writers.writer_of(str(actor)) == writer


def test_0011_installs_its_own_jobs_and_binding_and_0012_neither() -> None:
    """0012 took ``agent`` out of the jobs and the node binding out of the append function
    (its file ``dracap_append_guarded/0012.sql``); 0011 installs them as they were (its
    own version), which 0012's downgrade restores."""
    login_jobs = importlib.import_module("migrations.versions.0011_login_jobs")
    no_node_logins = importlib.import_module("migrations.versions.0012_no_node_logins")
    assert "agent" not in writers.JOBS and login_jobs.JOBS["agent"] == writers.JOBS["enforcement"]
    assert "WHEN 'agent' THEN" in login_jobs.payload_checks_sql()
    assert "WHEN 'agent' THEN" not in payloadchecks.generate()
    assert "dracap_node_roles" in sqlfiles.function_sql("dracap_append_guarded", "0011")
    assert "dracap_node_roles" not in sqlfiles.function_sql("dracap_append_guarded", "0012")
    assert no_node_logins.down_revision == login_jobs.revision
