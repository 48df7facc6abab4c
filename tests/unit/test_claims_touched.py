"""Which claims' views an event changed: the same answers at the cost of what it names.

:class:`~services.claims.views.ClaimsTouched` (the claims API's watch and the Kubernetes
bridge) must answer, event by event, what :func:`~services.claims.views.claims_touched`
read off the whole state before; and a node-wide event or a device's health must not
walk every share of the log.
"""

from __future__ import annotations

from typing import Any

from events import catalog as c
from events.fold import apply
from events.state import ClusterState, ShareState
from services.claims.views import ClaimsTouched, claims_touched
from tests.unit.decision_fixtures import NODE, POOL, Log, gpu, inventory, memory_claim

DRIVER = "gpu.test.io"


class _Walked(dict[str, ShareState]):
    """The state's shares, counting every walk over all of them."""

    walks = 0

    def values(self) -> Any:
        type(self).walks += 1
        return super().values()


def _lifecycle() -> Log:
    log = Log(*inventory(gpu("gpu-0"), gpu("gpu-1")))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=10_000))
    log.reserve(*(memory_claim(f"c{i}", "2Gi") for i in range(6)))
    state = log.state()
    held = sorted(state.shares)
    first = state.shares[held[0]]
    log.add(
        c.CapacityReleased(
            share_id=first.share_id,
            driver=first.driver,
            pool=first.pool,
            device=first.device,
            allocation_version=first.allocation_version,
            consumed=first.consumed,
            admin_access=False,
        ),
        c.DeviceHealthChanged(
            node=NODE, driver=first.driver, pool=POOL, device="gpu-0", healthy=False
        ),
        c.NodeLeaseExpired(node=NODE, epoch=1),
        *(c.ShareMarkedUnknown(share_id=s, node=NODE) for s in held[1:]),
        c.NodeFenced(node=NODE, epoch=1, reason="off"),
        c.NodeLeaseAcquired(node=NODE, epoch=2, boot_id="b2", ttl_ms=10_000),
    )
    log.reserve(memory_claim("after", "2Gi"), memory_claim("later", "2Gi"))
    log.add(c.NodeLeaseExpired(node=NODE, epoch=2))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=3, boot_id="b3", ttl_ms=10_000))
    for share in sorted(s.share_id for s in log.state().shares.values() if s.state == "unknown"):
        log.add(c.ShareConfirmed(share_id=share, node=NODE))
    log.add(c.NodeLeaseExpired(node=NODE, epoch=3), c.NodeFenced(node=NODE, epoch=3))
    return log


def test_the_same_claims_as_a_walk_over_every_share() -> None:
    log = _lifecycle()
    state = ClusterState()
    touched = ClaimsTouched(state)
    seen: list[tuple[c.Event, list[Any]]] = []
    for env in log.envelopes:
        apply(state, env)
        expected = claims_touched(state, env)
        assert touched(state, env) == expected, (c.tag_of(env.event), env.position)
        seen.append((env.event, expected))
    wide = [keys for e, keys in seen if isinstance(e, c.NodeLeaseExpired | c.NodeFenced)]
    assert all(wide) and any(len(keys) > 1 for keys in wide)  # the table is not empty


def test_node_wide_events_do_not_walk_the_log() -> None:
    log = _lifecycle()
    cut = next(
        i for i, env in enumerate(log.envelopes) if isinstance(env.event, c.DeviceHealthChanged)
    )
    state = ClusterState()
    for env in log.envelopes[:cut]:
        apply(state, env)
    touched = ClaimsTouched(state)  # started on a state with live shares
    state.shares = _Walked(state.shares)
    for env in log.envelopes[cut:]:
        apply(state, env)
        touched(state, env)
    assert _Walked.walks == 0
