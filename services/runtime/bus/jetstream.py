"""The JetStream side of the runtime: connecting, and the one stream of events.

Every event of the Postgres log that a durable consumer reads is published once (by
:mod:`services.runtime.delivery.relaying`) to the stream
:attr:`BusNames.stream <events.subjects.BusNames.stream>`, which holds the subjects
``{prefix}.ev.>``. The stream is the bus, not the source of truth: it can
be deleted and rebuilt from the log by resetting the relay's checkpoint.

Stream configuration, and why:

* **file storage**: a nats-server restart must not lose what consumers have not read;
* **limits retention**: consumers come and go (an agent per node), so messages are not
  removed when one consumer acknowledges them; ``max_age`` bounds the size (default
  7 days: longer than any consumer should be down);
* **consumers**: at most :data:`MAX_CONSUMERS` (a durable one per node agent, plus the
  services'); named explicitly, since nats-server 2.11 and later cap a stream that names
  none at 1,000, fewer than a fleet's nodes;
* **no purge, no message deletes** (``deny_purge``, ``deny_delete``): nats-server
  refuses both API calls for this stream, whoever sends them, and no update can lift
  the flags once set; the stream only loses messages by age;
* **replicas** (``Settings.stream_replicas``, ``DRACAP_STREAM_REPLICAS``,
  ``dracap serve relay --stream-replicas N``; unset: a new stream gets 1 and an
  existing one keeps its own, so only a number given changes it): on a clustered NATS, 3 keeps
  the stream — and every durable consumer, which takes its stream's replica count
  (``num_replicas`` 0) — on three servers: a publish is acknowledged once a majority
  stored it, and the loss of one server (the stream's leader too) loses nothing
  acknowledged; the relay publishes again what was not, and the duplicate window
  below absorbs what was. ``dracap up`` runs one server and keeps 1;
* **duplicate window** (default 2 minutes): the server remembers each message's
  ``Nats-Msg-Id`` (the event id) for this long and acknowledges a second publish of
  it as a duplicate without storing it. The relay re-publishes at most one window of
  events after a crash, immediately on restart, so this makes a crash harmless.

:func:`ensure_stream` creates the stream or brings an existing one's settings up to
date; only the stream's owner calls it (the relay: :mod:`services.runtime.delivery.rebuilding`,
which also says what happens when the broker loses the stream). What goes wrong there
reaches the caller as an error of the runtime tree
(:func:`services.runtime.ground.errors.map_bus_error`): retryable (JetStream not answering
yet), permanent, or a conflict.

Durable consumers: :class:`Durable` names one (its name and filter) and
:func:`durable_config` is its JetStream configuration, the same for whoever creates it
(its owner: :mod:`services.durables` says who that is for each).

:func:`connect_bus` connects to one server or to any of a cluster's (a comma-separated
list), pings it every :data:`PING_INTERVAL_S` seconds (two pings unanswered: lost, try
another), logs in with a user's credential (its JetStream context then uses
the API prefix of the user's account: ``Credential.js_api_prefix``), reconnects
forever and logs the connection's changes of state only: a lost connection is one
warning, its return one info line. nats-py's default error callback would log every
failed reconnect attempt with its traceback, twice a second for as long as the server
is away; here such errors are debug lines
(:func:`services.runtime.ground.outages.is_unreachable`). Any other error reported to the
callback — an exception of a subscription's handler, say — is logged with its
traceback, as nats-py would: that one is a bug. A connection with a credential warns,
once, of a server older than the reply window needs
(:mod:`services.runtime.bus.serverversion`).
"""

from __future__ import annotations

import logging
from typing import Final

import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import BadRequestError, NotFoundError

from events.subjects import BusNames
from services.runtime.bus.credentials import Credential
from services.runtime.bus.serverversion import check_server
from services.runtime.ground.errors import map_bus_error
from services.runtime.ground.outages import is_unreachable, one_line

__all__ = [
    "ACK_WAIT_S",
    "DUPLICATE_WINDOW_S",
    "MAX_AGE_S",
    "MAX_CONSUMERS",
    "Durable",
    "api_prefix",
    "connect_bus",
    "durable_config",
    "ensure_stream",
    "prefix_of",
    "server_urls",
    "stream_config",
    "with_timeout",
]

DUPLICATE_WINDOW_S: Final = 120.0
#: Durable consumers the stream may have: one per node agent, and the services'.
MAX_CONSUMERS: Final = 100_000
MAX_AGE_S: Final = 7 * 24 * 3600.0
ACK_WAIT_S: Final = 30.0
#: Seconds between a client's pings (nats-py's default is 120: a server that hangs
#: would go unnoticed for four minutes).
PING_INTERVAL_S: Final = 5.0
#: Unanswered pings after which the server is taken as lost and another one tried.
MAX_OUTSTANDING_PINGS: Final = 2
STREAM_NAME_IN_USE: Final = 10058  # JetStream API error code
#: How nats-server's refusal of a publish or subscribe begins (after "nats: ").
PERMISSIONS_VIOLATION: Final = "permissions violation"
#: nats-server's own JetStream API prefix (no domain)
DEFAULT_API_PREFIX: Final = "$JS.API"

_log = logging.getLogger(__name__)


class _ConnectionLog:
    """nats-py's callbacks for one connection: a line per change of state, no tracebacks."""

    def __init__(self, url: str, *, judge_version: bool) -> None:
        self._url = url
        self._judge_version = judge_version  #: warn of a server too old for the reply window
        self.nc: Client | None = None  #: set once connected

    async def disconnected(self) -> None:
        if self.nc is not None and not self.nc.is_closed:  # our own close() says nothing
            _log.warning("NATS %s: connection lost; reconnecting", self._url)

    async def reconnected(self) -> None:
        _log.info("NATS %s: reconnected", self._url)
        if self.nc is not None and self._judge_version:  # perhaps another server of a cluster
            check_server(self.nc)

    async def error(self, exc: Exception) -> None:
        if is_unreachable(exc):  # a lost connection or a failed reconnect attempt
            _log.debug("NATS %s: %s", self._url, one_line(exc))
        elif type(exc) is nats.errors.Error and PERMISSIONS_VIOLATION in str(exc):
            # the server's word (-ERR), no traceback of ours to show: after a broker
            # restart, a reply to a request the old server routed is refused this way
            _log.warning("NATS %s: %s", self._url, one_line(exc))
        else:  # an exception of a callback of ours: its traceback says where
            _log.error("NATS %s: %s", self._url, one_line(exc), exc_info=exc)


def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or several of one cluster separated
    by commas (``nats://h1:4222,nats://h2:4222``); blanks around them are ignored."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    return servers or [url]


async def connect_bus(
    url: str,
    *,
    name: str = "dracap",
    connect_timeout: float = 5.0,
    credential: Credential | None = None,
    ping_interval: float = PING_INTERVAL_S,
) -> tuple[Client, JetStreamContext]:
    """A NATS connection (reconnecting forever) and its JetStream context.

    ``url``: one server, or several of a cluster, comma-separated (:func:`server_urls`):
    the client connects to one of them and, when it is lost, to another (nats-py also
    learns the cluster's other servers from the one it reached). ``credential``: log in
    as that user (NKey, own inbox prefix); ``None`` connects without credentials, which
    only an open server (``dracap up --insecure``) accepts. ``ping_interval``: seconds
    between pings; a server that leaves :data:`MAX_OUTSTANDING_PINGS` unanswered is
    taken as lost (one that hangs keeps its socket open: only the pings tell).
    """
    events = _ConnectionLog(url, judge_version=credential is not None)
    login = credential.connect_options() if credential is not None else {}
    nc = await nats.connect(
        servers=server_urls(url),
        name=name,
        **login,
        connect_timeout=connect_timeout,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=ping_interval,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        error_cb=events.error,
        disconnected_cb=events.disconnected,
        reconnected_cb=events.reconnected,
    )
    events.nc = nc
    if credential is not None:  # an open server has no reply permissions to judge
        check_server(nc)
    return nc, nc.jetstream(prefix=api_prefix(credential), timeout=connect_timeout)


def api_prefix(credential: Credential | None) -> str:
    """The JetStream API prefix of a client logged in as ``credential``: its account's
    (:attr:`Credential.js_api_prefix`), or ``$JS.API`` on an open server (``None``), where
    the one account holds the JetStream."""
    return credential.js_api_prefix if credential is not None else DEFAULT_API_PREFIX


def prefix_of(js: JetStreamContext) -> str:
    """The API prefix ``js`` sends its requests to (what :func:`connect_bus` gave it;
    nats-py keeps it private)."""
    prefix: str = js._prefix
    return prefix


def with_timeout(js: JetStreamContext, timeout: float) -> JetStreamContext:
    """A JetStream context on ``js``'s connection and API prefix whose requests wait at
    most ``timeout`` seconds for their answer (nats-py keeps both private)."""
    nc: Client = js._nc
    return nc.jetstream(prefix=prefix_of(js), timeout=timeout)


class Durable(msgspec.Struct, frozen=True):
    """One durable pull consumer of the events stream: its name and subject filter."""

    name: str
    filter_subject: str
    ack_wait: float = ACK_WAIT_S


def durable_config(durable: Durable) -> ConsumerConfig:
    """The JetStream configuration of ``durable``: explicit acks, every message the
    stream holds, unlimited deliveries (the consumer counts them:
    :mod:`services.runtime.delivery.consuming`)."""
    return ConsumerConfig(
        name=durable.name,  # with the filter in the API subject: brokers can permit it
        durable_name=durable.name,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        filter_subject=durable.filter_subject,
        ack_wait=durable.ack_wait,
        max_deliver=-1,
    )


def stream_config(
    names: BusNames,
    *,
    duplicate_window: float = DUPLICATE_WINDOW_S,
    max_age: float = MAX_AGE_S,
    first_seq: int | None = None,
    replicas: int | None = None,
) -> StreamConfig:
    """The configuration of the events stream (see the module docstring); ``first_seq``:
    the sequence its first message takes (a stream rebuilt from the log starts at the
    first position it republishes); ``replicas``: its copies on a clustered NATS (None:
    1)."""
    return StreamConfig(
        num_replicas=replicas or 1,
        name=names.stream,
        subjects=[names.events_subjects],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=max_age,
        duplicate_window=duplicate_window,
        max_consumers=MAX_CONSUMERS,
        deny_purge=True,
        deny_delete=True,
        first_seq=first_seq if first_seq is not None and first_seq > 1 else None,
    )


async def ensure_stream(
    js: JetStreamContext,
    names: BusNames,
    *,
    duplicate_window: float = DUPLICATE_WINDOW_S,
    max_age: float = MAX_AGE_S,
    first_seq: int | None = None,
    current: StreamInfo | None = None,
    replicas: int | None = None,
) -> StreamInfo:
    """Create the events stream, or update an existing one to this configuration
    (``first_seq`` counts only for a stream created now; ``current``: the stream's info
    just read, which spares reading it again; ``replicas``: its copies, changed on an
    existing stream too — nats-server adds or removes peers; None: 1 for a new stream,
    an existing one keeps its own).

    A failure is an error of the runtime tree
    (:func:`~services.runtime.ground.errors.map_bus_error`).
    """
    config = stream_config(
        names,
        duplicate_window=duplicate_window,
        max_age=max_age,
        first_seq=first_seq,
        replicas=replicas,
    )
    try:
        return await _ensure(js, config, current, keep_replicas=replicas is None)
    except (nats.errors.Error, OSError) as exc:
        raise map_bus_error(exc, subject=names.events_subjects) from exc


async def _ensure(
    js: JetStreamContext, config: StreamConfig, current: StreamInfo | None, *, keep_replicas: bool
) -> StreamInfo:
    name = config.name
    assert name is not None
    try:
        current = current or await js.stream_info(name)
    except NotFoundError:
        try:
            return await js.add_stream(config)
        except BadRequestError as exc:  # created concurrently by another process
            if exc.err_code != STREAM_NAME_IN_USE:
                raise
            current = await js.stream_info(name)
    if keep_replicas:  # nobody asked for a number: an operator's choice stays
        config = config.evolve(num_replicas=current.config.num_replicas)
    if _differs(current.config, config):
        return await js.update_stream(config.evolve(first_seq=None))
    return current


def _differs(current: StreamConfig, wanted: StreamConfig) -> bool:
    return (
        current.subjects != wanted.subjects
        or current.duplicate_window != wanted.duplicate_window
        or current.max_age != wanted.max_age
        or current.max_consumers != wanted.max_consumers
        or current.deny_purge != wanted.deny_purge
        or current.deny_delete != wanted.deny_delete
        or (current.num_replicas or 1) != (wanted.num_replicas or 1)
    )
