"""The guards the database derives from events are those of :mod:`events.guards`.

Since migration 0011 no caller passes guards: ``dracap_guards_of`` derives them in the
database from the events of the append. :func:`events.guards.guards_of_many` stays the
model (``tests/unit/test_guards.py`` checks it against the fold); this test compares the
two on every event of the integration scenario and on random reservations, slices and
lease transitions, amount for amount (as exact decimals: the texts may differ in scale).
"""

from __future__ import annotations

import json
import random
import uuid
from decimal import Decimal
from typing import Any

import asyncpg
import msgspec

from events import catalog
from events.catalog import Event
from events.envelopes import Envelope
from events.eventcodec import encode_payload
from events.guards import encode_guards, guards_of_many
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from tests.integration import sample as s
from tests.integration import scenario


def _exact(guards: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Guards with their amounts and totals as exact decimals."""
    out = []
    for guard in guards or []:
        guard = dict(guard)
        if "amounts" in guard:
            guard["amounts"] = {k: Decimal(v) for k, v in guard["amounts"].items()}
        if "total" in guard:
            guard["total"] = Decimal(guard["total"])
        out.append(guard)
    return sorted(out, key=lambda g: (g["at"], json.dumps(g, sort_keys=True, default=str)))


async def _compare(db: asyncpg.Connection, events: list[Event]) -> None:
    derived = await db.fetchval(
        "SELECT dracap_guards_of($1::text[], $2::jsonb[])",
        [catalog.tag_of(e) for e in events],
        [encode_payload(e) for e in events],
    )
    expected = guards_of_many(events)
    model = msgspec.json.decode(encode_guards(expected)) if expected else None
    assert _exact(msgspec.json.decode(derived) if derived else None) == _exact(model)


async def test_every_append_of_the_scenario(db: asyncpg.Connection, settings: Settings) -> None:
    appends: list[list[Event]] = []

    async def keep(envs: list[Envelope]) -> None:
        appends.append([e.event for e in envs])

    async with await EventStore.open(settings) as store:
        await scenario.run(store, keep)
    assert len(appends) > 10
    for events in appends:
        await _compare(db, events)
    await _compare(db, [e for events in appends for e in events])  # all in one append


def _random_events(rng: random.Random) -> list[Event]:
    units = ["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "Ti", "n", "u"]
    events: list[Event] = []
    for i in range(300):
        roll = rng.random()
        amount = f"{rng.randint(0, 10 ** rng.randint(0, 12))}{rng.choice(units)}"
        if roll < 0.4:
            events.append(
                s.reserved(
                    f"ns-{i}",
                    f"c-{i}",
                    f"gpu-{rng.randint(0, 3)}",
                    amount,
                    shared=rng.random() < 0.6,
                    admin=rng.random() < 0.2,
                    share_id=str(uuid.UUID(int=rng.getrandbits(128))),
                )
            )
        elif roll < 0.55:
            events.append(s.released(s.reserved(consumed=amount, admin=rng.random() < 0.3)))
        elif roll < 0.75:
            devices = {
                f"gpu-{d}": {
                    f"cap-{c}": f"{rng.randint(1, 10**9)}{rng.choice(units)}"
                    for c in range(rng.randint(0, 3))
                }
                for d in range(rng.randint(0, 3))
            }
            events.append(s.slice_published(f"slice-{i}", devices, pool=f"pool-{i}"))
        elif roll < 0.85:
            events.append(
                catalog.NodeLeaseAcquired(node=f"n{i}", epoch=i + 1, boot_id="b", ttl_ms=1000 + i)
            )
        elif roll < 0.92:
            events.append(catalog.NodeLeaseExpired(node=f"n{i}", epoch=i))
        else:
            events.append(catalog.NodeFenced(node=f"n{i}", epoch=i, reason="x"))
    return events


async def test_random_events(db: asyncpg.Connection) -> None:
    rng = random.Random(2411)
    events = _random_events(rng)
    for start in range(0, len(events), 37):
        await _compare(db, events[start : start + 37])
    await _compare(db, events)
    await _compare(db, [catalog.ClaimAdmitted(namespace="a", name="b")])  # none at all
