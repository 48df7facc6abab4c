"""The tc enforcer's rtnetlink backend against a real kernel (network namespaces, veth).

The kernel's own view is read with the ``tc`` tool (``tc -d``: every HTB parameter,
burst and rate-table cell size included), so the netlink path is judged by the same
independent reader as the process path: what one writes must print exactly as what the
other writes. Skipped without CAP_NET_ADMIN.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from events.quantities import Quantity
from services.enforcement.enforcers import PermanentEnforcementError
from services.enforcement.proving import NetnsPair
from services.enforcement.tc import HTB_MAJOR, TcEnforcer, TcError
from services.enforcement.tcnetlink import NetlinkTc, rate_table, tick_in_usec

pytest_plugins = ["tests.fixtures.netns"]

SHARES = {"share-a": "50M", "share-b": "10M", "share-big": "5G", "share-odd": "123456789"}


async def _run(*argv: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, (argv, err.decode())
    return out.decode()


async def _tc(pair: NetnsPair, *args: str) -> str:
    return await _run("tc", "-n", pair.tx_ns, *args)


async def _kernel_text(pair: NetnsPair) -> tuple[str, str, str]:
    """Qdisc, classes and filters of the sender's veth as ``tc -d`` prints them (no
    counters: they are the kernel's, not the writer's)."""
    qdisc = await _tc(pair, "-d", "qdisc", "show", "dev", pair.tx_if, "root")
    classes = await _tc(pair, "-d", "class", "show", "dev", pair.tx_if)
    filters = await _tc(pair, "-d", "filter", "show", "dev", pair.tx_if, "parent", "dca:")
    qdisc = re.sub(r"refcnt \d+ |direct_packets_stat \d+ ", "", qdisc)
    return qdisc, "\n".join(sorted(classes.splitlines())), filters


async def _apply_all(enforcer: TcEnforcer, pair: NetnsPair) -> None:
    for share_id, rate in SHARES.items():
        await enforcer.apply(pair.limit(share_id, rate))


async def test_both_backends_write_the_same_kernel_state(netns_pair: NetnsPair) -> None:
    process = netns_pair.enforcer(backend="tc")
    await _apply_all(process, netns_pair)
    by_process = await _kernel_text(netns_pair)
    assert "htb" in by_process[0] and "dca:ffff" in by_process[1]
    await _tc(netns_pair, "qdisc", "del", "dev", netns_pair.tx_if, "root")
    assert "dca:" not in await _tc(netns_pair, "class", "show", "dev", netns_pair.tx_if)

    netlink = netns_pair.enforcer(backend="netlink")
    await _apply_all(netlink, netns_pair)
    by_netlink = await _kernel_text(netns_pair)
    assert by_netlink == by_process
    # each backend reads what the other wrote, down to the rates (iproute2 before 6.3
    # prints class rates as rounded text: the process path reads 123456k for share-odd)
    observed = await netlink.observe()
    by_tc = await process.observe()
    assert {s: a for s, a in observed.items() if s != "share-odd"} == {
        s: a for s, a in by_tc.items() if s != "share-odd"
    }
    assert {s: a.actual["bandwidth"] for s, a in observed.items()} == {
        s: Quantity.parse(r) if r != "123456789" else Quantity.from_int(123456792)
        for s, r in SHARES.items()
    }
    netlink_filters = await netlink.filters(netns_pair.tx_if)
    assert netlink_filters == await process.filters(netns_pair.tx_if)
    assert sorted(f.share_id for f in netlink_filters) == sorted(SHARES)
    netlink.close()


async def test_read_back_and_idempotent_apply(netns_pair: NetnsPair) -> None:
    enforcer = netns_pair.enforcer()
    first = await enforcer.apply(netns_pair.limit("share-a", "50M"))
    assert first.level == "hard"
    assert first.actual == {"bandwidth": Quantity.parse("50M")}
    before = await _kernel_text(netns_pair)
    again = await enforcer.apply(netns_pair.limit("share-a", "50M"))
    assert again == first
    assert await _kernel_text(netns_pair) == before
    (f,) = await enforcer.filters(netns_pair.tx_if)
    assert f.share_id == "share-a"
    assert f.mark == f.minor << 16
    assert f"flowid dca:{f.minor:x}" in before[2]
    assert f"pref {f.minor} bpf" in before[2]
    plain = await _tc(netns_pair, "class", "show", "dev", netns_pair.tx_if)
    assert f"class htb dca:{f.minor:x} root prio 0 rate 50Mbit ceil 50Mbit" in plain


async def test_rate_change_keeps_class_and_filter(netns_pair: NetnsPair) -> None:
    enforcer = netns_pair.enforcer()
    await enforcer.apply(netns_pair.limit("share-a", "50M"))
    (before,) = await enforcer.filters(netns_pair.tx_if)
    changed = await enforcer.apply(netns_pair.limit("share-a", "20M"))
    assert changed.actual == {"bandwidth": Quantity.parse("20M")}
    (after,) = await enforcer.filters(netns_pair.tx_if)
    assert after == before  # the same minor, mark and filter
    classes = await _tc(netns_pair, "class", "show", "dev", netns_pair.tx_if)
    assert f"class htb dca:{after.minor:x} root prio 0 rate 20Mbit ceil 20Mbit" in classes
    assert "50Mbit" not in classes
    # the process backend reads the new rate too
    assert (await netns_pair.enforcer(backend="tc").observe())["share-a"] == changed


async def test_remove_deletes_filter_then_class(netns_pair: NetnsPair) -> None:
    enforcer = netns_pair.enforcer()
    await enforcer.apply(netns_pair.limit("share-a", "50M"))
    await enforcer.apply(netns_pair.limit("share-b", "10M"))
    minors = {f.share_id: f.minor for f in await enforcer.filters(netns_pair.tx_if)}
    await enforcer.remove("share-a")
    await enforcer.remove("share-a")
    await enforcer.remove("never-applied")
    _, classes, filters = await _kernel_text(netns_pair)
    assert f"dca:{minors['share-a']:x} " not in classes
    assert f"dca:{minors['share-b']:x} " in classes
    assert f"pref {minors['share-a']} " not in filters
    assert set(await enforcer.observe()) == {"share-b"}


async def test_down_interface_still_gets_the_htb_root(netns_pair: NetnsPair) -> None:
    await _run("ip", "-n", netns_pair.tx_ns, "link", "set", netns_pair.tx_if, "down")
    enforcer = netns_pair.enforcer()
    applied = await enforcer.apply(netns_pair.limit("share-a", "50M"))
    assert applied.actual == {"bandwidth": Quantity.parse("50M")}
    qdisc, classes, _ = await _kernel_text(netns_pair)
    assert qdisc.startswith("qdisc htb dca: root")
    assert "dca:ffff" in classes
    # a fresh enforcer (an agent restarted while the link is down) finds it in place
    assert await netns_pair.enforcer().observe() == {"share-a": applied}
    await _run("ip", "-n", netns_pair.tx_ns, "link", "set", netns_pair.tx_if, "up")
    assert await enforcer.observe() == {"share-a": applied}


async def test_foreign_root_is_refused(netns_pair: NetnsPair) -> None:
    # an operator's HTB under another handle is not dracap's
    await _tc(netns_pair, "qdisc", "add", "dev", netns_pair.tx_if, "root", "handle", "1:", "htb")
    with pytest.raises(PermanentEnforcementError, match="root qdisc htb 1:"):
        await netns_pair.enforcer().apply(netns_pair.limit("share-a", "50M"))
    assert "qdisc htb 1: root" in await _tc(netns_pair, "qdisc", "show", "dev", netns_pair.tx_if)


async def test_interface_created_again_is_found_by_its_new_index(netns_pair: NetnsPair) -> None:
    enforcer = netns_pair.enforcer()
    await enforcer.apply(netns_pair.limit("share-a", "50M"))
    # the veth is replaced by a new interface of the same name: a new index
    await _run("ip", "-n", netns_pair.tx_ns, "link", "del", netns_pair.tx_if)
    await _run("ip", "-n", netns_pair.tx_ns, "link", "add", netns_pair.tx_if, "type", "veth",
               "peer", "name", "again0")  # fmt: skip
    assert await enforcer.observe() == {}
    applied = await enforcer.apply(netns_pair.limit("share-a", "50M"))
    assert applied.actual == {"bandwidth": Quantity.parse("50M")}
    assert "dca:" in await _tc(netns_pair, "class", "show", "dev", netns_pair.tx_if)


async def test_missing_interface_is_reported_missing(netns_pair: NetnsPair) -> None:
    kernel = NetlinkTc(netns_pair.tx_ns)
    with pytest.raises(TcError, match="No such device") as err:
        await kernel.root("nosuchnic0")
    assert err.value.missing
    kernel.close()


def test_rate_tables_are_iproute2s() -> None:
    """tc_calc_rtable for 50 Mbit/s, mtu 1600 (cell_log 3): slot i sends (i+1)*8 bytes."""
    table = rate_table(6_250_000)
    assert len(table) == 1024
    first = int.from_bytes(table[:4], "little")
    assert first == int(int(1_000_000 * 8 / 6_250_000) * tick_in_usec())
    assert rate_table(6_250_000) is table  # cached
    assert HTB_MAJOR == 0xDCA
