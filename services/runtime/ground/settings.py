"""Runtime settings, read once from the environment.

Every process of dracap (services, the CLI, alembic's ``env.py``, the benchmarks)
builds one :class:`Settings` with :func:`load_settings` and passes it down; nothing
else reads ``os.environ`` for these values. The variables are:

=============================== ============================================ =========
variable                        meaning                                      default
=============================== ============================================ =========
``DRACAP_DATABASE_URL``         PostgreSQL URL (libpq form; several hosts    local
                                ``h1:p1,h2:p2`` with
                                ``target_session_attrs=read-write`` for a
                                replicated server)
``DRACAP_NATS_URL``             NATS server URL, or several servers of one   local
                                cluster, comma-separated
``DRACAP_STREAM_REPLICAS``      replicas of the events stream and its        keep
                                consumers (3 on a clustered NATS); unset: a
                                new stream gets 1, an existing one keeps its
``DRACAP_NATS_PING_INTERVAL_S`` seconds between a NATS client's pings; two   5
                                unanswered pings: the server is lost
``DRACAP_STATEMENT_TIMEOUT_MS`` ``statement_timeout`` of every connection    30000
``DRACAP_POOL_MIN_SIZE``        asyncpg pool minimum size                    1
``DRACAP_POOL_MAX_SIZE``        asyncpg pool maximum size                    10
``DRACAP_FAILOVER_TIMEOUT_S``   how long connects, appends and reads of the  30
                                log are tried again while no database host
                                accepts writes (a failover:
                                :mod:`services.runtime.store.failover`)
``DRACAP_APP_ROLE``             role the services act as (``SET ROLE``);     dracap_app
                                empty string: act as the connecting user
``DRACAP_DATABASE_URL_<KIND>``  the URL the services of one kind connect     —
                                with (``CLAIMS``, ``RESERVATION``, ``RELAY``,
                                ``READONLY``, ``RECLAMATION``, ``LEDGER``,
                                ``SNAPSHOTS``, ``ENFORCEMENT``), as its own
                                user
=============================== ============================================ =========

The app role is the one that migrations grant INSERT/SELECT on the event log to and
nothing more, so a service that runs ``SET ROLE dracap_app`` cannot rewrite history
even with a bug. Tests connect as an administrator and switch role the same way.

A kind named by ``DRACAP_DATABASE_URL_<KIND>`` connects with that URL and acts as its
user, with the rights of the group role that user belongs to (``dracap_claims``, …;
migration 0006, ``docs/database-roles.md``): no ``role`` switch. Kinds not named keep
``DRACAP_DATABASE_URL`` and ``DRACAP_APP_ROLE``, so nothing changes for an operator who
names none. :meth:`Settings.for_service` is the one place that picks.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

import msgspec

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/dracap"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_APP_ROLE = "dracap_app"
DEFAULT_FAILOVER_TIMEOUT_S = 30.0
DEFAULT_NATS_PING_INTERVAL_S = 5.0
#: the most replicas a JetStream stream may have
MAX_STREAM_REPLICAS = 5


class SettingsError(ValueError):
    """An environment variable holds a value that cannot be used."""


class ServiceKind(enum.StrEnum):
    """The kinds of service that connect to the database, each with its own role."""

    CLAIMS = "claims"  #: the claims and admin API
    RESERVATION = "reservation"
    RELAY = "relay"
    RECLAMATION = "reclamation"  #: lease expiry and the fence hook (migration 0007)
    READONLY = "readonly"  #: the live state's reads, ``dracap replay verify``
    LEDGER = "ledger"  #: the audit and billing subscribers' own tables (migration 0009)
    SNAPSHOTS = "snapshots"  #: the snapshot writer (migration 0010)
    #: the enforcement service: node agents' reports and lease renewals (migration 0011)
    ENFORCEMENT = "enforcement"


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Connection and tuning settings of one dracap process."""

    database_url: str = DEFAULT_DATABASE_URL
    nats_url: str = DEFAULT_NATS_URL
    statement_timeout_ms: int = 30_000
    pool_min_size: int = 1
    pool_max_size: int = 10
    app_role: str = DEFAULT_APP_ROLE
    #: seconds a failover may last: connects, appends and log reads are tried again
    #: for this long (:mod:`services.runtime.store.failover`)
    failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S
    #: replicas of the events stream and its durable consumers; None: a new stream gets
    #: 1 (one nats-server), an existing one keeps its own
    stream_replicas: int | None = None
    #: seconds between two pings of a NATS client (a server that misses two is lost)
    nats_ping_interval_s: float = DEFAULT_NATS_PING_INTERVAL_S
    #: service kind (a :class:`ServiceKind`) -> the URL its services connect with, as that
    #: URL's user
    database_urls: dict[str, str] = msgspec.field(default_factory=dict)

    def with_database(self, url: str) -> Settings:
        """A copy that connects to ``url`` instead."""
        return msgspec.structs.replace(self, database_url=url)

    def for_service(self, kind: ServiceKind) -> Settings:
        """The settings a service of ``kind`` connects with: its own URL when one is named,
        acting as that URL's user; else these settings unchanged. (Node agents have none:
        they talk to NATS only.)"""
        url = self.database_urls.get(kind)
        if not url:
            return self
        return msgspec.structs.replace(self, database_url=url, app_role="")


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: not an integer") from None
    if value < minimum:
        raise SettingsError(f"{name}={value}: must be at least {minimum}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: not a number of seconds") from None
    if not value >= minimum:  # NaN too
        raise SettingsError(f"{name}={value}: must be at least {minimum}")
    return value


def stream_replicas(value: int, source: str = "DRACAP_STREAM_REPLICAS") -> int:
    """``value`` if JetStream accepts it as a stream's replica count (1 to 5)."""
    if not 1 <= value <= MAX_STREAM_REPLICAS:
        raise SettingsError(f"{source}={value}: must be from 1 to {MAX_STREAM_REPLICAS}")
    return value


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Build :class:`Settings` from ``env`` (default: the process environment)."""
    env = os.environ if env is None else env
    settings = Settings(
        database_url=env.get("DRACAP_DATABASE_URL") or DEFAULT_DATABASE_URL,
        nats_url=env.get("DRACAP_NATS_URL") or DEFAULT_NATS_URL,
        statement_timeout_ms=_int(env, "DRACAP_STATEMENT_TIMEOUT_MS", 30_000, 0),
        pool_min_size=_int(env, "DRACAP_POOL_MIN_SIZE", 1, 0),
        pool_max_size=_int(env, "DRACAP_POOL_MAX_SIZE", 10, 1),
        app_role=env.get("DRACAP_APP_ROLE", DEFAULT_APP_ROLE),
        failover_timeout_s=_seconds(
            env, "DRACAP_FAILOVER_TIMEOUT_S", DEFAULT_FAILOVER_TIMEOUT_S, 0.0
        ),
        stream_replicas=(
            stream_replicas(_int(env, "DRACAP_STREAM_REPLICAS", 1, 1))
            if env.get("DRACAP_STREAM_REPLICAS")
            else None
        ),
        nats_ping_interval_s=_seconds(
            env, "DRACAP_NATS_PING_INTERVAL_S", DEFAULT_NATS_PING_INTERVAL_S, 0.1
        ),
        database_urls={
            kind.value: url
            for kind in ServiceKind
            if (url := env.get(f"DRACAP_DATABASE_URL_{kind.name}"))
        },
    )
    if settings.pool_min_size > settings.pool_max_size:
        raise SettingsError("DRACAP_POOL_MIN_SIZE is larger than DRACAP_POOL_MAX_SIZE")
    return settings
