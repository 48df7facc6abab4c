"""The settings and typed errors of issue 29's high availability, without servers.

* a failover's errors are retryable by type (``TargetServerAttributeNotMatched``,
  ``ReadOnlySQLTransactionError``, a crash shutdown), and a session that broke under a
  write is :class:`ConnectionLost`, the one retryable error whose write may have been
  committed;
* ``DRACAP_FAILOVER_TIMEOUT_S``, ``DRACAP_STREAM_REPLICAS`` and
  ``DRACAP_NATS_PING_INTERVAL_S`` are read, checked and defaulted so that ``dracap up``
  stays on one server;
* a NATS URL setting may name several servers; the stream takes its replica count;
* ``dracap serve relay --stream-replicas N`` parses and refuses what JetStream would.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import asyncpg
import pytest

from events.subjects import BusNames
from services.runtime.bus.jetstream import server_urls, stream_config
from services.runtime.ground.errors import (
    ConnectionLost,
    PermanentError,
    RetryableError,
    map_database_error,
)
from services.runtime.ground.settings import Settings, SettingsError, load_settings
from services.runtime.store.failover import Deadline, is_ambiguous


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.TargetServerAttributeNotMatched("no host accepts writes"),
        asyncpg.ReadOnlySQLTransactionError("cannot execute INSERT in a read-only transaction"),
        asyncpg.CrashShutdownError("the server crashed"),
        asyncpg.AdminShutdownError("terminating connection"),
        ConnectionRefusedError(111, "refused"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_failover_is_retryable_by_type(exc: BaseException) -> None:
    assert isinstance(map_database_error(exc), RetryableError)


def test_only_a_broken_session_leaves_a_write_in_doubt() -> None:
    lost = ConnectionLost("connection lost during an append")
    assert isinstance(lost, RetryableError)
    assert map_database_error(lost) is lost
    assert is_ambiguous(lost)
    assert is_ambiguous(asyncpg.ConnectionDoesNotExistError("closed in the middle"))
    # refused before anything was sent, or rolled back by the server: nothing committed
    assert not is_ambiguous(asyncpg.TargetServerAttributeNotMatched("no primary"))
    assert not is_ambiguous(asyncpg.SerializationError("could not serialize"))
    assert not is_ambiguous(asyncpg.ReadOnlySQLTransactionError("read-only"))


def test_a_syntax_error_stays_permanent() -> None:
    assert isinstance(map_database_error(asyncpg.PostgresSyntaxError("bad")), PermanentError)


def test_the_defaults_keep_one_server() -> None:
    settings = load_settings({})
    assert settings.stream_replicas is None  # a new stream gets 1, an old one keeps its own
    assert settings.failover_timeout_s == 30.0
    assert settings.nats_ping_interval_s == 5.0
    assert Settings().stream_replicas is None


def test_the_variables_are_read() -> None:
    settings = load_settings(
        {
            "DRACAP_FAILOVER_TIMEOUT_S": "12.5",
            "DRACAP_STREAM_REPLICAS": "3",
            "DRACAP_NATS_PING_INTERVAL_S": "2",
            "DRACAP_NATS_URL": "nats://a:4222,nats://b:4222",
        }
    )
    assert settings.failover_timeout_s == 12.5
    assert settings.stream_replicas == 3
    assert settings.nats_ping_interval_s == 2.0
    assert server_urls(settings.nats_url) == ["nats://a:4222", "nats://b:4222"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DRACAP_STREAM_REPLICAS", "0"),
        ("DRACAP_STREAM_REPLICAS", "6"),
        ("DRACAP_STREAM_REPLICAS", "three"),
        ("DRACAP_FAILOVER_TIMEOUT_S", "-1"),
        ("DRACAP_FAILOVER_TIMEOUT_S", "nan"),
        ("DRACAP_FAILOVER_TIMEOUT_S", "soon"),
        ("DRACAP_NATS_PING_INTERVAL_S", "0"),
    ],
)
def test_a_bad_value_is_refused_with_its_name(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        load_settings({name: value})


def test_a_server_list_is_split_and_trimmed() -> None:
    assert server_urls("nats://a:1") == ["nats://a:1"]
    assert server_urls(" nats://a:1 , nats://b:2,, ") == ["nats://a:1", "nats://b:2"]


def test_the_stream_takes_its_replicas() -> None:
    names = BusNames(prefix="t")
    assert stream_config(names).num_replicas == 1
    assert stream_config(names, replicas=3).num_replicas == 3


def test_the_relay_flag_parses_and_refuses() -> None:
    from services.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "relay", "--stream-replicas", "3"])
    assert args.stream_replicas == 3
    assert parser.parse_args(["serve", "relay"]).stream_replicas is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "relay", "--stream-replicas", "9"])


async def test_a_deadline_counts_from_the_first_failure() -> None:
    deadline = Deadline(0.2)
    started = time.monotonic()
    tries = 0
    while await deadline.wait():
        tries += 1
    assert deadline.expired()
    assert tries >= 2
    assert 0.2 <= time.monotonic() - started < 5.0
    await asyncio.sleep(0)
