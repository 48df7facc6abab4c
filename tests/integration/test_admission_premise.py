"""Every admission rule is exact across claims API replicas, not only the quota (issue 29,
item 1; migration 0014, docs/tenancy.md).

An admission's premise names the fold's position and the classes the claim names; the
append, where every replica meets, refuses it when the namespace's access record was set
again after that position, or a named class changed mode or was removed: what the
replica decided on is no longer the log's. Other namespaces' records and other classes
do not, and a namespace without a quota does not count admissions.
"""

from __future__ import annotations

import msgspec
import pytest

from events.actors import Actor
from events.catalog import (
    ClaimAdmitted,
    ClassModeSet,
    DeviceClassRemoved,
    Event,
    NamespaceAccessSet,
)
from events.envelopes import claim_stream
from services.runtime.ground.errors import ConflictError
from services.runtime.ground.settings import Settings
from services.runtime.store.appends import AdmissionPremise, Batch, Metadata
from services.runtime.store.eventstore import EventStore

NAMESPACE = "tenant-p"
CLASS = "gpu.dracap.io"
ADMIN = Metadata(actor="admin:test")
TENANT = Metadata(actor=str(Actor.anonymous(NAMESPACE)))


def _admission(name: str, seen: int) -> Batch:
    premise = AdmissionPremise(NAMESPACE, seen, quota=False, classes=(CLASS,))
    event = ClaimAdmitted(namespace=NAMESPACE, name=name)
    return Batch(claim_stream(NAMESPACE, name), 0, [event], premise=premise)


async def _change(store: EventStore, event: Event) -> int:
    [stored] = await store.append_many([Batch("admin:test", None, [event])], ADMIN)
    return stored.position


@pytest.mark.parametrize(
    ("breaking", "harmless"),
    [
        (
            NamespaceAccessSet(namespace=NAMESPACE, classes=[]),
            NamespaceAccessSet(namespace="tenant-other", classes=[]),
        ),
        (
            ClassModeSet(name=CLASS, mode="disabled"),
            ClassModeSet(name="other.dracap.io", mode="disabled"),
        ),
        (DeviceClassRemoved(name=CLASS), DeviceClassRemoved(name="other.dracap.io")),
    ],
    ids=["namespace-access", "class-mode", "class-removed"],
)
async def test_an_admission_whose_policy_changed_after_its_decision_is_a_conflict(
    settings: Settings, breaking: Event, harmless: Event
) -> None:
    claims = msgspec.structs.replace(settings, app_role="dracap_claims")
    async with (
        await EventStore.open(settings) as admin,
        await EventStore.open(claims) as store,
    ):
        seen = await _change(admin, NamespaceAccessSet(namespace=NAMESPACE, classes=["*"]))
        await _change(admin, harmless)  # another namespace's record, another class
        await store.append_many([_admission("a", seen)], TENANT)
        await store.append_many([_admission("b", seen)], TENANT)  # no quota: no count

        changed = await _change(admin, breaking)
        with pytest.raises(ConflictError) as lost:
            await store.append_many([_admission("c", seen)], TENANT)
        assert lost.value.stream == f"admissions:{NAMESPACE}"
        assert f"at position {changed}" in str(lost.value)
        assert await store.head() == changed, "the refused admission wrote nothing"
        await store.append_many([_admission("c", changed)], TENANT)  # decided again
