"""What the log's subscribers that answer queries (audit, billing) share.

Each is a catch-up projector of the log (:class:`~services.runtime.delivery.projecting.
Projector`: it reads the log itself from its position and writes its own tables in
batches, one transaction per batch) and, given a NATS connection, serves its queries on
``<prefix>.<service>...`` while it projects (:func:`~services.runtime.bus.queries.
serving_queries`: a tenant's subject answers for that tenant's namespace only).
:class:`QueryingSubscriber` is that shell; a subscriber adds ``write`` (its reads and
writes for a batch of envelopes, in log order) and ``query`` (its answer to a decoded
filter). :func:`decode_query` reads a query's filter, naming the field that is wrong.

Their tables are a function of the log, so they can be checked against it (issue 24:
the ledger's login could rewrite them and nothing would notice): each subscriber
recomputes its rows from the log up to its position with the same pure functions and
reports every row that differs, as :class:`Difference` s (:func:`differences` compares
two keyed sets of rows; ``dracap audit verify``, ``dracap usage verify``).

Both keep the nodes' epochs (:class:`~events.transitions.NodeEpochs`) in a table of
their own (``audit_nodes``, ``billing_nodes``) of the same columns;
:func:`read_node_epochs` and :func:`write_node_epochs` read and write it.

**Look-ups by key** (:func:`key_probe`, :func:`planned_now`). A batch reads the rows of
the claims and shares it names from tables that hold a row for every claim or share
ever seen, so a look-up must cost what the batch names, not what the table holds. Two
rules, each for a way it did not (issue 25):

* the statement is one probe of the primary key per key named (``unnest`` of the keys,
  a ``LATERAL`` subquery with ``LIMIT 1`` per key: the ``LIMIT`` keeps the planner from
  flattening it into a join), not ``IN (SELECT * FROM unnest(...))``, which the planner
  answered, for a batch of more than ~100 keys, with a hash join over a scan of the
  whole table;
* it is planned for the table as it is *now*: asyncpg keeps a prepared statement for as
  long as the connection lives, and PostgreSQL may then reuse one generic plan, made
  while the table was small, until an ``ANALYZE`` of it (never, on a server without
  autovacuum). Audit's ``share_id = ANY($1)`` was so planned early in a run as a scan:
  190 ms per batch at 100,000 claims (a core of PostgreSQL for half a minute after a
  fill, a burst each second in every run after); a key probe planned while the table
  was small and analysed is a loop of scans, worse. :func:`planned_now` has the batch's
  look-ups planned at each execution (``plan_cache_mode``, for them only: the batch's
  inserts keep their cached plans).

``tests/integration/test_lookup_plans.py`` shows both on real PostgreSQL.

**Writes** (:func:`insert_columns`, :func:`insert_rows`). A batch's rows of a table go in
as one statement over one JSON array of them (``INSERT ... SELECT ... FROM
json_to_recordset($1::json)``), not as ``executemany``: asyncpg sends those in one round
trip, but PostgreSQL runs each row as a statement of its own (a bind and an execution),
which costs it more than the insert, and asyncpg encodes each value on its own. A
throwaway script on this project's 2-core machine, rows of ``audit_records``' shape,
1,000 a transaction, per row (the server's CPU / the client's, the client's including
making the rows): ``executemany`` 31 / 13 µs; one statement over one array per column
(``unnest``) 18 / 21 µs, asyncpg's array encoding costing the client what the server
saved; one statement over JSON 22 / 11 µs. msgspec writes the JSON of a batch's structs
in one call, and PostgreSQL's input functions read each value from its text, so a row
lands as it did (the pipeline tests' ``verify`` compares every row with the log).
``tests/integration/test_subscriber_writes.py`` counts the statements.

Like every reader of the log they skip the events the fold refuses
(:mod:`events.folding`): the projector leaves out a row that does not decode, and one
the subscriber's live view refused (the process's own view, given one, else a
:class:`~services.runtime.store.livestate.LiveState` the subscriber keeps itself), brought
to each batch's last position as the batch starts (``follow_on_demand``, unless the
process's view is tailed anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args

import msgspec

from events.envelopes import Envelope
from events.transitions import NodeEpochs
from services.runtime.bus.credentials import Directory
from services.runtime.bus.queries import QueryError, serving_queries
from services.runtime.delivery.projecting import Projector
from services.runtime.ground.context import ServiceContext
from services.runtime.store.eventstore import Connection, EventStore
from services.runtime.store.livestate import LiveState

__all__ = [
    "Difference",
    "NodeTable",
    "QueryingSubscriber",
    "decode_query",
    "differences",
    "insert_columns",
    "insert_rows",
    "key_probe",
    "planned_now",
    "read_node_epochs",
    "write_node_epochs",
]

F = TypeVar("F")


def decode_query(data: bytes, typ: type[F]) -> F:
    """The filter ``typ`` of a query payload; :class:`QueryError` naming the field otherwise."""
    try:
        return msgspec.json.decode(data or b"{}", type=typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        field = text.split("`$.", 1)[1].split("`", 1)[0] if "`$." in text else "request"
        raise QueryError(field, text) from None
    except msgspec.DecodeError as exc:
        raise QueryError("request", f"must be a JSON object: {exc}") from None


class Difference(msgspec.Struct, frozen=True, kw_only=True):
    """A row of a subscriber's table that is not what the log says it must be.

    ``problem``: ``missing`` (the log implies the row, the table lacks it), ``extra``
    (the table has a row the log does not imply) or ``differs`` (``columns`` differ:
    ``expected`` from the log, ``found`` in the table).
    """

    table: str
    key: str
    problem: str
    columns: list[str] = []
    expected: dict[str, Any] = {}
    found: dict[str, Any] = {}


def differences(
    table: str,
    expected: Mapping[Any, msgspec.Struct],
    found: Mapping[Any, msgspec.Struct],
) -> list[Difference]:
    """Every key whose row differs between ``expected`` and ``found`` (same Struct type),
    in key order."""
    out: list[Difference] = []
    for key in sorted(expected.keys() | found.keys(), key=repr):
        want, got = expected.get(key), found.get(key)
        name = "/".join(str(part) for part in key) if isinstance(key, tuple) else str(key)
        if got is None:
            out.append(Difference(table=table, key=name, problem="missing"))
        elif want is None:
            out.append(Difference(table=table, key=name, problem="extra"))
        elif want != got:
            wanted, seen = msgspec.to_builtins(want), msgspec.to_builtins(got)
            columns = [c for c in wanted if wanted[c] != seen.get(c)]
            out.append(
                Difference(
                    table=table,
                    key=name,
                    problem="differs",
                    columns=columns,
                    expected={c: wanted[c] for c in columns},
                    found={c: seen.get(c) for c in columns},
                )
            )
    return out


class QueryingSubscriber:
    """A projector of the log that serves queries on ``service`` (module docstring)."""

    #: the queries' subject word (``audit``, ``usage``)
    service: str = ""
    #: the projector's name (its position's row) unless given another
    consumer: str = ""
    #: the event tags the subscriber reads (None: every event)
    types: Collection[str] | None = None

    def __init__(
        self,
        context: ServiceContext[EventStore],
        *,
        name: str | None = None,
        directory: Directory | None = None,
        authenticated: bool = False,
        live: LiveState | None = None,
    ) -> None:
        store = self.store = context.stores
        #: the view that says which events the fold refused (the process's, or its own)
        self.live = live if live is not None else LiveState(store)
        self._own_live = live is None
        self.names = context.names
        self.nc = context.connection  #: None: the projector only, no query endpoints
        self.directory = directory
        self.authenticated = authenticated
        self.projector = Projector(
            store, name or self.consumer, self.write, types=self.types, live=self.live
        )

    async def write(
        self, connection: Connection, envs: Sequence[Envelope]
    ) -> Callable[[], None] | None:
        """The subscriber's reads and writes for ``envs`` (a batch, in log order), inside
        the transaction that moves its position; what to run once it has committed."""
        raise NotImplementedError

    async def query(self, namespace: str | None, data: bytes) -> dict[str, Any]:
        """The answer to a query; ``namespace``: the tenant it is limited to."""
        raise NotImplementedError

    async def run(self, stop: asyncio.Event) -> None:
        """Project (and serve queries, with ``nc``) until ``stop`` is set."""
        tail: asyncio.Task[None] | None = None
        if self._own_live:  # its own view, read as each batch asks (LiveState's docstring)
            if not self.live.state.position:
                await self.live.load_snapshot()
            tail = asyncio.create_task(self.live.follow_on_demand(asyncio.Event()))
        try:
            await serving_queries(
                lambda: self.projector.run(stop),
                self.nc,
                self.names,
                service=self.service,
                query=self.query,
                directory=self.directory,
                authenticated=self.authenticated,
            )
        finally:
            if tail is not None:
                tail.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tail


def key_probe(table: str, columns: str, key: Sequence[str]) -> str:
    """A statement of the rows of ``table`` (its ``columns``: expressions of the row,
    comma-separated) whose ``key`` columns (text, its primary key) are one of the keys
    given as one text array per key column (``$1``, ``$2``, ...): one probe of the key
    per key given (module docstring). ``table`` and the columns come from code, never
    from input."""
    params = ", ".join(f"${i}::text[]" for i in range(1, len(key) + 1))
    match = " AND ".join(f"t.{k} = k.{k}" for k in key)
    return (
        f"SELECT {', '.join('r.' + c.strip() for c in columns.split(','))} "
        f"FROM unnest({params}) AS k({', '.join(key)}) "
        f"CROSS JOIN LATERAL (SELECT * FROM {table} t WHERE {match} LIMIT 1) r"
    )


def insert_columns(table: str, columns: Sequence[tuple[str, str]], conflict: str) -> str:
    """An ``INSERT`` into ``table`` of its ``columns`` (name, SQL type each) from a JSON
    array of objects keyed by column (``$1``), with ``conflict`` as its ``ON CONFLICT``
    clause: a batch of rows, however many, in one execution (module docstring, "Writes").
    The table, columns and clause come from code, never from input."""
    names = ", ".join(name for name, _ in columns)
    typed = ", ".join(f"{name} {kind}" for name, kind in columns)
    return (
        f"INSERT INTO {table} ({names}) SELECT {names} "
        f"FROM json_to_recordset($1::json) AS r({typed}) ON CONFLICT {conflict}"
    )


async def insert_rows(connection: Connection, statement: str, rows: Sequence[Any]) -> None:
    """Run an :func:`insert_columns` statement on ``rows`` (each a struct or mapping that
    msgspec encodes as an object keyed by column; a column it lacks is NULL), sent as one
    JSON array; nothing when there are none. The rows of an upsert name each key once
    (an ``ON CONFLICT DO UPDATE`` may not change a row twice in one statement)."""
    if rows:
        await connection.execute(statement, msgspec.json.encode(rows).decode())


@contextlib.asynccontextmanager
async def planned_now(connection: Connection) -> AsyncIterator[None]:
    """Within a transaction: the statements run inside are planned for the tables as they
    are at each execution, not with a plan the connection cached (module docstring)."""
    await connection.execute("SET LOCAL plan_cache_mode = force_custom_plan")
    yield
    await connection.execute("SET LOCAL plan_cache_mode TO DEFAULT")


#: the subscribers' tables of node epochs (a name from code, never from input, goes into SQL)
NodeTable = Literal["audit_nodes", "billing_nodes"]


async def read_node_epochs(
    connection: Connection, table: NodeTable, nodes: Collection[str] | None = None
) -> dict[str, NodeEpochs]:
    """The rows of ``table`` (a subscriber's nodes' epochs) of ``nodes``, by node; every
    row when ``nodes`` is None."""
    sql = f"SELECT node, lease_epoch, fenced_epoch FROM {table}"
    if nodes is None:
        rows = await connection.fetch(sql)
    elif nodes:
        rows = await connection.fetch(f"{sql} WHERE node = ANY($1::text[])", sorted(nodes))
    else:
        rows = []
    return {
        row[0]: NodeEpochs(node=row[0], lease_epoch=row[1], fenced_epoch=row[2]) for row in rows
    }


_UPSERT_NODES: dict[str, str] = {  # NodeEpochs' fields are the columns
    table: insert_columns(
        table,
        (("node", "text"), ("lease_epoch", "bigint"), ("fenced_epoch", "bigint")),
        "(node) DO UPDATE SET lease_epoch = excluded.lease_epoch, "
        "fenced_epoch = excluded.fenced_epoch",
    )
    for table in get_args(NodeTable)
}


async def write_node_epochs(
    connection: Connection, table: NodeTable, epochs: Mapping[str, NodeEpochs]
) -> None:
    """Upsert ``epochs`` into ``table`` (a subscriber's nodes' epochs)."""
    await insert_rows(
        connection,
        _UPSERT_NODES[table],
        list(epochs.values()),
    )
