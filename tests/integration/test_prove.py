"""``dracap prove bandwidth`` end to end, through the real control plane.

The command runs as a user would (``services.cli.main``, in a thread: it has its own
event loop) against the test's database and NATS server with a unique subject prefix:
the in-process stack (relay, live state, claims API, reservation worker) plus the
prove node's agent with a tc enforcer on a fresh veth pair. Two shares (20M, 50M) over
a 2 s window; the JSON report must have its full shape, every claim must have become
Ready through the control plane, each share must achieve its rate within ±15 % (the
window is short; the 10 s proof holds ±3 %), and the capacity must be given back.
Skipped, with the reason, without CAP_NET_ADMIN (tests/fixtures/netns.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import msgspec
import nats.js.errors
import pytest

from events.subjects import BusNames
from services import cli
from services.enforcement.proving import ProofReport, ShareFigures
from services.exitcodes import ExitCode
from services.runtime.bus.jetstream import connect_bus

pytest_plugins = ["tests.fixtures.netns"]

RATES = (20_000_000, 50_000_000)
TOLERANCE = 0.15


@pytest.fixture
def net_admin() -> None:
    """Skip (before any server fixture starts) without CAP_NET_ADMIN, veth, HTB, cls_bpf."""
    from tests.fixtures.netns import require_net_admin  # a plugin: imported by pytest first

    require_net_admin()


@pytest.mark.parametrize("backend", ["netlink", "tc"])
async def test_prove_bandwidth_through_the_control_plane(
    net_admin: None,
    database_url: str,
    nats_url: str,
    capsys: pytest.CaptureFixture[str],
    backend: str,
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    argv = [
        "prove", "bandwidth", "--rates", "20M,50M", "--duration", "2", "-o", "json",
        "--database-url", database_url, "--nats", nats_url, "--prefix", prefix,
        "--tc-backend", backend,
    ]  # fmt: skip
    capsys.readouterr()
    try:
        code = await asyncio.to_thread(cli.main, argv)
    finally:
        nc, js = await connect_bus(nats_url)  # the run's stream goes with the test
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_stream(BusNames(prefix).stream)
        await nc.close()
    out, err = capsys.readouterr()
    # INVARIANT_VIOLATED: a 3 % goal missed over the short window; others: no run
    assert code in (ExitCode.OK, ExitCode.INVARIANT_VIOLATED), err
    raw = json.loads(out)
    report = msgspec.convert(raw, ProofReport)  # every field there, with its type

    assert set(raw) == set(ProofReport.__struct_fields__)
    assert all(set(s) == set(ShareFigures.__struct_fields__) for s in raw["shares"])
    assert report.allocation.startswith("control plane")
    assert "in-process stack" in report.control_plane
    assert f"TcEnforcer ({backend})" in report.control_plane
    assert report.duration == 2
    assert report.capacity_returned, "the claims' capacity was not given back"
    assert [s.configured for s in report.shares] == list(RATES)
    assert len({s.share_id for s in report.shares}) == len(RATES)
    assert len({s.mark for s in report.shares}) == len(RATES)
    assert all(s.mark > 0 for s in report.shares)
    assert all(s.claim.startswith("prove/") for s in report.shares)
    assert all(0 < s.ready_ms < 30_000 for s in report.shares)
    assert 0 < report.probe_ready_ms < 30_000
    assert report.probe_rate == 10_000_000
    assert report.probe_samples > 0 and report.probe_p99_ms is not None
    assert len(report.apply_change_ms) == 10
    assert report.aggressor_rate > 0
    for share in report.shares:
        for what, rate in (("alone", share.alone), ("loaded", share.achieved)):
            assert abs(rate / share.configured - 1) <= TOLERANCE, (what, share)
        assert abs(share.kernel_rate / share.configured - 1) <= TOLERANCE, share
