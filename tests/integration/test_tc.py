"""The tc enforcer against a real kernel, in network namespaces (see tests/fixtures/netns.py).

Traffic tests run one Python sender and one receiver per test inside the namespaces
(:func:`services.enforcement.proving.run_load`); the sender marks each flow with its
share's mark, the receiver counts link-layer bytes. Skipped without CAP_NET_ADMIN.
Every test against the kernel runs over both backends (rtnetlink and ``tc`` processes).
"""

from __future__ import annotations

import pytest

from events.quantities import Quantity
from services.enforcement.enforcers import PermanentEnforcementError, ShareLimit
from services.enforcement.proving import Flow, NetnsPair, run_load
from services.enforcement.tc import (
    BACKENDS,
    HTB_MAJOR,
    MINOR_FIRST,
    MINOR_LAST,
    Backend,
    TcEnforcer,
    candidate_minors,
    decode_program,
    encode_program,
    parse_class_text,
    parse_rate_text,
    sprint_rate,
)

pytest_plugins = ["tests.fixtures.netns"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """The enforcer's way to the kernel: each test runs with both."""
    value: Backend = request.param
    return value


# -- pure parts (no kernel)


def test_minors_are_stable_and_probe_deterministically() -> None:
    first = list(candidate_minors("share-a"))[:3]
    assert first == list(candidate_minors("share-a"))[:3]
    assert all(MINOR_FIRST <= m <= MINOR_LAST for m in first)
    assert first[1] == (first[0] + 1 if first[0] < MINOR_LAST else MINOR_FIRST)
    assert len(set(candidate_minors("x"))) == MINOR_LAST - MINOR_FIRST + 1


@pytest.mark.parametrize("share_id", ["a", "abcd", "0b5e3c8e-5d1e-4b7e-9a37-2f0c1d2e3f40", "é" * 7])
def test_program_round_trips_its_share_id(share_id: str) -> None:
    program = encode_program(0x12340000, 0xFFFF0000, share_id)
    assert decode_program(program) == (0x12340000, 0xFFFF0000, share_id)
    assert 3 + program[2][2] == len(program) - 1  # no match: jump to the last ret


def test_rates_print_and_parse_like_tc() -> None:
    assert sprint_rate(6_250_000) == "50Mbit"
    assert sprint_rate(125_000_000) == "1Gbit"
    assert sprint_rate(150) == "1200bit"
    assert parse_rate_text("50Mbit") == 6_250_000
    assert parse_rate_text("1200bit") == 150
    text = (
        "class htb dca:1a root prio 0 rate 50Mbit ceil 50Mbit burst 1600b cburst 1600b \n"
        " Sent 1000 bytes 10 pkt (dropped 2, overlimits 3 requeues 0) \n"
        "class htb 1:1 root prio 0 rate 1Mbit ceil 1Mbit burst 1600b cburst 1600b \n"
    )
    (cls,) = parse_class_text(text)
    assert (cls.minor, cls.rate, cls.bytes, cls.drops) == (0x1A, 6_250_000, 1000, 2)
    assert HTB_MAJOR == 0xDCA


async def test_unknown_device_is_permanent(backend: Backend) -> None:
    enforcer = TcEnforcer({("d", "p", "eth0"): "eth0"}, backend=backend)
    limit = ShareLimit(
        share_id="s",
        driver="d",
        pool="p",
        device="other",
        consumed={"bandwidth": Quantity.parse("1M")},
    )
    with pytest.raises(PermanentEnforcementError) as err:
        await enforcer.apply(limit)
    assert "d/p/other" in str(err.value)


# -- against the kernel


async def _kernel(pair: NetnsPair, enforcer: TcEnforcer) -> tuple[set[int], dict[str, int]]:
    classes = {c.minor for c in await enforcer.classes(pair.tx_if)}
    filters = {f.share_id: f.minor for f in await enforcer.filters(pair.tx_if)}
    return classes, filters


async def test_apply_is_idempotent_and_observed(netns_pair: NetnsPair, backend: Backend) -> None:
    enforcer = netns_pair.enforcer(backend=backend)
    first = await enforcer.apply(netns_pair.limit("share-a", "50M"))
    again = await enforcer.apply(netns_pair.limit("share-a", "50M"))
    assert first == again
    assert first.level == "hard"
    assert first.actual == {"bandwidth": Quantity.parse("50M")}
    classes, filters = await _kernel(netns_pair, enforcer)
    assert list(filters) == ["share-a"]
    assert classes == {filters["share-a"], 0xFFFF}  # one share class + the default class
    # a fresh enforcer (an agent after a restart) sees the same from the kernel alone
    assert await netns_pair.enforcer(backend=backend).observe() == {"share-a": first}
    changed = await enforcer.apply(netns_pair.limit("share-a", "20M"))
    assert changed.actual == {"bandwidth": Quantity.parse("20M")}
    assert (await enforcer.observe())["share-a"] == changed
    assert (await _kernel(netns_pair, enforcer))[1] == filters  # same class, same mark


async def test_remove_deletes_class_and_filter(netns_pair: NetnsPair, backend: Backend) -> None:
    enforcer = netns_pair.enforcer(backend=backend)
    await enforcer.apply(netns_pair.limit("share-a", "10M"))
    await enforcer.apply(netns_pair.limit("share-b", "30M"))
    _, filters = await _kernel(netns_pair, enforcer)
    await enforcer.remove("share-a")
    await enforcer.remove("share-a")  # idempotent
    await enforcer.remove("never-applied")
    classes, after = await _kernel(netns_pair, enforcer)
    assert after == {"share-b": filters["share-b"]}
    assert filters["share-a"] not in classes
    assert set(await enforcer.observe()) == {"share-b"}


async def test_interface_missing_in_kernel_is_permanent(
    netns_pair: NetnsPair, backend: Backend
) -> None:
    enforcer = TcEnforcer(
        {("d", "p", "nic"): "nosuchnic0"}, netns=netns_pair.tx_ns, backend=backend
    )
    limit = ShareLimit(
        share_id="s",
        driver="d",
        pool="p",
        device="nic",
        consumed={"bandwidth": Quantity.parse("1M")},
    )
    with pytest.raises(PermanentEnforcementError) as err:
        await enforcer.apply(limit)
    assert "nosuchnic0 does not exist" in str(err.value)
    assert await enforcer.observe() == {}


async def test_two_shares_each_get_their_rate(netns_pair: NetnsPair, backend: Backend) -> None:
    enforcer = netns_pair.enforcer(default_rate=10**9, backend=backend)
    rates = {"share-50": 50e6, "share-200": 200e6}
    marks: dict[str, int] = {}
    for share_id, rate in rates.items():
        await enforcer.apply(netns_pair.limit(share_id, Quantity.from_int(int(rate))))
        mark = await enforcer.mark_of(share_id)
        assert mark is not None
        marks[share_id] = mark
    flows = [Flow(s, marks[s], 0.0, 4.0) for s in rates]
    flows.append(Flow("unclassified", 0, 0.0, 4.0))  # a saturating neighbour
    result = await run_load(netns_pair, flows)
    for share_id, rate in rates.items():
        achieved = result.rate(share_id, 1.0, 4.0)
        assert abs(achieved / rate - 1) <= 0.10, (share_id, achieved)
