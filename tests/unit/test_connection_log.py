"""What a NATS connection's error callback logs: one line for the server's word, a
traceback only for an exception of dracap's own callbacks."""

from __future__ import annotations

import logging

import nats.errors
import pytest

from services.runtime.bus.jetstream import _ConnectionLog


async def test_a_refused_reply_is_one_warning_line(caplog: pytest.LogCaptureFixture) -> None:
    # what nats-py hands the callback for the server's -ERR after a broker restart
    refused = nats.errors.Error('nats: permissions violation for publish to "_r_.tfabty.skk1uu"')
    with caplog.at_level(logging.DEBUG, logger="services.runtime.bus.jetstream"):
        await _ConnectionLog("nats://h:4222", judge_version=True).error(refused)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "permissions violation" in record.getMessage()


async def test_a_callbacks_own_failure_keeps_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="services.runtime.bus.jetstream"):
        await _ConnectionLog("nats://h:4222", judge_version=True).error(KeyError("bug"))
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
