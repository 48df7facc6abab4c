"""The service event loop: uvloop unless told otherwise."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from services.runtime import eventloop


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_services_run_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRACAP_EVENT_LOOP", raising=False)
    assert eventloop.loop_name() == "uvloop"
    assert issubclass(eventloop.run(_loop_type()), uvloop.Loop)


def test_the_standard_loop_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRACAP_EVENT_LOOP", "asyncio")
    assert eventloop.loop_name() == "asyncio"
    assert not issubclass(eventloop.run(_loop_type()), uvloop.Loop)
