"""SQL for the row changes of :mod:`events.ledger`, run inside the append transaction.

:func:`apply_changes` executes ``(change, position)`` pairs in log order. Runs of
consecutive changes of a kind whose SQL needs no answer are sent with one
``executemany`` (a pipelined batch). The hot runs of a group commit — reservations
(ledger, holds, shares), bindings, applied limits — are set-based statements over
``unnest`` arrays, a fixed number of round trips however many claims the append
carries (each function says why the result equals log order). The rest run one by
one because what they do depends on the rows they find (a release only gives
capacity back the first time). Every round trip here is made while the append holds
the log's head lock, so their number bounds how fast the log can grow.

The statements mirror :mod:`events.fold` step for step for the columns the
projections keep; ``dracap replay verify`` checks that they agree.

"A claim's shares" is read as the shares of the claim's current allocation version
(the fold keeps an explicit list, which is the same set for every log dracap writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Any, Final, cast

import asyncpg
import msgspec

from events import ledger
from services.runtime.errors import CapacityExceeded

Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

_LIVE_PHASES: Final = "('allocated', 'ready', 'releasing')"
_CLAIM_SHARES: Final = (
    "s.namespace = c.namespace AND s.claim = c.name AND s.allocation_version = c.allocation_version"
)

SET_TOTAL: Final = (
    "INSERT INTO capacity_ledger (driver, pool, device, capacity, total) "
    "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (driver, pool, device, capacity) "
    "DO UPDATE SET total = EXCLUDED.total"
)
RESERVE: Final = (
    "UPDATE capacity_ledger SET allocated = allocated + $5 "
    "WHERE driver = $1 AND pool = $2 AND device = $3 AND capacity = $4 RETURNING 1"
)
HOLD: Final = (
    "INSERT INTO device_holds (driver, pool, device, share_id, namespace, claim) "
    "VALUES ($1, $2, $3, $4, $5, $6)"
)
INSERT_SHARE: Final = (
    "WITH s AS (INSERT INTO shares (share_id, namespace, claim, allocation_version, request, "
    "driver, pool, device, node, shared, admin_access, consumed, amounts, policy_version, "
    "state, position) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, "
    "'reserved', $15) RETURNING 1) "
    "UPDATE claims SET allocation_version = $4 "
    "WHERE namespace = $2 AND name = $3 AND allocation_version <> $4"
)
RELEASE_SHARE: Final = (
    "WITH r AS (UPDATE shares SET state = 'released', prior_state = NULL, position = $2 "
    "WHERE share_id = $1 AND state <> 'released' "
    "RETURNING driver, pool, device, amounts, namespace, claim, allocation_version), "
    "l AS (UPDATE capacity_ledger c SET allocated = c.allocated - a.value::numeric "
    "FROM r, jsonb_each_text(r.amounts) AS a WHERE c.driver = r.driver AND c.pool = r.pool "
    "AND c.device = r.device AND c.capacity = a.key RETURNING 1), "
    "h AS (DELETE FROM device_holds WHERE share_id = $1 AND EXISTS (SELECT FROM r) "
    "RETURNING 1) "
    "SELECT namespace, claim, allocation_version FROM r"
)
CLAIM_RELEASED: Final = (
    "UPDATE claims c SET phase = 'released', position = $3 "
    "WHERE c.namespace = $1 AND c.name = $2 AND c.allocation_version = $4 "
    "AND c.phase <> ALL($5::text[]) "
    f"AND NOT EXISTS (SELECT FROM shares s WHERE {_CLAIM_SHARES} AND s.state <> 'released')"
)
BIND_SHARES: Final = (
    "UPDATE shares SET state = 'bound', position = $2 "
    "WHERE share_id = ANY($1::uuid[]) AND state = 'reserved'"
)
BIND_CLAIM: Final = (
    "INSERT INTO claims (namespace, name, phase, allocation_version, node, reason, position) "
    "VALUES ($1, $2, 'allocated', $3, $4, NULL, $5) ON CONFLICT (namespace, name) DO UPDATE "
    "SET phase = 'allocated', allocation_version = $3, node = $4, reason = NULL, position = $5"
)
CLAIM_READY: Final = (
    "UPDATE claims c SET phase = 'ready', position = $3 "
    "WHERE c.namespace = $1 AND c.name = $2 AND c.phase = 'allocated' "
    "AND ($4::int IS NULL OR c.allocation_version = $4) "
    f"AND EXISTS (SELECT FROM shares s WHERE {_CLAIM_SHARES}) "
    f"AND NOT EXISTS (SELECT FROM shares s WHERE {_CLAIM_SHARES} AND s.state <> 'ready' "
    f"AND (NOT s.admin_access OR NOT EXISTS (SELECT FROM shares t WHERE "
    "t.namespace = c.namespace AND t.claim = c.name AND t.allocation_version = "
    "c.allocation_version AND NOT t.admin_access)))"
)
APPLY_LIMIT: Final = (
    "UPDATE shares SET state = 'ready', level = $2, position = $3 "
    "WHERE share_id = $1 AND state IN ('reserved', 'bound') "
    "RETURNING namespace, claim, allocation_version"
)
FAIL_LIMIT: Final = (
    "UPDATE claims c SET phase = 'failed', reason = $2, position = $3 FROM shares s "
    "WHERE s.share_id = $1 AND s.state <> 'released' AND c.namespace = s.namespace "
    "AND c.name = s.claim AND c.allocation_version = s.allocation_version"
)
REQUEST_RELEASE: Final = (
    "WITH c AS (UPDATE claims SET phase = 'releasing', position = $4 WHERE namespace = $1 "
    "AND name = $2 AND allocation_version = $3 AND phase NOT IN ('releasing', 'released') "
    "RETURNING 1) "
    "UPDATE shares SET state = 'releasing', position = $4 WHERE EXISTS (SELECT FROM c) "
    "AND namespace = $1 AND claim = $2 AND allocation_version = $3 "
    "AND state IN ('reserved', 'bound', 'ready')"
)
UNKNOWN_SHARE: Final = (
    "UPDATE shares SET prior_state = state, state = 'unknown', position = $2 "
    "WHERE share_id = $1 AND state NOT IN ('released', 'unknown')"
)
LEASE_EXPIRED: Final = (
    "WITH n AS (INSERT INTO node_epochs (node, lease, lease_epoch) VALUES ($1, 'expired', $2) "
    "ON CONFLICT (node) DO UPDATE SET lease = 'expired', lease_epoch = $2 "
    "WHERE node_epochs.lease_epoch <= $2 AND node_epochs.fenced_epoch <= $2 RETURNING 1) "
    "UPDATE shares SET prior_state = state, state = 'unknown', position = $3 "
    "WHERE EXISTS (SELECT FROM n) AND node = $1 AND state NOT IN ('released', 'unknown')"
)
CONFIRM_SHARE: Final = (
    "WITH s AS (UPDATE shares SET state = coalesce(prior_state, 'ready'), prior_state = NULL, "
    "position = $3 WHERE share_id = $1 AND state = 'unknown' RETURNING 1) "
    "UPDATE node_epochs SET lease = 'live' WHERE node = $2 AND lease = 'expired'"
)
FENCE: Final = (
    "INSERT INTO node_epochs (node, lease, fenced_epoch) VALUES ($1, 'fenced', $2) "
    "ON CONFLICT (node) DO UPDATE SET lease = 'fenced', fenced_epoch = $2 "
    "WHERE node_epochs.lease_epoch <= $2 AND node_epochs.fenced_epoch <= $2 RETURNING 1"
)
FENCED_SHARES: Final = (
    "SELECT share_id::text FROM shares WHERE node = $1 AND state <> 'released' ORDER BY share_id"
)
FENCED_CLAIM: Final = (
    "UPDATE claims c SET position = $3, "
    "phase = CASE WHEN c.phase = 'releasing' THEN 'released' ELSE 'failed' END, "
    "reason = CASE WHEN c.phase = 'releasing' THEN c.reason ELSE $4 END "
    "WHERE c.namespace = $1 AND c.name = $2 AND c.phase NOT IN ('released', 'failed') "
    "AND (c.phase <> 'releasing' OR NOT EXISTS "
    f"(SELECT FROM shares s WHERE {_CLAIM_SHARES} AND s.state <> 'released'))"
)
UPSERT_CLAIM: Final = (
    "INSERT INTO claims (namespace, name, phase, reason, position) VALUES ($1, $2, $3, $4, $6) "
    "ON CONFLICT (namespace, name) DO UPDATE SET position = $6, "
    f"phase = CASE WHEN $3 = 'submitted' AND claims.phase IN {_LIVE_PHASES} THEN claims.phase "
    "ELSE $3 END, "
    f"reason = CASE WHEN NOT $5 OR ($3 = 'submitted' AND claims.phase IN {_LIVE_PHASES}) "
    "THEN claims.reason ELSE $4 END"
)

_JSON: Final = msgspec.json.Encoder()


def _strings(amounts: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in amounts.items()}


def _json(amounts: dict[str, Any]) -> bytes:
    return _JSON.encode(_strings(amounts))


def _args(change: ledger.Change, position: int) -> tuple[Any, ...]:
    match change:
        case ledger.SetTotal():
            return (change.driver, change.pool, change.device, change.capacity, change.total)
        case ledger.HoldDevice():
            return (
                change.driver,
                change.pool,
                change.device,
                change.share_id,
                change.namespace,
                change.claim,
            )
        case ledger.InsertShare():
            return (
                change.share_id,
                change.namespace,
                change.claim,
                change.allocation_version,
                change.request,
                change.driver,
                change.pool,
                change.device,
                change.node,
                change.shared,
                change.admin_access,
                _JSON.encode(change.consumed),
                _json(change.amounts),
                change.policy_version,
                position,
            )
        case ledger.FailLimit():
            return (change.share_id, change.reason, position)
        case ledger.RequestRelease():
            return (change.namespace, change.name, change.allocation_version, position)
        case ledger.ConfirmShare():
            return (change.share_id, change.node, position)
        case ledger.UpsertClaim():
            return (
                change.namespace,
                change.name,
                change.phase,
                change.reason,
                change.set_reason,
                position,
            )
    raise TypeError(f"no batched SQL for {type(change).__name__}")


_BATCHED: Final[dict[type, str]] = {
    ledger.SetTotal: SET_TOTAL,
    ledger.HoldDevice: HOLD,
    ledger.InsertShare: INSERT_SHARE,
    ledger.FailLimit: FAIL_LIMIT,
    ledger.ConfirmShare: CONFIRM_SHARE,
    ledger.UpsertClaim: UPSERT_CLAIM,
}


async def _reserve(connection: Connection, change: ledger.Reserve) -> None:
    key = (change.driver, change.pool, change.device, change.capacity)
    if await connection.fetchval(RESERVE, *key, change.amount) is None:
        raise CapacityExceeded(
            f"no capacity {change.capacity!r} published for device "
            f"{change.driver}/{change.pool}/{change.device}"
        )


async def _release(connection: Connection, share_id: str, position: int) -> tuple[str, str] | None:
    """Release one share; the claim it belonged to, or None if nothing changed."""
    row = await connection.fetchrow(RELEASE_SHARE, share_id, position)
    if row is None:
        return None  # already released (or never reserved): subtract nothing
    await connection.execute(CLAIM_RELEASED, row[0], row[1], position, row[2], ["failed"])
    return (row[0], row[1])


async def _bind(connection: Connection, change: ledger.BindAllocation, position: int) -> None:
    await connection.execute(BIND_SHARES, list(change.share_ids), position)
    await connection.execute(
        BIND_CLAIM, change.namespace, change.name, change.allocation_version, change.node, position
    )
    await connection.execute(CLAIM_READY, change.namespace, change.name, position, None)


async def _apply_limit(connection: Connection, change: ledger.ApplyLimit, position: int) -> None:
    row = await connection.fetchrow(APPLY_LIMIT, change.share_id, change.level, position)
    if row is not None:
        await connection.execute(CLAIM_READY, row[0], row[1], position, row[2])


async def _request_release(
    connection: Connection, change: ledger.RequestRelease, position: int
) -> None:
    await connection.execute(
        REQUEST_RELEASE, change.namespace, change.name, change.allocation_version, position
    )
    await connection.execute(
        CLAIM_RELEASED,
        change.namespace,
        change.name,
        position,
        change.allocation_version,
        [
            "failed",
            "released",
            "ready",
            "allocated",
            "submitted",
            "admitted",
            "rejected",
            "unschedulable",
        ],
    )


async def _mark_unknown(connection: Connection, change: ledger.MarkUnknown, position: int) -> None:
    if change.share_id is not None:
        await connection.execute(UNKNOWN_SHARE, change.share_id, position)
    elif change.node is not None:
        await connection.execute(LEASE_EXPIRED, change.node, change.epoch, position)


async def _fence(connection: Connection, change: ledger.FenceNode, position: int) -> None:
    if await connection.fetchval(FENCE, change.node, change.epoch) is None:
        return  # a stale epoch changes nothing
    touched: dict[tuple[str, str], None] = {}
    for row in await connection.fetch(FENCED_SHARES, change.node):
        row2 = await connection.fetchrow(RELEASE_SHARE, row[0], position)
        if row2 is not None:
            touched[(row2[0], row2[1])] = None
    reason = f"node {change.node} fenced at epoch {change.epoch}"
    for namespace, name in touched:
        await connection.execute(FENCED_CLAIM, namespace, name, position, reason)


async def _one(connection: Connection, change: ledger.Change, position: int) -> None:
    match change:
        case ledger.Reserve():
            await _reserve(connection, change)
        case ledger.ReleaseShare():
            await _release(connection, change.share_id, position)
        case ledger.BindAllocation():
            await _bind(connection, change, position)
        case ledger.ApplyLimit():
            await _apply_limit(connection, change, position)
        case ledger.RequestRelease():
            await _request_release(connection, change, position)
        case ledger.MarkUnknown():
            await _mark_unknown(connection, change, position)
        case ledger.FenceNode():
            await _fence(connection, change, position)
        case _:
            raise TypeError(f"no SQL for {type(change).__name__}")


UPSERT_CLAIMS_SET: Final = (
    "INSERT INTO claims (namespace, name, phase, reason, position) "
    "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $6::bigint[]) "
    "ON CONFLICT (namespace, name) DO UPDATE SET position = EXCLUDED.position, "
    f"phase = CASE WHEN EXCLUDED.phase = 'submitted' AND claims.phase IN {_LIVE_PHASES} "
    "THEN claims.phase ELSE EXCLUDED.phase END, "
    "reason = CASE WHEN NOT (($5::bool[])[1]) OR (EXCLUDED.phase = 'submitted' AND "
    f"claims.phase IN {_LIVE_PHASES}) THEN claims.reason ELSE EXCLUDED.reason END"
)


async def _upsert_claims(connection: Connection, items: list[tuple[Any, ...]]) -> None:
    """One set-based statement when the run has distinct claims and one reason mode."""
    keys = {(a[0], a[1]) for a in items}
    modes = {a[4] for a in items}
    if len(items) < 8 or len(keys) != len(items) or len(modes) != 1:
        await connection.executemany(UPSERT_CLAIM, items)
        return
    columns = [list(c) for c in zip(*items, strict=True)]
    columns[4] = [columns[4][0]]
    await connection.execute(UPSERT_CLAIMS_SET, *columns)


RESERVE_MANY: Final = (
    "WITH v AS (SELECT driver, pool, device, capacity, sum(amount) AS amount FROM "
    "unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::numeric[]) "
    "AS u(driver, pool, device, capacity, amount) GROUP BY 1, 2, 3, 4) "
    "UPDATE capacity_ledger c SET allocated = c.allocated + v.amount FROM v "
    "WHERE c.driver = v.driver AND c.pool = v.pool AND c.device = v.device "
    "AND c.capacity = v.capacity RETURNING c.driver, c.pool, c.device, c.capacity"
)
#: A whole reservation run in one statement: ledger amounts (summed per row), the new
#: shares, their claims' allocation version. Three tables, so the CTEs cannot see or
#: disturb each other; returns the ledger rows found (a missing one is refused).
RESERVE_RUN: Final = (
    "WITH v AS (SELECT driver, pool, device, capacity, sum(amount) AS amount FROM "
    "unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::numeric[]) "
    "AS u(driver, pool, device, capacity, amount) GROUP BY 1, 2, 3, 4), "
    "r AS (UPDATE capacity_ledger c SET allocated = c.allocated + v.amount FROM v "
    "WHERE c.driver = v.driver AND c.pool = v.pool AND c.device = v.device "
    "AND c.capacity = v.capacity RETURNING c.driver, c.pool, c.device, c.capacity), "
    "s AS (INSERT INTO shares (share_id, namespace, claim, allocation_version, request, "
    "driver, pool, device, node, shared, admin_access, consumed, amounts, policy_version, "
    "state, position) SELECT share_id, namespace, claim, allocation_version, request, "
    "driver, pool, device, node, shared, admin_access, consumed, amounts, policy_version, "
    "'reserved', position FROM unnest($6::uuid[], $7::text[], $8::text[], $9::int[], "
    "$10::text[], $11::text[], $12::text[], $13::text[], $14::text[], $15::bool[], "
    "$16::bool[], $17::jsonb[], $18::jsonb[], $19::int[], $20::bigint[]) AS n(share_id, "
    "namespace, claim, allocation_version, request, driver, pool, device, node, shared, "
    "admin_access, consumed, amounts, policy_version, position)), "
    "c AS (UPDATE claims SET allocation_version = a.allocation_version FROM (SELECT "
    "DISTINCT namespace, claim, allocation_version FROM unnest($7::text[], $8::text[], "
    "$9::int[]) AS x(namespace, claim, allocation_version)) a WHERE claims.namespace = "
    "a.namespace AND claims.name = a.claim AND claims.allocation_version <> "
    "a.allocation_version) "
    "SELECT driver, pool, device, capacity FROM r"
)
#: A run of bindings for distinct claims: their shares bound and the claims upserted,
#: in one statement (shares and claims: disjoint tables).
BIND_RUN: Final = (
    "WITH s AS (UPDATE shares t SET state = 'bound', position = v.position "
    "FROM unnest($1::uuid[], $2::bigint[]) AS v(share_id, position) "
    "WHERE t.share_id = v.share_id AND t.state = 'reserved') "
    "INSERT INTO claims (namespace, name, phase, allocation_version, node, reason, position) "
    "SELECT namespace, name, 'allocated', allocation_version, node, NULL, position FROM "
    "unnest($3::text[], $4::text[], $5::int[], $6::text[], $7::bigint[]) AS b(namespace, "
    "name, allocation_version, node, position) ON CONFLICT (namespace, name) DO UPDATE "
    "SET phase = 'allocated', allocation_version = EXCLUDED.allocation_version, "
    "node = EXCLUDED.node, reason = NULL, position = EXCLUDED.position"
)
APPLY_LIMITS: Final = (
    "UPDATE shares s SET state = 'ready', level = v.level, position = v.position "
    "FROM unnest($1::uuid[], $2::text[], $3::bigint[]) AS v(share_id, level, position) "
    "WHERE s.share_id = v.share_id AND s.state IN ('reserved', 'bound') "
    "RETURNING s.namespace, s.claim, s.allocation_version, v.position"
)

#: Kinds whose changes touch disjoint tables and may run grouped by kind (see below).
_RESERVING: Final = (ledger.Reserve, ledger.HoldDevice, ledger.InsertShare)


async def _reserve_many(connection: Connection, changes: Sequence[ledger.Reserve]) -> None:
    """Every Reserve of a run in one statement (amounts summed per ledger row)."""
    if len(changes) == 1:
        await _reserve(connection, changes[0])
        return
    columns = list(
        zip(*((c.driver, c.pool, c.device, c.capacity, c.amount) for c in changes), strict=True)
    )
    found = {tuple(r) for r in await connection.fetch(RESERVE_MANY, *map(list, columns))}
    for change in changes:
        if (change.driver, change.pool, change.device, change.capacity) not in found:
            await _reserve(connection, change)  # raises: no such capacity


async def _reserving(connection: Connection, items: list[tuple[ledger.Change, int]]) -> None:
    """A run of Reserve / HoldDevice / InsertShare: one statement (or batch) per kind.

    The three write different tables (capacity ledger, device holds, shares) and a
    reservation only ever *adds* to the ledger, so running them kind by kind ends in
    the same rows as running them in log order, and fails (over capacity, a second
    hold) exactly when that would.
    """
    reserves = [c for c, _ in items if isinstance(c, ledger.Reserve)]
    holds = [_args(c, p) for c, p in items if isinstance(c, ledger.HoldDevice)]
    shares = [_args(c, p) for c, p in items if isinstance(c, ledger.InsertShare)]
    if holds:
        await connection.executemany(_BATCHED[ledger.HoldDevice], holds)
    versions: dict[tuple[str, str], set[int]] = {}
    for share in shares:
        versions.setdefault((share[1], share[2]), set()).add(share[3])
    if len(reserves) < 2 or any(len(v) > 1 for v in versions.values()):
        if reserves:
            await _reserve_many(connection, reserves)
        if shares:
            await connection.executemany(_BATCHED[ledger.InsertShare], shares)
        return
    ledger_columns = [
        list(c)
        for c in zip(
            *((r.driver, r.pool, r.device, r.capacity, r.amount) for r in reserves), strict=True
        )
    ]
    share_columns = (
        [list(c) for c in zip(*shares, strict=True)] if shares else [[] for _ in range(15)]
    )
    rows = await connection.fetch(RESERVE_RUN, *ledger_columns, *share_columns)
    found = {tuple(r) for r in rows}
    for change in reserves:
        if (change.driver, change.pool, change.device, change.capacity) not in found:
            await _reserve(connection, change)  # raises: no such capacity


async def _bind_many(connection: Connection, items: list[tuple[ledger.Change, int]]) -> None:
    """A run of BindAllocation for distinct claims: two statements for all of them."""
    binds = cast(list[tuple[ledger.BindAllocation, int]], items)
    if len({(c.namespace, c.name) for c, _ in binds}) != len(binds):
        for change, position in binds:
            await _bind(connection, change, position)
        return
    shares = [(s, p) for c, p in binds for s in c.share_ids]
    await connection.execute(
        BIND_RUN,
        [s for s, _ in shares],
        [p for _, p in shares],
        [c.namespace for c, _ in binds],
        [c.name for c, _ in binds],
        [c.allocation_version for c, _ in binds],
        [c.node for c, _ in binds],
        [p for _, p in binds],
    )
    await connection.executemany(CLAIM_READY, [(c.namespace, c.name, p, None) for c, p in binds])


async def _apply_limits(connection: Connection, items: list[tuple[ledger.Change, int]]) -> None:
    """A run of ApplyLimit for distinct shares: one update, then the claims made ready.

    A claim is checked once, at the highest position among its shares of the run —
    where, in log order, its last share became ready.
    """
    applies = cast(list[tuple[ledger.ApplyLimit, int]], items)
    if len(applies) == 1 or len({c.share_id for c, _ in applies}) != len(applies):
        for change, position in applies:
            await _apply_limit(connection, change, position)
        return
    rows = await connection.fetch(
        APPLY_LIMITS,
        [c.share_id for c, _ in applies],
        [c.level for c, _ in applies],
        [p for _, p in applies],
    )
    claims: dict[tuple[str, str, int], int] = {}
    for namespace, claim, version, position in rows:
        key = (namespace, claim, version)
        claims[key] = max(position, claims.get(key, 0))
    if claims:
        await connection.executemany(
            CLAIM_READY, [(n, c, p, v) for (n, c, v), p in sorted(claims.items())]
        )


def _run_of(item: tuple[ledger.Change, int]) -> type:
    kind = type(item[0])
    return ledger.Reserve if kind in _RESERVING else kind


async def apply_changes(
    connection: Connection, changes: Sequence[tuple[ledger.Change, int]]
) -> None:
    """Run the SQL of ``(change, position)`` pairs in order; batch runs where possible."""
    for kind, run in groupby(changes, key=_run_of):
        items = list(run)
        sql = _BATCHED.get(kind)
        if kind is ledger.Reserve:
            await _reserving(connection, items)
        elif kind is ledger.BindAllocation:
            await _bind_many(connection, items)
        elif kind is ledger.ApplyLimit:
            await _apply_limits(connection, items)
        elif kind is ledger.UpsertClaim:
            upserts = cast(list[tuple[ledger.UpsertClaim, int]], items)
            await _upsert_claims(
                connection,
                [(c.namespace, c.name, c.phase, c.reason, c.set_reason, p) for c, p in upserts],
            )
        elif sql is not None:
            await connection.executemany(sql, [_args(c, p) for c, p in items])
        else:
            for change, position in items:
                await _one(connection, change, position)


# -- the same changes, for the server (migration 0004) -----------------------------------


def _op(change: ledger.Change) -> list[Any]:
    """``[kind, arg, ...]`` of ``change`` for ``dracap_project`` (the offset goes second)."""
    match change:
        case ledger.SetTotal():
            return ["set_total", *_args(change, 0)[:4], str(change.total)]
        case ledger.Reserve():
            key = (change.driver, change.pool, change.device, change.capacity)
            return ["reserve", *key, str(change.amount)]
        case ledger.HoldDevice():
            return ["hold", *_args(change, 0)]
        case ledger.InsertShare():
            row = list(_args(change, 0)[:-1])  # the position comes from the offset
            row[11], row[12] = dict(change.consumed), _strings(change.amounts)
            return ["insert_share", *row]
        case ledger.ReleaseShare():
            return ["release_share", change.share_id]
        case ledger.BindAllocation():
            claim = (change.namespace, change.name, change.allocation_version, change.node)
            return ["bind", *claim, list(change.share_ids)]
        case ledger.ApplyLimit():
            return ["apply_limit", change.share_id, change.level]
        case ledger.FailLimit():
            return ["fail_limit", change.share_id, change.reason]
        case ledger.RequestRelease():
            return ["request_release", *_args(change, 0)[:3]]
        case ledger.MarkUnknown():
            return ["mark_unknown", change.share_id, change.node, change.epoch]
        case ledger.ConfirmShare():
            return ["confirm_share", change.share_id, change.node]
        case ledger.FenceNode():
            return ["fence", change.node, change.epoch]
        case ledger.UpsertClaim():
            return ["upsert_claim", *_args(change, 0)[:5]]
    raise TypeError(f"no server-side projection for {type(change).__name__}")


def server_ops(changes: Sequence[tuple[ledger.Change, int]]) -> bytes:
    """The JSON ``ops`` argument of ``dracap_project`` for ``(change, offset)`` pairs.

    Each op is ``[kind, offset, arg, ...]`` with the arguments of the client-side
    statement of that change, in the same order; the server applies them one by one
    in the order given (log order), which is the reference semantics the set-based
    runs above reproduce.
    """
    ops = []
    for change, offset in changes:
        op = _op(change)
        op.insert(1, offset)
        ops.append(op)
    return _JSON.encode(ops)
