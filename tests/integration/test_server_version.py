"""A service that reaches a nats-server too old for the reply window says so, once.

Both brokers are real nats-servers started from ``dracap auth init``'s files: the one
``dracap up`` runs (new enough: no warning) and, where the machine has one, an older
nats-server found on ``PATH`` (Debian's 2.9.10 on the development machines), which must
draw exactly one warning per process however many services connect.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.runtime.bus import serverversion
from services.runtime.bus.jetstream import connect_bus
from services.runtime.bus.serverversion import OLDEST_ADVISED
from services.runtime.ops.embedded import EmbeddedNats, nats_server_binary
from tests.fixtures.brokers import Broker, secure_broker
from tests.fixtures.polling import until

LOGGER = serverversion.__name__


def _version_of(binary: Path) -> tuple[int, int, int] | None:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    word = done.stdout.strip().rsplit(" ", 1)[-1].lstrip("v")  # "nats-server: v2.9.10"
    try:
        major, minor, patch = (int(part) for part in word.split("-")[0].split("."))
    except ValueError:
        return None
    return major, minor, patch


def _an_old_server() -> Path | None:
    """The first nats-server on ``PATH`` older than the advised one (an activated venv
    puts the wheel's, new enough, before the system's)."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("nats-server", path=folder) if folder else None
        if found is not None:
            version = _version_of(Path(found))
            if version is not None and version < OLDEST_ADVISED:
                return Path(found)
    return None


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget what this process already warned of (the module keeps it per process)."""
    monkeypatch.setattr(serverversion, "_warned", set())


@pytest.fixture
def current(tmp_path: Path) -> Iterator[Broker]:
    with secure_broker(tmp_path, binary=nats_server_binary()) as running:
        yield running


@pytest.fixture
def old(tmp_path: Path) -> Iterator[Broker]:
    binary = _an_old_server()
    if binary is None:
        pytest.skip(f"no nats-server older than {OLDEST_ADVISED} on PATH")
    with secure_broker(tmp_path, binary=binary) as running:
        yield running


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]


@pytest.mark.usefixtures("fresh_warnings")
async def test_a_current_server_draws_no_warning(
    current: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    nc, _ = await connect_bus(current.url, credential=current.auth.service("relay"))
    try:
        version = serverversion.server_version(nc)
        assert version is not None and version >= OLDEST_ADVISED, version
        assert not serverversion.check_server(nc)
    finally:
        await nc.close()
    assert _warnings(caplog) == []


@pytest.mark.usefixtures("fresh_warnings")
async def test_an_old_server_draws_one_warning_per_process(
    old: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    connections = [
        await connect_bus(old.url, credential=old.auth.service(service))
        for service in ("relay", "reservation", "claims")
    ]
    try:
        assert all(serverversion.check_server(nc) for nc, _ in connections)
    finally:
        for nc, _ in connections:
            await nc.close()
    said = _warnings(caplog)
    assert len(said) == 1, said
    assert "older than 2.10.25" in said[0] and "issue 6058" in said[0], said[0]
    assert said[0].startswith(f"NATS {old.url}: nats-server 2."), said[0]


@pytest.mark.usefixtures("fresh_warnings")
async def test_an_open_server_is_not_judged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a credential (``dracap up --insecure``) the server has no users and no
    reply permissions: an old one draws no warning."""
    binary = _an_old_server()
    if binary is None:
        pytest.skip(f"no nats-server older than {OLDEST_ADVISED} on PATH")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = EmbeddedNats(tmp_path, binary=binary)
    url = server.start()
    try:
        nc, _ = await connect_bus(url)
        try:
            assert serverversion.too_old(serverversion.server_version(nc))
        finally:
            await nc.close()
    finally:
        server.stop()
    assert _warnings(caplog) == []


@pytest.mark.usefixtures("fresh_warnings")
async def test_a_reconnect_to_an_old_server_draws_the_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker behind the address is replaced by an older one (a cluster's other
    server, or a downgrade in place): the reconnected service says so."""
    binary = _an_old_server()
    if binary is None:
        pytest.skip(f"no nats-server older than {OLDEST_ADVISED} on PATH")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with secure_broker(tmp_path / "new", binary=nats_server_binary()) as current:
        nc, _ = await connect_bus(current.url, credential=current.auth.service("relay"))
    try:
        assert _warnings(caplog) == []
        port = nc.connected_url.port if nc.connected_url is not None else None
        old = EmbeddedNats(tmp_path / "old", port=port, config=current.auth.accounts, binary=binary)
        old.start()
        try:
            await until(lambda: _warnings(caplog), within=60, what="the warning after reconnecting")
            assert nc.is_connected and serverversion.check_server(nc)
        finally:
            old.stop()
    finally:
        await nc.close()
